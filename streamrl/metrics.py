"""Run metrics: `metrics.jsonl` (one JSON object per record), TensorBoard scalars, a progress
line, and optionally Weights & Biases (`logging.wandb`): every record's numbers, steps and
evals alike, logged as they are written (see `wandb_row` for the axes they are plotted on).

W&B ignores a `log(step=s)` whose s is below its current step, and evaluations arrive late
(an eval of version 0 is recorded after step 1), so streamrl never passes `step`: each
record is a new W&B row, and every metric is defined with its own x axis (`step`, or
`eval/version` for evaluations)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends records to `run_dir/metrics.jsonl` and mirrors numbers to TensorBoard."""

    FILE = "metrics.jsonl"

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        wandb: dict[str, Any] | None = None,
    ) -> None:
        """`wandb`: start a W&B run with these settings (`project`, `name`, `mode`, `config`;
        see `start_wandb`); None logs nothing to W&B."""
        self.path = run_dir / self.FILE
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
        self._wandb = start_wandb(run_dir, **wandb) if wandb is not None else None
        self._wandb_defined: set[str] = set()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def write(self, record: dict[str, Any], *, step: int) -> None:
        """Append `record`; `step` is its TensorBoard x value (an eval's version), while W&B
        plots it against the axis of its kind (`wandb_row`)."""
        record = {key: _plain(value) for key, value in record.items()}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if _is_number(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            row, axis = wandb_row(record)
            for key in sorted(row, key=lambda k: k != axis):  # the axis first
                if key in self._wandb_defined:
                    continue
                # Explicit per-key definitions: wandb-core matches overlapping globs ("*" and
                # "eval/*") in no fixed order, so a glob could put an eval on the step axis.
                if key == axis:
                    self._wandb.define_metric(key)
                else:
                    self._wandb.define_metric(key, step_metric=axis)
                self._wandb_defined.add(key)
            self._wandb.log(row)  # never step=: a lower step than W&B's current one is dropped

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
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


WANDB_ID_FILE = "wandb_run_id"
"""Holds the run's W&B id, so a resumed run logs into the same W&B run."""


def start_wandb(
    run_dir: Path,
    *,
    project: str,
    name: str = "",
    mode: str = "online",
    config: dict[str, Any] | None = None,
) -> Any:
    """A W&B run for `run_dir` (files under run_dir/wandb/), resumed when the directory
    already had one. The WANDB_MODE environment variable, when set, overrides `mode`.
    RuntimeError when the `wandb` package is missing."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "logging.wandb = true needs the wandb package: pip install 'streamrl[wandb]'"
        ) from None
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=project,
        name=name or run_dir.resolve().name,
        dir=str(run_dir),
        mode=os.environ.get("WANDB_MODE") or mode,
        config=config or {},
        id=run_id,
        resume="allow",
    )
    return run


WANDB_AXES = {None: "step", "eval": "eval/version", "checkpoint": "checkpoint/step"}
"""The W&B x axis of each record kind: steps against `step`, evaluations against the policy
version they evaluated, checkpoints against the step they saved."""


def wandb_row(record: dict[str, Any]) -> tuple[dict[str, float], str]:
    """The numbers of a metrics.jsonl record as one W&B row, and the metric they are plotted
    against (`WANDB_AXES`). A record with a `kind` (eval, checkpoint) has its keys that hold
    no "/" prefixed with the kind: an eval's `version` becomes `eval/version`."""
    numbers = {key: value for key, value in record.items() if _is_number(value)}
    kind = record.get("kind")
    if kind is not None:
        numbers = {key if "/" in key else f"{kind}/{key}": value for key, value in numbers.items()}
    return numbers, WANDB_AXES.get(kind, f"{kind}/step")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
