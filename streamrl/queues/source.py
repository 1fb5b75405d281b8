"""What the learner loop asks of where its batches come from: the `StepSource` interface.

    StepSource ─ take(B, v) ───────────► a step's batch (waits while short)
               ─ stats() ──────────────► counters for the step's metrics (`SourceStats`)
               ─ progress(B) ──────────► what the learner waits for (`ProgressReport`)
               ─ cut(step), done_seqs ─────► a checkpoint's cut
               ─ pop_eval_reports() ───► evaluation results that arrived

Two implementations: the live stream (`streamrl.queues.intake.Intake`: receiver,
admission and buffer) and the saved rollouts of `train_only`
(`streamrl.queues.rollout_files.ReplayIntake`). The learner sees only this interface, so
neither has to look like the other inside.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from streamrl.queues.intake import IntakeState
from streamrl.queues.progress import ProgressReport, SourceStats
from streamrl.queues.protocol import Report
from streamrl.types import Group


@runtime_checkable
class StepSource(Protocol):
    """Where the learner loop's batches come from (see the module docstring)."""

    async def take(self, num_groups: int, version: int) -> list[Group]:
        """The next step's `num_groups` groups for training at `version` (waits while short)."""
        ...

    def stats(self) -> SourceStats:
        """Counters for the step just taken; called once per step (the generated-reward
        mean covers the groups since the previous call)."""
        ...

    def progress(self, num_needed: int) -> ProgressReport:
        """What became of the groups since the previous batch, and what the next one of
        `num_needed` groups waits for (the stall report)."""
        ...

    async def cut(self, step: int, *, timeout_s: float) -> IntakeState:
        """The source's state at a consistent cut, for the checkpoint of `step`."""
        ...

    @property
    def done_seqs(self) -> set[int]:
        """Prompt seqs finished for good (trained, filtered or evicted): a checkpoint's data
        position."""
        ...

    def pop_eval_reports(self) -> list[Report]:
        """Evaluation results that arrived since the last call."""
        ...
