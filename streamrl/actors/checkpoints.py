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
"""

from __future__ import annotations

import logging
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

    def collect(self) -> None:
        """Record the write in flight if it has ended (without waiting); raise its error."""
        if self._write is not None and self._write.done.is_set():
            self._write.thread.join()
            self._finish()

    def _finish(self) -> None:
        write, self._write = self._write, None
        if write.error is not None:
            raise RuntimeError(f"checkpoint of step {write.state.step} failed") from write.error
        record = write.record | {
            "checkpoint/write_s": write.write_s,
            "checkpoint/bytes": checkpoint.size_bytes(write.path),
        }
        self.metrics.write(record, step=write.state.step)
        log.info(
            "checkpoint %s (version %d): learner stalled %.2f s, written in %.2f s",
            write.path,
            write.state.version,
            record["checkpoint/stall_s"],
            write.write_s,
        )
