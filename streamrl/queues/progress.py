"""What a step source tells the learner: a step's counters (`SourceStats`) and what became
of the groups since the learner's last batch (`ProgressReport`, the stall report's numbers).

    rollout ─► arrived ─► filtered by <name> (with the rewards that made it drop them)
                      ├─► evicted for <reason>
                      └─► buffered ─► taken by the learner (the window starts again)

`StepProgress` counts, between two batches, the groups that arrived, the samples among
them whose generation or reward failed, and the groups each filter dropped or the buffer
evicted; for every filter it keeps the statistics of the dropped groups' rewards (a
`zero_std` filter dropping groups whose rewards are all 0 reads differently from one
dropping groups whose rewards are all 1). A step source turns it into a `ProgressReport`
with what the learner waits for; `streamrl.actors.stall` says it on the terminal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from streamrl.queues.buffer import BufferStats
from streamrl.types import Group, SampleStatus


@dataclass
class RewardStats:
    """Count, mean, standard deviation (over samples, population), minimum and maximum of
    the rewards of the groups added."""

    num_groups: int = 0
    num_samples: int = 0
    total: float = 0.0
    total_squares: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def add(self, group: Group) -> None:
        rewards = group.rewards
        self.num_groups += 1
        if not rewards:
            return
        self.num_samples += len(rewards)
        self.total += sum(rewards)
        self.total_squares += sum(r * r for r in rewards)
        self.min = min(self.min, *rewards)
        self.max = max(self.max, *rewards)

    @property
    def mean(self) -> float:
        return self.total / self.num_samples if self.num_samples else 0.0

    @property
    def std(self) -> float:
        if not self.num_samples:
            return 0.0
        return math.sqrt(max(self.total_squares / self.num_samples - self.mean**2, 0.0))

    def describe(self) -> str:
        """`rewards mean 0.000 std 0.000 min 0.000 max 0.000 over 64 samples`."""
        if not self.num_samples:
            return "no samples"
        return (
            f"rewards mean {self.mean:.3f} std {self.std:.3f} min {self.min:.3f} "
            f"max {self.max:.3f} over {self.num_samples} samples"
        )


@dataclass(frozen=True)
class ProgressReport:
    """Where a step source stands for the learner's next batch: what it needs and has, and
    what became of the groups since its previous batch (see the module docstring)."""

    num_needed: int
    """Groups the learner waits for (rollout.batch_size)."""
    num_buffered: int
    """Groups held, ready to be trained."""
    num_in_flight: int = 0
    """Groups being generated or sent, at the rollout's latest report."""
    num_startable: int = 0
    """Groups admission lets start now (0: the staleness bound or the capacity holds them)."""
    num_arrived: int = 0
    """Groups that arrived since the learner's previous batch."""
    num_samples: int = 0
    """Samples in those groups."""
    num_generation_failed: int = 0
    """Samples among them whose generation failed."""
    num_reward_failed: int = 0
    """Samples among them whose reward function failed (their reward is 0)."""
    filtered: dict[str, RewardStats] = field(default_factory=dict)
    """Groups dropped since the previous batch, by the filter that dropped them."""
    evicted: dict[str, int] = field(default_factory=dict)
    """Groups evicted since the previous batch, by reason (stale, overflow, ...)."""

    @property
    def num_filtered(self) -> int:
        return sum(stats.num_groups for stats in self.filtered.values())

    @property
    def num_evicted(self) -> int:
        return sum(self.evicted.values())


@dataclass(frozen=True)
class SourceStats:
    """A step source's counters at the end of a step (the step record's `groups_*`,
    `filtered/*`, `rollout/*` and `accounting/*` numbers)."""

    buffer: BufferStats
    """Cumulative counters of the source's buffer."""
    num_buffered: int
    """Groups held after the step's batch was taken."""
    max_staleness: int
    """The staleness bound the buffer enforces."""
    generated_reward_mean: float | None = None
    """Mean reward of every sample that arrived since the previous `stats()` (filtered
    groups included); None when nothing arrived."""
    rollout: dict[str, Any] = field(default_factory=dict)
    """The rollout process's latest counters (empty without a rollout)."""
    accounting: dict[str, int] = field(default_factory=dict)
    """The group accounting's numbers (`accounting/...`)."""
    accounting_problems: list[str] = field(default_factory=list)
    """What breaks the accounting identity (empty when every group is accounted for)."""


class StepProgress:
    """Counts what happens to the groups between two batches (see the module docstring)."""

    def __init__(self) -> None:
        self._start_window()

    def _start_window(self) -> None:
        self._num_arrived = 0
        self._num_samples = 0
        self._num_generation_failed = 0
        self._num_reward_failed = 0
        self._filtered: dict[str, RewardStats] = {}
        self._evicted: dict[str, int] = {}

    def on_arrived(self, group: Group) -> None:
        self._num_arrived += 1
        self._num_samples += len(group.samples)
        for sample in group.samples:
            self._num_generation_failed += sample.status == SampleStatus.GENERATION_FAILED
            self._num_reward_failed += sample.status == SampleStatus.REWARD_FAILED

    def on_discarded(self, group: Group, reason: str) -> None:
        """`reason` as the buffer gives it: `filtered:<name>` or `evicted:<why>`."""
        kind, _, name = reason.partition(":")
        if kind == "filtered":
            self._filtered.setdefault(name, RewardStats()).add(group)
        else:
            self._evicted[name] = self._evicted.get(name, 0) + 1

    def on_taken(self) -> None:
        """The learner took a batch: the window starts again."""
        self._start_window()

    def report(
        self, *, num_needed: int, num_buffered: int, num_in_flight: int = 0, num_startable: int = 0
    ) -> ProgressReport:
        """The window so far, with what the learner needs and what its source holds."""
        return ProgressReport(
            num_needed=num_needed,
            num_buffered=num_buffered,
            num_in_flight=num_in_flight,
            num_startable=num_startable,
            num_arrived=self._num_arrived,
            num_samples=self._num_samples,
            num_generation_failed=self._num_generation_failed,
            num_reward_failed=self._num_reward_failed,
            filtered={name: _copy(stats) for name, stats in self._filtered.items()},
            evicted=dict(self._evicted),
        )


def _copy(stats: RewardStats) -> RewardStats:
    return RewardStats(**vars(stats))
