"""metrics.jsonl records as W&B rows: every record reaches W&B, each on its own axis."""

from __future__ import annotations

import json

import pytest
from wandb_helpers import wandb_history, wandb_step_metrics

from streamrl.metrics import MetricsWriter, read_metrics, wandb_row


def step_record(step: int) -> dict:
    return {"step": step, "version": step, "reward_mean": step / 10, "accounting/ok": True}


def eval_record(step: int, version: int, reward: float) -> dict:
    return {
        "kind": "eval",
        "dataset": "math",
        "step": step,
        "version": version,
        "eval/math/reward_mean": reward,
    }


def test_a_step_record_is_plotted_against_step_and_an_eval_against_its_version():
    row, axis = wandb_row(step_record(2))
    assert (row, axis) == ({"step": 2, "version": 2, "reward_mean": 0.2}, "step")
    row, axis = wandb_row(eval_record(3, 0, 0.5))
    assert axis == "eval/version"
    assert row == {"eval/step": 3, "eval/version": 0, "eval/math/reward_mean": 0.5}
    row, axis = wandb_row({"kind": "checkpoint", "step": 4, "checkpoint/bytes": 10})
    assert (row, axis) == ({"checkpoint/step": 4, "checkpoint/bytes": 10}, "checkpoint/step")


def test_every_eval_reaches_wandb_even_when_later_steps_were_logged_first(tmp_path, monkeypatch):
    """The evaluation of version 0 is recorded after step 1, and a late one after step 3:
    W&B (offline) holds every eval row with its version, and every step row, each metric
    defined against its own axis."""
    wandb = pytest.importorskip("wandb")
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    writer = MetricsWriter(tmp_path, tensorboard=False, progress=False, wandb={"project": "t"})
    try:
        writer.write(step_record(1), step=1)
        writer.write(eval_record(1, 0, 0.25), step=0)
        writer.write(step_record(2), step=2)
        writer.write(step_record(3), step=3)
        writer.write(eval_record(3, 2, 0.5), step=2)
        writer.write({"kind": "checkpoint", "step": 3, "checkpoint/bytes": 10}, step=3)
        writer.write(eval_record(3, 1, 0.375), step=1)  # late: version 1 after version 2
    finally:
        writer.close()
        wandb.teardown()  # finish() may return before the service has written the .wandb file

    history = wandb_history(tmp_path)
    evals = [row for row in history if "eval/version" in row]
    assert [(r["eval/version"], r["eval/math/reward_mean"]) for r in evals] == [
        (0, 0.25),
        (2, 0.5),
        (1, 0.375),
    ]
    steps = [row for row in history if "reward_mean" in row]
    assert [(r["step"], r["reward_mean"]) for r in steps] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [r["checkpoint/bytes"] for r in history if "checkpoint/bytes" in r] == [10]
    assert len(history) == len(read_metrics(tmp_path / "metrics.jsonl"))

    axes = wandb_step_metrics(tmp_path)
    assert axes["eval/math/reward_mean"] == axes["eval/step"] == "eval/version"
    assert axes["reward_mean"] == axes["version"] == "step"
    assert axes["checkpoint/bytes"] == "checkpoint/step"
    assert axes["eval/version"] == axes["step"] == ""


@pytest.mark.slow
def test_a_runs_evals_graded_by_math_reward_all_reach_wandb(tmp_path, monkeypatch):
    """A tiny run with the default reward (math_reward, graded in worker processes of the
    rollout process) and evaluations at versions 0 and 2, W&B offline: both evals are in
    the W&B run, plotted against eval/version, and no reward failed."""
    pytest.importorskip("wandb")
    from run_helpers import streamrl_run, write_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"prompt": "Solve: 3x = 12", "label": "x = 4"}\n' * 2)
    config = write_config(
        tmp_path,
        steps=3,
        extra=f'[eval]\ninterval = 2\n[[eval.datasets]]\nname = "seed"\npath = "{evals}"\n'
        "[eval.datasets.sampling]\nmax_new_tokens = 12\n",
    )
    text = config.read_text()
    text = text.replace('reward_fn = "tests.e2e_rewards:vowel_fraction"\n', "")  # the default
    text = text.replace("[buffer]\n", "[buffer]\nfilters = []\n")  # all-zero groups train too
    text = text.replace("[logging]\n", '[logging]\nwandb = true\nwandb_project = "test"\n')
    config.write_text(text)
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "out"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "kind" not in r] == [1, 2, 3]
    # The rollout's final counters (a step record holds them only once a 2 s report arrived).
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout"]["reward_failures"] == 0 and summary["rollout"]["samples"] > 0
    eval_versions = [r["version"] for r in records if r.get("kind") == "eval"]
    assert eval_versions[:2] == [0, 2]
    history = wandb_history(run_dir)
    logged = [row["eval/version"] for row in history if "eval/seed/reward_mean" in row]
    assert logged == eval_versions
    assert wandb_step_metrics(run_dir)["eval/seed/reward_mean"] == "eval/version"
    assert [row["step"] for row in history if "reward_mean" in row] == [1, 2, 3]
