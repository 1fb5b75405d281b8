"""Run metrics: `metrics.jsonl` (one JSON object per record), TensorBoard scalars, a progress line."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends records to `run_dir/metrics.jsonl` and mirrors numbers to TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, progress: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.progress = progress
        self.started_at = time.monotonic()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is a dependency; keep running without it
                log.warning("tensorboard is not installed: writing metrics.jsonl only")

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def write(self, record: dict[str, Any], *, step: int) -> None:
        record = {key: _plain(value) for key, value in record.items()}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def print_step(self, record: dict[str, Any], total_steps: int) -> None:
        if not self.progress:
            return
        line = (
            f"step {record['step']:>4}/{total_steps}  v{record['version']:<4} "
            f"reward {record['reward_mean']:.3f}  "
            f"stale {record['staleness_mean']:.2f}/{record['staleness_max']}  "
            f"{record.get('throughput/trained_tokens_per_s', 0):,.0f} tok/s  "
            f"idle {record['learner_idle_s']:.1f}s  "
            f"step {record['step_time_s']:.1f}s  [{_clock(record['time'])}]"
        )
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
