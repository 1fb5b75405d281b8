"""`kill -9` of the whole run at random moments, then `--resume`: the asynchronous state
comes back (buffered groups, every prompt's fate, the groups in flight with their tokens),
every prompt is trained once or counted as filtered or evicted, and no trained token is
older than the staleness bound."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from run_helpers import seqs_of, step_records, streamrl_run, write_config

from streamrl.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS, ETA = 10, 1
LONGER = "rollout.sampling.max_new_tokens=48"


def lineage(out) -> list[dict]:
    """The steps the final model went through: a killed run's steps after the checkpoint it
    was resumed from were lost with it (their prompts are trained again)."""
    kept: dict[int, dict] = {}
    for record in read_metrics(out / "metrics.jsonl"):
        if "kind" not in record:
            kept[record["step"]] = record  # a later run's step replaces a lost one
    return [kept[step] for step in sorted(kept)]


def test_three_kills_and_resumes_keep_every_prompt_trained_once_within_the_bound(tmp_path):
    config = write_config(tmp_path, steps=STEPS, eta=ETA, save_interval=2)
    out = tmp_path / "out"
    rng = random.Random(17)
    checkpoints = out / "checkpoints"
    for kill in range(3):
        args = ["--set", LONGER] + (["--resume"] if kill else [])
        process = _start(config, args)
        target = len(step_records(out)) + rng.randint(1, 3)
        deadline = time.monotonic() + 300
        try:
            while len(step_records(out)) < target or not list(checkpoints.glob("step_*")):
                assert process.poll() is None, process.stderr.read()[-3000:]
                assert time.monotonic() < deadline, f"kill {kill}: no step {target}"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        finally:
            process.kill()
    result = streamrl_run(config, "--resume", "--set", LONGER, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_problems"] == [] and summary["steps"] == STEPS
    steps = lineage(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    trained = [seq for r in steps for seq in r["prompt_seqs"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice in the lineage
    assert max(r["staleness_max"] for r in steps) <= ETA
    fates = json.loads((out / "accounting.json").read_text())
    assert set(trained) == seqs_of(fates["trained"])
    received = seqs_of(fates["received"])
    accounted = set().union(
        *(seqs_of(fates[k]) for k in ("trained", "filtered", "evicted", "buffered"))
    )
    assert accounted == received
    checkpoints_written = [
        r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "checkpoint"
    ]
    resumed = sum(r.get("rollout/resumed_samples", 0) for r in steps)
    print(
        "checkpoints", len(checkpoints_written),
        "in flight samples saved", [r["checkpoint/in_flight_samples"] for r in checkpoints_written],
        "resumed", resumed,
    )  # fmt: skip
    assert all(r["checkpoint/complete"] for r in checkpoints_written)


def _start(config, args):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "run", str(config), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
