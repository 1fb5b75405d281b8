"""Checkpoints written while the learner trains on.

    learner:     cut (async state, rng) ─ stage (copy weights + optimizer) ─► next step ...
    background:                                   write copy, files, state.json ─ rename

The learner stops for the cut with the rollout and for the copy of its state
(`LearnerBackend.stage_checkpoint`, `train.checkpoint_staging`); a thread writes the copy
into the checkpoint's temporary directory, then the async state and random states taken
at the cut and `state.json`, and renames it into place (`streamrl.checkpoint.complete`),
so `latest()` sees it only whole. At most one write is in flight: the next checkpoint
waits for it (`checkpoint/wait_previous_s`), and so does the end of a run. A process
stopped mid-write leaves only a temporary directory, which the next checkpoint removes.

Each write's record (`kind = "checkpoint"`) is written to the metrics when it is found
complete: after the step that follows its end, or when the learner waits for it.

A checkpoint needs its own size free on the disk of the run directory while it is written
(the one it replaces is removed only after). When the last checkpoint's size (or, for the
first, the bytes the learner staged on the host) exceeds the space free, the start says so
on the terminal, naming the keys that change it; a write that fails says what was free.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from streamrl import checkpoint
from streamrl.metrics import MetricsWriter

log = logging.getLogger(__name__)


@dataclass
class _Write:
    state: checkpoint.TrainState
    """The train state at the cut (a copy: the learner's goes on)."""
    record: dict[str, Any]
    """The learner's part of the metrics record."""
    thread: threading.Thread | None = None
    path: Path | None = None
    write_s: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BackgroundCheckpoints:
    """The learner's checkpoint writes: at most one in flight."""

    def __init__(self, run_dir: Path, *, keep: int, metrics: MetricsWriter) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self.metrics = metrics
        self._write: _Write | None = None
        self._last_bytes = 0
        """The size of the last checkpoint written (0: none yet)."""

    @property
    def is_writing(self) -> bool:
        return self._write is not None

    def start(
        self,
        state: checkpoint.TrainState,
        partial: Path,
        write_model: Callable[[], None],
        files: dict[str, bytes],
        record: dict[str, Any],
    ) -> None:
        """Write `write_model()` (into `partial`), `files` and `state` in a thread, then
        rename `partial` into place. The previous write must be over (`wait`)."""
        if self._write is not None:
            raise RuntimeError("a checkpoint write is still in flight")
        if short := self._describe_disk(record):
            log.warning("checkpoint of step %d: %s", state.step, short)
        write = _Write(state=state, record=record)

        def run() -> None:
            started = time.perf_counter()
            try:
                write_model()
                write.path = checkpoint.complete(
                    self.run_dir, state, partial, keep=self.keep, files=files
                )
            except BaseException as exc:  # raised again by the learner (wait or collect)
                write.error = exc
            write.write_s = time.perf_counter() - started
            write.done.set()

        # Not a daemon: an interpreter that exits mid-write finishes the write first.
        write.thread = threading.Thread(target=run, name="checkpoint-write")
        self._write = write
        write.thread.start()

    async def wait(self) -> float:
        """Wait for the write in flight (if any), record it; returns the seconds waited.
        Raises the write's error."""
        if self._write is None:
            return 0.0
        started = time.perf_counter()
        await anyio.to_thread.run_sync(self._write.thread.join)
        waited_s = time.perf_counter() - started
        self._finish()
        return waited_s

    def _describe_disk(self, record: dict[str, Any], *, always: bool = False) -> str | None:
        """What the disk holds for a checkpoint of about the last one's size (the first:
        the bytes staged for it): a warning when that is more than is free, else None
        (`always`: the figures regardless)."""
        needed = self._last_bytes or (
            record.get("checkpoint/staging_reused_bytes", 0)
            + record.get("checkpoint/staging_allocated_bytes", 0)
        )
        free = shutil.disk_usage(self.run_dir).free
        figures = f"{free / 1e9:.1f} GB free under {self.run_dir}"
        if needed:
            figures += f", about {needed / 1e9:.1f} GB to write"
        if needed > free:
            return (
                f"{figures}: the write will run out of space. Free the disk, lower "
                f"train.keep_checkpoints (now {self.keep}) or train.save_interval, or set "
                "train.output_dir on a larger disk"
            )
        return figures if always else None

    def collect(self) -> None:
        """Record the write in flight if it has ended (without waiting); raise its error."""
        if self._write is not None and self._write.done.is_set():
            self._write.thread.join()
            self._finish()

    def _finish(self) -> None:
        write, self._write = self._write, None
        if write.error is not None:
            error = write.error
            disk = self._describe_disk(write.record, always=True)
            raise RuntimeError(
                f"checkpoint of step {write.state.step} failed: {type(error).__name__}: "
                f"{str(error).strip()[:500]} ({disk})"
            ) from error
        record = write.record | {
            "checkpoint/write_s": write.write_s,
            "checkpoint/bytes": checkpoint.size_bytes(write.path),
        }
        self._last_bytes = record["checkpoint/bytes"]
        self.metrics.write(record, step=write.state.step)
        log.info(
            "checkpoint %s (version %d): learner stalled %.2f s, written in %.2f s",
            write.path,
            write.state.version,
            record["checkpoint/stall_s"],
            write.write_s,
        )
