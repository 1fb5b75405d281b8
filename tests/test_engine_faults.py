"""Engine failures during `streamrl run`: a killed engine and a hung engine are healed, and
no group is lost or duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from test_run import start_run as start_streamrl_run
from test_run import write_config

from streamrl.metrics import read_metrics

pytestmark = pytest.mark.slow

FLEET = """
[engine]
num_engines = 2
router_policy = "round_robin"
num_threads = 1
max_batch_size = 16
max_seq_len = 256
health_interval_s = 1.0
health_timeout_s = {timeout}
"""


def start_run(tmp_path: Path, *, steps: int, timeout_s: float) -> tuple[subprocess.Popen, Path]:
    config = write_config(tmp_path, steps=steps, eta=1)
    text = (
        config.read_text()
        .replace("max_new_tokens = 12", "max_new_tokens = 32")
        .replace(
            "[engine]\nnum_threads = 1\nmax_batch_size = 16\nmax_seq_len = 256\n",
            FLEET.format(timeout=timeout_s),
        )
    )
    config.write_text(text)
    return start_streamrl_run(config), tmp_path / "out"


def wait_for(
    predicate,
    process: subprocess.Popen,
    what: str,
    timeout_s: float = 240,
    max_delay_s: float = 0.5,
) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"run exited waiting for {what}: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(delay)
        delay = min(delay * 1.5, max_delay_s)


def step_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [r for r in read_metrics(path) if "kind" not in r] if path.exists() else []


def engine_zero(out: Path) -> dict:
    return json.loads((out / "engines.json").read_text())["engines"][0]


def is_generating(url: str) -> bool:
    try:
        return httpx.get(f"{url}/get_load", timeout=2).json()[0]["num_running_reqs"] > 0
    except (httpx.HTTPError, KeyError, IndexError):
        return False


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_finished_run(process: subprocess.Popen, out: Path, steps: int) -> dict:
    assert process.wait(timeout=300) == 0, process.stderr.read()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    records = step_records(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert summary["accounting_ok"]
    assert summary["groups_started"] == (
        summary["groups_trained"]
        + summary["groups_filtered"]
        + summary["groups_evicted"]
        + summary["groups_buffered_at_stop"]
        + summary["groups_in_flight_at_stop"]
    )
    trained = [seq for r in records for seq in r["prompt_seqs"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    return summary


def test_an_engine_killed_mid_generation_is_restarted_at_the_current_version(tmp_path):
    steps = 8
    process, out = start_run(tmp_path, steps=steps, timeout_s=5.0)
    try:
        wait_for(lambda: len(step_records(out)) >= 1, process, "the first step")
        victim = engine_zero(out)
        wait_for(
            lambda: is_generating(victim["url"]), process, "engine 0 generating", max_delay_s=0.02
        )
        os.kill(victim["pid"], signal.SIGKILL)
        summary = check_finished_run(process, out, steps)
    finally:
        process.kill()
    assert summary["engine_restarts"][victim["url"]] == 1
    kinds = [(e["engine"], e["event"], e.get("reason")) for e in events(out)]
    assert (victim["url"], "down", "exited") in kinds
    assert (victim["url"], "serving", None) in kinds
    # Both engines serve the final version (the restarted one was re-synced).
    assert set(summary["engine_versions"].values()) == {steps}


def test_a_hung_engine_is_detected_within_the_health_timeout_and_replaced(tmp_path):
    steps = 6
    timeout_s = 3.0
    process, out = start_run(tmp_path, steps=steps, timeout_s=timeout_s)
    try:
        wait_for(lambda: len(step_records(out)) >= 1, process, "the first step")
        victim = engine_zero(out)
        stopped_at = time.time()
        os.kill(victim["pid"], signal.SIGSTOP)  # alive but answering nothing
        summary = check_finished_run(process, out, steps)
    finally:
        process.kill()
    down = [e for e in events(out) if e["event"] == "down" and e["engine"] == victim["url"]]
    assert down and down[0]["reason"] == "hung"
    # Detected within one check interval plus the timeout (plus scheduling slack on 2 cores).
    assert down[0]["time"] - stopped_at < 1.0 + timeout_s + 5.0
    assert summary["engine_restarts"][victim["url"]] == 1
    assert set(summary["engine_versions"].values()) == {steps}
