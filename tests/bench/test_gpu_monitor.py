"""The benchmarks' GPU busy shares (`streamrl.bench.gpu_monitor`), read from a stand-in
`nvidia-smi` (this machine has none): a script that prints what the real one prints
for `--query-gpu=index,utilization.gpu --format=csv,noheader,nounits`."""

from __future__ import annotations

import sys
import time

import pytest

from streamrl.bench import sync_async
from streamrl.bench.gpu_monitor import GpuMonitor, shared_device_bound
from streamrl.config import config_from_dict

FAKE_SMI = """#!{python}
import sys, time
assert "--query-gpu=index,utilization.gpu" in sys.argv, sys.argv
assert "--format=csv,noheader,nounits" in sys.argv, sys.argv
while True:
    print("0, 40", flush=True)
    print("1, 100", flush=True)
    print("1, [N/A]", flush=True)
    time.sleep(0.01)
"""


@pytest.fixture
def fake_smi(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE_SMI.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_busy_shares_are_averaged_per_gpu_over_the_window(fake_smi):
    started = time.monotonic()
    with GpuMonitor(executable=fake_smi) as gpus:
        deadline = time.monotonic() + 60
        while len(gpus.readings) < 10:
            assert time.monotonic() < deadline, "no readings from the stand-in nvidia-smi"
            time.sleep(0.01)
        process = gpus._process
    assert process.poll() is not None  # stopped with the monitor, not left running
    assert gpus.busy(started, time.monotonic()) == {0: pytest.approx(0.4), 1: pytest.approx(1.0)}
    assert gpus.busy(0.0, started) == {}  # nothing arrived before it started
    assert all(index in (0, 1) for _, index, _ in gpus.readings)  # "[N/A]" skipped


def test_without_nvidia_smi_the_monitor_reports_nothing():
    with GpuMonitor(executable="no-such-nvidia-smi") as gpus:
        pass
    assert gpus.readings == [] and gpus.busy(0.0, time.monotonic()) == {}


def test_the_shared_device_bound_adds_the_gpu_time_each_stage_took_alone():
    # Both stages keep the GPU busy all the time alone: the bound is sync's 1/(1/g + 1/t).
    assert shared_device_bound(80.0, 1.0, 60.0, 1.0) == pytest.approx(1 / (1 / 80 + 1 / 60))
    # Each leaves it idle half of the time: twice as much fits.
    assert shared_device_bound(80.0, 0.5, 60.0, 0.5) == pytest.approx(2 / (1 / 80 + 1 / 60))


def _cfg(learner_gpus, engine_gpus):
    return config_from_dict({"data": {"path": "x"}, "model": {"path": "x"},
                             "engine": {"device": "cuda"},
                             "cluster": {"learner_gpus": learner_gpus,
                                         "engine_gpus": engine_gpus}})  # fmt: skip


def test_sync_vs_async_reports_the_bound_only_for_one_shared_gpu():
    generation = {"trainable_tokens_per_s": 80.0, "gpu_busy": {0: 0.5}}
    training = {"trained_tokens_per_s": 60.0, "gpu_busy": {0: 1.0}}
    bound = 1 / (0.5 / 80 + 1.0 / 60)
    shared = sync_async._shared_gpu_bound(_cfg([0], [0]), generation, training, 30.0)
    assert shared["shared_gpu"] == 0
    assert shared["shared_gpu_bound_tokens_per_s"] == pytest.approx(bound)
    assert shared["async_share_of_shared_gpu_bound"] == pytest.approx(30.0 / bound)
    assert sync_async._shared_gpu_bound(_cfg([0], []), generation, training, 30.0) == shared
    assert sync_async._shared_gpu_bound(_cfg([0], [1]), generation, training, 30.0) == {}
    no_readings = {"trainable_tokens_per_s": 80.0, "gpu_busy": {}}
    assert sync_async._shared_gpu_bound(_cfg([0], [0]), no_readings, training, 30.0) == {}
