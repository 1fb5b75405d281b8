"""Measured peaks of a run's processes (`streamrl.memory_use`) and the planner's prediction
next to them (`streamrl.planner.measured`): on the CPU, with real child processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from streamrl import memory_use
from streamrl.config import config_from_dict
from streamrl.memory_use import MemoryWatch, measured_peak
from streamrl.planner import plan_memory
from streamrl.planner.measured import compare, comparison_lines

# A parent whose child holds ~200 MB of host memory until stdin closes.
HOLDER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
    "print('ready', flush=True); sys.stdin.read()"], stdin=sys.stdin, stdout=sys.stdout)
child.wait()
"""


@pytest.fixture
def holder():
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "ready"
    try:
        yield process
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def test_a_watched_process_counts_its_childrens_host_memory_and_no_gpu_figure_without_nvidia_smi(
    holder, monkeypatch
):
    monkeypatch.setattr(memory_use.shutil, "which", lambda name: None)  # as on a CPU machine
    watch = MemoryWatch(
        lambda: {"engine 0": holder.pid, "learner rank 0": os.getpid()},
        without_children=frozenset({"learner rank 0"}),
    )
    watch.sample()
    peaks = watch.to_dict()
    engine, learner = peaks["processes"]["engine 0"], peaks["processes"]["learner rank 0"]
    assert engine["host_peak_bytes"] > 200 * 2**20  # the child's bytes count for its parent
    assert learner["host_peak_bytes"] == memory_use.host_peak_bytes(os.getpid())
    assert engine["gpu_peak_bytes"] is None and peaks["gpu_source"] is None
    assert measured_peak(engine) == (None, "not measured (no nvidia-smi figure for the process)")


def test_nvidia_smis_per_process_figures_are_summed_over_the_process_tree(holder, monkeypatch):
    child = memory_use.process_tree(holder.pid, memory_use.children_of())[1]
    readings = iter([{child: 3 * 2**30, 999999: 2**30}, {child: 5 * 2**30}, {child: 2**30}])
    monkeypatch.setattr(memory_use, "gpu_used_by_pid", lambda: next(readings))
    watch = MemoryWatch(lambda: {"engine 0": holder.pid})
    watch.has_gpu_source = True
    for _ in range(3):
        watch.sample()
    engine = watch.peaks()["engine 0"]
    assert engine["gpu_peak_bytes"] == 5 * 2**30  # the peak, not the last reading
    assert watch.gpu_by_pid == {child: 5 * 2**30, 999999: 2**30}
    assert measured_peak(engine) == (5 * 2**30, "nvidia-smi")
    with_torch = {
        **engine,
        "torch_max_allocated_bytes": 3 * 2**30,
        "torch_max_reserved_bytes": 4 * 2**30,
    }
    assert measured_peak(with_torch)[0] == 4 * 2**30  # allocated + what is outside the pool


def test_torch_peaks_are_absent_without_cuda():
    assert memory_use.torch_peaks("cpu") == {
        "torch_max_allocated_bytes": None,
        "torch_max_reserved_bytes": None,
    }


def test_the_plan_is_compared_with_each_measured_process_and_the_error_is_relative_to_the_measure():
    cfg = config_from_dict(
        {
            "model": {"path": "random:qwen3-4b"},
            "data": {"path": "builtin:arithmetic", "apply_chat_template": False},
            "learner": {"backend": "megatron", "gradient_checkpointing": True},
            "engine": {"max_batch_size": 32},
        }
    )
    plan = plan_memory(cfg, gpu_bytes=141e9, source="test")
    assert sorted(plan.processes) == ["engine 0", "learner rank 0"]
    learner = plan.processes["learner rank 0"].peak_bytes
    memory = {
        "processes": {
            "learner rank 0": {"measured_peak_bytes": int(learner / 1.25), "measured_as": "x"},
            "engine 0": {"measured_peak_bytes": None, "measured_as": "not measured"},
            "rollout": {"measured_peak_bytes": 10**9, "measured_as": "nvidia-smi"},
        }
    }
    rows = {row.process: row for row in compare(plan, memory)}
    assert rows["learner rank 0"].error == pytest.approx(0.25, rel=1e-6)
    assert rows["learner rank 0"].is_within_target is False
    assert rows["engine 0"].error is None and rows["engine 0"].is_within_target is None
    assert rows["rollout"].predicted_bytes is None  # measured, not planned
    lines = comparison_lines(list(rows.values()))
    assert "+25.0%" in lines[1] and "(over 10%)" in lines[1]
    assert "n/a" in lines[2]
