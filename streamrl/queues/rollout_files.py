"""Saved rollouts: every training step's groups in `rollouts/step_NNNNNN.msgpack`, and the
replay of such a directory in place of the live stream (the debug modes of `train.mode`).

A file holds one `RolloutStep` (the step number and its groups, in the order the learner
took them) in the stream's own msgpack codec (`streamrl.types.make_encoder`), so a file is
exactly what the learner trained on. `ReplayIntake` is the learner's step source
(`streamrl.queues.source.StepSource`) fed from those files: step k takes file k.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from streamrl.queues.buffer import Buffer
from streamrl.queues.intake import IntakeState
from streamrl.queues.progress import ProgressReport, SourceStats
from streamrl.queues.protocol import Report
from streamrl.types import Group, make_decoder, make_encoder

ROLLOUTS_DIR = "rollouts"


class RolloutStep(msgspec.Struct, kw_only=True, tag="rollout_step"):
    step: int
    """The training step (1-based) that took these groups."""
    groups: list[Group]


def step_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.msgpack"


class RolloutWriter:
    """Writes each step's groups under `run_dir/rollouts/` (written whole, then renamed)."""

    def __init__(self, run_dir: Path) -> None:
        self.directory = Path(run_dir) / ROLLOUTS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self._encoder = make_encoder()

    def write(self, step: int, groups: list[Group]) -> Path:
        path = step_file(self.directory, step)
        partial = path.with_suffix(".partial")
        partial.write_bytes(self._encoder.encode(RolloutStep(step=step, groups=groups)))
        os.replace(partial, path)
        return path


def read_step(path: Path) -> RolloutStep:
    """One saved step; ValueError naming the file when it cannot be decoded."""
    try:
        return make_decoder(RolloutStep).decode(Path(path).read_bytes())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path}: not a saved rollout step ({exc})") from None


def saved_steps(directory: Path) -> list[int]:
    """The step numbers saved under `directory`, ascending."""
    return sorted(int(p.stem.removeprefix("step_")) for p in Path(directory).glob("step_*.msgpack"))


class ReplayIntake:
    """The learner's step source in `train_only`: step k's batch is the groups of file k.

    The groups pass through a `Buffer` (no filters: they were applied when the groups
    were saved; no staleness bound: they are trained as saved), so the step's buffer
    statistics are those of the replay. No stream: nothing is in flight, filtered or
    evicted, no rollout counters, no evaluation results."""

    def __init__(self, directory: Path, *, start_step: int = 0) -> None:
        self.directory = Path(directory)
        self.next_step = start_step + 1
        self._buffer = Buffer(
            capacity=1 << 30, max_staleness=1 << 30, staleness_rule="episode", filters=()
        )
        self._done_seqs: set[int] = set()

    def check(self, last_step: int) -> None:
        """ValueError naming the directory when a step from here to `last_step` is missing."""
        if not self.directory.is_dir():
            raise ValueError(f"train.load_rollouts: {self.directory} is not a directory")
        saved = set(saved_steps(self.directory))
        missing = [k for k in range(self.next_step, last_step + 1) if k not in saved]
        if missing:
            raise ValueError(
                f"train.load_rollouts: {self.directory} has no file for step(s) "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} of the {last_step} of "
                f"train.steps (it holds {len(saved)} step files)"
            )

    async def take(self, num_groups: int, version: int) -> list[Group]:
        saved = read_step(step_file(self.directory, self.next_step))
        if len(saved.groups) != num_groups:
            raise ValueError(
                f"{step_file(self.directory, self.next_step)}: {len(saved.groups)} groups, "
                f"but rollout.batch_size = {num_groups}"
            )
        for group in saved.groups:
            self._buffer.put(group)
        self.next_step += 1
        groups = self._buffer.pop_batch(num_groups, version)
        self._done_seqs.update(group.prompt_seq for group in groups)
        return groups

    @property
    def done_seqs(self) -> set[int]:
        """Prompt seqs trained so far by this replay."""
        return self._done_seqs

    def pop_eval_reports(self) -> list[Report]:
        """None: evaluations need engines."""
        return []

    def stats(self) -> SourceStats:
        """The replay buffer's counters. The accounting has nothing to check: no stream, so
        nothing started, filtered or in flight; every group read is trained in the step of
        its file."""
        return SourceStats(
            buffer=self._buffer.stats,
            num_buffered=len(self._buffer),
            max_staleness=self._buffer.max_staleness,
            accounting={"accounting/trained": len(self._done_seqs)},
        )

    def progress(self, num_needed: int) -> ProgressReport:
        """Nothing to wait for: the next file is read when the learner asks for it."""
        return ProgressReport(num_needed=num_needed, num_buffered=len(self._buffer))

    async def cut(self, step: int, *, timeout_s: float) -> IntakeState:
        """A checkpoint's async state: the trained seqs (nothing buffered between steps, no
        rollout to cut with)."""
        return IntakeState(
            received=sorted(self._done_seqs), trained=sorted(self._done_seqs), is_complete=True
        )

    def summary(self) -> dict[str, Any]:
        stats = self._buffer.stats
        return {
            "groups_replayed": stats.num_accepted,
            "groups_trained": stats.num_handed_out,
            "accounting_ok": stats.num_accepted == stats.num_handed_out + len(self._buffer),
            "buffer": stats.as_dict(),
        }
