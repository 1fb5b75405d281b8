"""`streamrl run` stops at once, without restarting the rollout process, on an error that a
restart would repeat, and says on the terminal what failed and where to look."""

from __future__ import annotations

import json
import re
import time

import pytest
from test_run import streamrl_run, write_config

pytestmark = pytest.mark.slow


def rollout_events(out) -> list[str]:
    lines = (out / "events.jsonl").read_text().splitlines()
    return [e["event"] for e in map(json.loads, lines) if e.get("component") == "rollout"]


def test_a_generate_function_that_always_raises_stops_the_run_with_its_traceback(tmp_path):
    config = write_config(tmp_path, steps=4)
    out = tmp_path / "out"
    started = time.monotonic()
    result = streamrl_run(
        config, "--set", "rollout.generate_fn=tests.e2e_generate:always_raises", timeout=180
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 120
    stderr = result.stderr
    assert re.search(r"generation failed for every one of the last (\d+) samples", stderr)
    assert "RuntimeError: this generate function always fails (prompt " in stderr
    assert "look at: rollout.generate_fn = 'tests.e2e_generate:always_raises'" in stderr
    assert "Traceback (most recent call last):" in stderr and "e2e_generate.py" in stderr
    assert rollout_events(out) == ["rollout_fatal"]  # no restart
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_restarts"] == 0 and summary["steps"] == 0
    assert summary["accounting_problems"] == [] and "RuntimeError" in summary["error"]
    # Every group started was received and filtered, or counted in flight at the stop.
    assert summary["groups_started"] == (
        summary["groups_filtered"] + summary["groups_in_flight_at_stop"]
    )
    assert summary["rollout"]["generation_failures"] >= 256
    # Hundreds of failures, a few lines: the repeats are counted, not written.
    log = (out / "logs" / "rollout.log").read_text()
    assert log.count("generate failed for prompt") <= 2
    assert "more like this" in log


def test_a_malformed_data_line_stops_the_run_at_once_naming_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        '{"prompt": "1 + 1 =", "label": "2"}\n'
        '{"prompt": "2 + 2 =", "label": "4"}\n'
        '{"prompt": "3 + 3 =", "label": \n'
    )
    config = write_config(tmp_path, steps=4)
    out = tmp_path / "out"
    result = streamrl_run(config, "--set", f"data.path={data}", timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"bad prompt data: {data}:3: malformed JSON" in result.stderr
    assert 'data.on_bad_line = "skip"' in result.stderr
    assert rollout_events(out) == ["rollout_fatal"]  # no restart
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_restarts"] == 0 and summary["groups_started"] == 0
