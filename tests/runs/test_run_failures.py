"""`streamrl run` stops at once, without restarting the rollout process, on an error that a
restart would repeat, and says on the terminal what failed and where to look."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import wait_until
from run_helpers import start_run, streamrl_run, write_config

REPO = Path(__file__).parents[2]

pytestmark = pytest.mark.slow


def rollout_events(out) -> list[str]:
    lines = (out / "events.jsonl").read_text().splitlines()
    return [e["event"] for e in map(json.loads, lines) if e.get("component") == "rollout"]


def test_a_generate_function_that_always_raises_stops_the_run_with_its_traceback(tmp_path):
    config = write_config(tmp_path, steps=4)
    out = tmp_path / "out"
    result = streamrl_run(
        config, "--set", "rollout.generate_fn=tests.e2e_generate:always_raises", timeout=180
    )
    assert result.returncode == 1, result.stderr[-3000:]
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


def test_a_stalled_run_says_why_and_stops_every_process_on_sigterm(tmp_path):
    """Every group is filtered (a constant reward under zero_std): the learner waits, the
    terminal says why, and SIGTERM still stops the run and every process it started (it
    once left the interpreter waiting on a worker thread that waited on the rollout)."""
    config = write_config(tmp_path, steps=4)
    config.write_text(
        config.read_text()
        .replace("tests.e2e_rewards:vowel_fraction", "tests.e2e_rewards:constant")
        .replace("[buffer]\n", '[buffer]\nfilters = ["zero_std"]\n')
        .replace("[train]\n", "[train]\nstall_warning_s = 2\n")
    )
    out = tmp_path / "out"
    process = start_run(config)
    deadline = time.monotonic() + 240
    while not any(r.get("stall/filtered/zero_std") for r in _records(out / "metrics.jsonl")):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no stall record of zero_std after 240 s"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 130
    stderr = process.stderr.read()
    assert "no training step for" in stderr and "filtered by zero_std" in stderr
    assert "interrupted; every process stopped" in stderr
    processes = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert [line for line in processes.splitlines() if str(tmp_path) in line] == []


def _records(path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            continue
    return records


def test_a_rollout_started_before_its_spec_exits_when_the_process_that_started_it_dies(
    tmp_path,
):
    """The first rollout process starts with the engines and waits for `rollout.json`; if
    the trainer dies before writing it, the rollout does not wait forever."""
    config = write_config(tmp_path)
    run_dir = tmp_path / "out"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.toml").write_text(config.read_text())
    log = run_dir / "logs" / "rollout.log"
    starter = (
        "import subprocess, sys\n"
        "child = subprocess.Popen(sys.argv[2:], stderr=open(sys.argv[1], 'w'))\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"  # lives until the test closes its stdin
    )
    rollout = ["-m", "streamrl", "--log-level", "info", "_rollout", "--run-dir", str(run_dir)]
    parent = subprocess.Popen(
        [sys.executable, "-c", starter, str(log), sys.executable, *rollout,
         "--tokenizer", "random:qwen3-tiny"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    pid = int(parent.stdout.readline())
    wait_until(lambda: "waiting for" in log.read_text(), what="the rollout waiting", timeout_s=120)
    parent.stdin.close()
    assert parent.wait(timeout=30) == 0
    wait_until(lambda: _command_line(pid) == "", what="the orphaned rollout exited", timeout_s=60)
    assert "exited before writing its spec" in log.read_text()
    assert not (run_dir / "rollout.json").exists()


def _command_line(pid: int) -> str:
    """The command line of a live process; empty once it is gone (or a zombie)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return ""
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except (FileNotFoundError, ProcessLookupError):
        return ""
