"""Async at staleness 0, and colocated sync, train what sync trains, bit for bit.

`train.mode = "async"` with `buffer.max_staleness = 0` and `train.mode = "sync"` must train
the same groups in the same order with the same losses and end with the same weights:
nothing in the asynchronous machinery (the stream, credits, the buffer's order, the
background weight push) may change what is trained. Both runs use seeded samples
(`rollout.deterministic`), one engine and one group in flight at a time, so that the only
thing that could differ is the machinery itself. Colocated mode (`cluster.colocate`, the
engine's memory released and resumed around every step, the learner's state offloaded and
reloaded) must change nothing either: released weights come back from the push, offloaded
state from host memory, byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from run_helpers import step_records, streamrl_run, write_config
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 4
DETERMINISTIC = ("rollout.deterministic=true", "rollout.max_concurrent_groups=1")
COMPARED = ("prompt_seqs", "reward_mean", "train/loss", "train/pg_loss", "train/grad_norm")


def training_of(out: Path) -> tuple[list[dict], dict]:
    """Per step: what was trained and its losses; and the final weights."""
    steps = step_records(out)
    per_step = [{key: record[key] for key in COMPARED} for record in steps]
    (final,) = sorted((out / "checkpoints").glob("step_*"))[-1:]
    weights = {}
    for path in sorted(final.glob("*.safetensors")):
        weights.update(load_file(path))
    return per_step, weights


def differences(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> list[str]:
    """Everything that differs between two trainings (empty: bit for bit the same)."""
    (steps_a, weights_a), (steps_b, weights_b) = a, b
    found = [f"{len(steps_a)} steps != {len(steps_b)}"] if len(steps_a) != len(steps_b) else []
    for index, (left, right) in enumerate(zip(steps_a, steps_b, strict=False), start=1):
        found += [
            f"step {index} {key}: {left[key]} != {right[key]}"
            for key in left
            if left[key] != right[key]
        ]
    if weights_a.keys() != weights_b.keys():
        found.append("the checkpoints hold different tensors")
    found += [
        f"weights {name} differ"
        for name in weights_a
        if name in weights_b and not weights_a[name].equal(weights_b[name])
    ]
    return found


def run(tmp_path: Path, name: str, *settings: str) -> tuple[list[dict], dict]:
    directory = tmp_path / name
    directory.mkdir()
    config = write_config(directory, steps=STEPS, eta=0)
    sets = [arg for setting in (*DETERMINISTIC, *settings) for arg in ("--set", setting)]
    result = streamrl_run(config, *sets, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return training_of(directory / "out")


COLOCATE_METRICS = (
    "colocate/release_s",
    "colocate/reload_s",
    "colocate/offload_s",
    "colocate/resume_s",
    "colocate/publish_s",
)


@pytest.fixture(scope="module")
def sync(tmp_path_factory) -> tuple[list[dict], dict]:
    """The synchronous run both tests compare against."""
    return run(
        tmp_path_factory.mktemp("sync"), "sync", "train.mode='sync'", "buffer.max_staleness=1"
    )


def test_colocated_sync_with_everything_offloaded_trains_exactly_what_sync_trains(tmp_path, sync):
    colocated = run(
        tmp_path, "colocated", "train.mode='sync'", "cluster.colocate=true", "learner.offload='all'"
    )
    assert differences(sync, colocated) == []
    records = step_records(tmp_path / "colocated" / "out")
    for record in records:
        assert all(record[key] >= 0 for key in COLOCATE_METRICS), record
        assert record["colocate/offloaded_gb"] > 0  # parameters and AdamW's moments were out


def test_async_at_staleness_0_trains_exactly_what_sync_trains(tmp_path, sync):
    asynchronous = run(tmp_path, "async", "train.mode='async'", "buffer.max_staleness=0")
    assert differences(sync, asynchronous) == []
    # A comparison that cannot fail proves nothing: one batch trained out of its order is
    # caught (the two batches' prompts swapped, as a reordering buffer would do).
    steps, weights = asynchronous
    swapped = [dict(step) for step in steps]
    swapped[0]["prompt_seqs"], swapped[1]["prompt_seqs"] = (
        steps[1]["prompt_seqs"],
        steps[0]["prompt_seqs"],
    )
    assert differences(sync, (swapped, weights)) != []
