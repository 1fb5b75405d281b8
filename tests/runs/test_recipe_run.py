"""`streamrl run` with the recipe's pieces, end to end on a tiny model: a user filter with
over-sampling, W&B in offline mode, and the debug modes (rollout_only, train_only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import TINY, step_records, streamrl_run
from wandb_helpers import wandb_history

pytestmark = pytest.mark.slow

USER_FILTER = "tests.e2e_filters:drop_odd_prompts"


def write_config(tmp_path: Path, name: str, *, steps: int = 3, extra: str = "") -> Path:
    path = tmp_path / f"{name}.toml"
    text = TINY.format(steps=steps, eta=1, out=tmp_path / name, save_interval=0)
    path.write_text(text.replace("[train]\n", f"[train]\n{extra}\n", 1))
    return path


def test_a_user_filter_drops_half_the_groups_and_over_sampling_keeps_every_batch_full(
    tmp_path, monkeypatch
):
    """The filter drops every odd prompt; with over_sampling_batch_size = 2 * batch_size
    every step still trains batch_size groups, within the staleness bound, and the drops
    are counted under the filter's name (metrics.jsonl, summary.json, and W&B offline)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = write_config(tmp_path, "filtered", steps=3)
    text = config.read_text().replace("max_staleness = 1\n", "max_staleness = 1\n"
        f'filters = ["{USER_FILTER}"]\n', 1)  # fmt: skip
    text = text.replace("[rollout]\n", "[rollout]\nover_sampling_batch_size = 4\n", 1)
    text = text.replace("[logging]\n", '[logging]\nwandb = true\nwandb_project = "test"\n', 1)
    config.write_text(text)
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "filtered"
    steps = step_records(run_dir)
    assert [r["samples_trained"] for r in steps] == [8, 16, 24]  # 2 groups x 4 samples a step
    for record in steps:
        assert all(seq % 2 == 0 for seq in record["prompt_seqs"])
        assert len(record["prompt_seqs"]) == 2 and record["staleness_max"] <= 1
    assert steps[-1][f"filtered/{USER_FILTER}"] >= 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accounting_ok"]
    assert summary["buffer"]["filtered_by"][USER_FILTER] == summary["groups_filtered"] >= 3

    history = wandb_history(run_dir)
    logged = [row for row in history if "step" in row]
    assert [row["checkpoint/step"] for row in history if "checkpoint/step" in row] == [3]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for key in ("reward_mean", "train/loss", "train/lr", f"filtered/{USER_FILTER}"):
        assert [r[key] for r in logged] == [r[key] for r in steps], key


def test_a_replay_of_saved_rollouts_trains_exactly_as_the_run_that_generated_them(tmp_path):
    """A normal run with train.save_rollouts, then train_only on its rollouts/: the same
    groups on the same initial model give the same loss at every step (CPU, bit for bit)."""
    config = write_config(tmp_path, "normal", extra="save_rollouts = true")
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = tmp_path / "normal" / "rollouts"
    assert sorted(p.name for p in saved.iterdir()) == [f"step_00000{k}.msgpack" for k in (1, 2, 3)]
    normal = step_records(tmp_path / "normal")

    replays = []
    for name in ("replay", "replay_again"):
        replay = write_config(
            tmp_path, name, extra=f'mode = "train_only"\nload_rollouts = "{saved}"'
        )
        result = streamrl_run(replay)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "engine" not in " ".join(p.name for p in (tmp_path / name / "logs").glob("*"))
        replays.append(step_records(tmp_path / name))
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "reward_mean"):
        assert [r[key] for r in replays[0]] == [r[key] for r in normal], key
        assert [r[key] for r in replays[1]] == [r[key] for r in replays[0]], key
    assert [r["prompt_seqs"] for r in replays[0]] == [r["prompt_seqs"] for r in normal]


def test_rollout_only_writes_every_step_without_training_and_train_only_replays_it(tmp_path):
    config = write_config(tmp_path, "rollouts", extra='mode = "rollout_only"')
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "rollouts"
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [0, 0, 0]  # no optimizer step, no weight push
    assert not any(key.startswith("train/loss") for r in steps for key in r)
    assert not (run_dir / "checkpoints").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["engine_versions"].values()) == {0}
    assert summary["groups_trained"] == 6

    replay = write_config(
        tmp_path,
        "train",
        steps=3,
        extra=f'mode = "train_only"\nload_rollouts = "{run_dir / "rollouts"}"',
    )
    result = streamrl_run(replay)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = step_records(tmp_path / "train")
    assert [r["prompt_seqs"] for r in trained] == [r["prompt_seqs"] for r in steps]
    assert all(r["train/grad_norm"] > 0 for r in trained)

    too_many = write_config(
        tmp_path,
        "short",
        steps=5,
        extra=f'mode = "train_only"\nload_rollouts = "{run_dir / "rollouts"}"',
    )
    result = streamrl_run(too_many, timeout=60)
    assert result.returncode == 1
    assert "train.load_rollouts" in result.stderr and "[4, 5]" in result.stderr
