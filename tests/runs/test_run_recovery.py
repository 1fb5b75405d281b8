"""A run survives its rollout process being killed: restarted, nothing lost, nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from run_helpers import seqs_of, start_run, step_records, write_config

pytestmark = pytest.mark.slow


def rollout_pids(run_dir) -> list[int]:
    """Processes running `streamrl _rollout --run-dir RUN_DIR`."""
    table = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        int(line.split(None, 1)[0])
        for line in table.splitlines()
        if "_rollout" in line and f"--run-dir {run_dir}" in line
    ]


def test_a_killed_rollout_process_is_restarted_and_no_prompt_is_lost_or_trained_twice(tmp_path):
    config = write_config(tmp_path, steps=8, eta=1)
    out = tmp_path / "out"
    process = start_run(config)
    try:
        deadline = time.monotonic() + 240
        while len(step_records(out)) < 2:
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step 2 after 240 s"
            time.sleep(0.2)
        (pid,) = rollout_pids(out)
        os.kill(pid, signal.SIGKILL)
        assert process.wait(timeout=240) == 0, process.stderr.read()[-3000:]
    finally:
        process.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_restarts"] == 1 and summary["accounting_problems"] == []
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e.get("component") == "rollout"] == ["rollout_restarted"]
    steps = step_records(out)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["accounting/ok"] for r in steps)
    trained = [seq for r in steps for seq in r["prompt_seqs"]]
    assert len(trained) == len(set(trained)) == 8 * 2  # no prompt trained twice
    # Nothing lost: every seq up to the last one received is trained, filtered, evicted,
    # buffered or still in flight at the stop; the killed process's groups were made again.
    fates = json.loads((out / "accounting.json").read_text())
    received = seqs_of(fates["received"])
    accounted = set().union(
        *(seqs_of(fates[k]) for k in ("trained", "filtered", "evicted", "buffered"))
    )
    assert accounted == received
    assert set(range(max(received) + 1)) <= received | seqs_of(fates["in_flight_or_transit"])
    assert set(trained) <= seqs_of(fates["trained"])
    assert rollout_pids(out) == []
