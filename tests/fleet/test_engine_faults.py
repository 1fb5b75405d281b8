"""Engine failures during `streamrl run`: a killed engine and a hung engine are healed, and
no group is lost or duplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import polling_client
from run_helpers import (
    FLEET,
    check_finished_run,
    engine_zero,
    events,
    step_records,
    wait_for,
    write_config,
)
from run_helpers import start_run as start_streamrl_run

pytestmark = pytest.mark.slow


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


def is_generating(url: str) -> bool:
    try:
        return polling_client().get(f"{url}/get_load", timeout=2).json()[0]["num_running_reqs"] > 0
    except (httpx.HTTPError, KeyError, IndexError):
        return False


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
    # Detected within one check interval plus the timeout, plus the grace in which a process
    # may still show that it exited (at most the timeout), plus scheduling slack on 2 cores.
    assert down[0]["time"] - stopped_at < 1.0 + 2 * timeout_s + 5.0
    assert summary["engine_restarts"][victim["url"]] == 1
    assert set(summary["engine_versions"].values()) == {steps}
