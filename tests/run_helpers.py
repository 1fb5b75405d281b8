"""Running `streamrl run` in tests: the tiny config every end-to-end test starts from, the
run in the foreground or the background, waits on a live run, and what a finished run left
(its step records, events and summary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from streamrl.config import config_from_dict
from streamrl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


TINY = """
[model]
path = "random:qwen3-tiny"
[data]
path = "builtin:arithmetic"
[rollout]
batch_size = 2
n_samples_per_prompt = 4
reward_fn = "tests.e2e_rewards:vowel_fraction"
[rollout.sampling]
max_new_tokens = 12
[engine]
num_threads = 1
max_batch_size = 16
max_seq_len = 256
[buffer]
max_staleness = {eta}
[learner]
lr = 1e-3
num_threads = 1
[train]
steps = {steps}
output_dir = "{out}"
save_interval = {save_interval}
[logging]
tensorboard = false
progress = false
"""


def write_config(
    tmp_path: Path,
    *,
    steps: int = 4,
    eta: int = 1,
    save_interval: int = 0,
    extra: str = "",
    megatron: str | None = None,
) -> Path:
    """The tiny config at `tmp_path/run.toml` (the run's output in `tmp_path/out`), `extra`
    appended. With `megatron`, the learner is Megatron on two gloo ranks, `megatron` the
    lines of its `[learner.megatron]` ("" for the defaults: DP 2)."""
    path = tmp_path / "run.toml"
    out = tmp_path / "out"
    text = TINY.format(steps=steps, eta=eta, out=out, save_interval=save_interval)
    if megatron is not None:
        text = text.replace("[learner]\n", '[learner]\nbackend = "megatron"\nnum_gpus = 2\n')
        text = text.replace("[train]\n", f"[learner.megatron]\n{megatron}\n[train]\n")
    path.write_text(text + extra)
    return path


def streamrl_run(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "run", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def start_run(config: Path) -> subprocess.Popen:
    """`streamrl run CONFIG` in the background, stderr captured (for kill and Ctrl-C tests)."""
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


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


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_accounting(summary: dict) -> None:
    """A finished run's books balance: every group started was trained, filtered, evicted, or
    still buffered or in flight at the stop."""
    assert summary["accounting_ok"]
    assert summary["groups_started"] == (
        summary["groups_trained"]
        + summary["groups_filtered"]
        + summary["groups_evicted"]
        + summary["groups_buffered_at_stop"]
        + summary["groups_in_flight_at_stop"]
    )


def check_finished_run(process: subprocess.Popen, out: Path, steps: int) -> dict:
    assert process.wait(timeout=300) == 0, process.stderr.read()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    records = step_records(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    check_accounting(summary)
    trained = [seq for r in records for seq in r["prompt_seqs"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    return summary


def config(**sections) -> object:
    return config_from_dict({"data": {"path": "builtin:arithmetic"}, **sections})


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def seqs_of(runs: list[list[int]]) -> set[int]:
    return {seq for first, end in runs for seq in range(first, end)}
