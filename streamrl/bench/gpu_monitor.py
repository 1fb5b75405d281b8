"""How busy each GPU was over a stretch of a benchmark, as `nvidia-smi` reports it.

    with GpuMonitor() as gpus:                    # nvidia-smi -lms 100 in the background
        ... t0 = time.monotonic() ... t1 = ...
        gpus.busy(t0, t1)                         # {0: 0.93, 1: 0.41}: share of time with a
                                                  # kernel running, per GPU index

`utilization.gpu` is the share of the driver's last sample period (1/6 s to 1 s,
by product) during which at least one kernel ran, on any process. It says
nothing of how many SMs the kernels kept busy. On a GPU that two processes
share, their kernels take turns (time slicing; no MPS here), so the busy
shares of the two stages alone bound what they can reach together.

Readings carry `time.monotonic()` of the moment they arrived: CLOCK_MONOTONIC is
one clock for every process on the machine, so windows measured in a child
process (the replay of training alone) select readings here. Without
`nvidia-smi` (CPU machines) the monitor records nothing and `busy` returns {}.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

SAMPLE_MS = 100


@dataclass
class GpuMonitor:
    executable: str = "nvidia-smi"
    readings: list[tuple[float, int, float]] = field(default_factory=list)
    """(monotonic time, GPU index, busy share 0..1), in arrival order."""
    _process: subprocess.Popen | None = None
    _reader: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        path = shutil.which(self.executable)
        if path is None:
            return self
        self._process = subprocess.Popen(
            [
                path,
                "--query-gpu=index,utilization.gpu",
                "--format=csv,noheader,nounits",
                f"--loop-ms={SAMPLE_MS}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="gpu-monitor", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5)

    def _read(self) -> None:
        for line in self._process.stdout:
            index, _, busy = line.partition(",")
            try:
                reading = (time.monotonic(), int(index), float(busy) / 100.0)
            except ValueError:
                continue  # "[N/A]" or a partial line: not a reading
            self.readings.append(reading)

    def busy(self, start_s: float, end_s: float) -> dict[int, float]:
        """Mean busy share of each GPU over readings that arrived in [start_s, end_s]."""
        sums: dict[int, list[float]] = {}
        for seen_s, index, busy in list(self.readings):
            if start_s <= seen_s <= end_s:
                sums.setdefault(index, []).append(busy)
        return {index: sum(values) / len(values) for index, values in sorted(sums.items())}


def shared_device_bound(
    generation_tps: float, generation_busy: float, training_tps: float, training_busy: float
) -> float:
    """Tokens/s two stages can reach on one time-sliced GPU: each token costs the GPU time it
    took alone (busy share / throughput), and the two stages' GPU times add up."""
    return 1.0 / (generation_busy / generation_tps + training_busy / training_tps)
