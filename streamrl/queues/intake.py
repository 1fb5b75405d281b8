"""The learner's side of the rollout stream: receiver, admission and buffer as one object.

    rollout ──ZeroMQ──► StreamReceiver ──► Buffer.put (filters) ──► take(B, v) ──► learner
                          ▲ credits            │ filtered / evicted
                          │                    ▼
                        Admission ◄──── their budget comes back
                          ▲
                          └── on_published(v): engines serve v, B more groups may start

Every group goes one way: the receiver de-duplicates it and hands it to the
buffer; the learner takes batches with `take`, which is also where credits
return (the buffer has room again); the publisher reports new versions with
`on_published`. Nothing else reaches into the parts.

`done_seqs` holds the prompt seqs that are finished for good (handed to the
learner, filtered or evicted), from which a checkpoint's data position is
made. `summary()` is the group accounting: every group received is trained,
filtered, evicted or still buffered, and every group started was received or
is still in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio

from streamrl.queues.admission import Admission
from streamrl.queues.buffer import Buffer
from streamrl.queues.filters import GroupFilter, NamedFilter
from streamrl.queues.protocol import Report
from streamrl.queues.transport import StreamReceiver
from streamrl.types import Group


@dataclass
class GeneratedRewards:
    """Reward of every sample that arrived (before filters), since the last `pop`."""

    total: float = 0.0
    num_samples: int = 0

    def add(self, group: Group) -> None:
        self.total += sum(group.rewards)
        self.num_samples += len(group.samples)

    def pop_mean(self) -> float | None:
        """The mean since the last call (None when nothing arrived), and start again."""
        if not self.num_samples:
            return None
        mean = self.total / self.num_samples
        self.total, self.num_samples = 0.0, 0
        return mean


class Intake:
    """Receiver + admission + buffer of one run (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        batch_size: int,
        max_staleness: int,
        capacity: int,
        filters: Iterable[str | GroupFilter | NamedFilter] = (),
        start_version: int = 0,
        groups_per_step: int = 0,
    ) -> None:
        self.admission = Admission(
            batch_size=batch_size,
            max_staleness=max_staleness,
            capacity=capacity,
            start_version=start_version,
            num_buffered=lambda: len(self.buffer),
            groups_per_step=groups_per_step,
        )
        self.buffer = Buffer(
            capacity=capacity,
            max_staleness=max_staleness,
            filters=["generation_failed", *filters],
            on_discard=self._on_discard,
        )
        self.receiver = StreamReceiver(
            address, credits=self.admission, on_group=self._on_group, on_report=self._on_report
        )
        self.done_seqs: set[int] = set()
        self.generated_rewards = GeneratedRewards()
        self.rollout_counters: dict[str, Any] = {}
        """The rollout worker's latest counters (its `rollout` reports)."""
        self._eval_reports: list[Report] = []

    def bind(self) -> str:
        """Bind the receiver now; returns the address rollout processes connect to."""
        return self.receiver.bind()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive groups until cancelled (readiness once bound)."""
        await self.receiver.run(task_status=task_status)

    async def take(self, num_groups: int, version: int) -> list[Group]:
        """The `num_groups` oldest trainable groups at `version` (waits while short); their
        slots go back to admission as credits."""
        groups = await self.buffer.take(num_groups, version)
        self.done_seqs.update(group.prompt_seq for group in groups)
        await self.receiver.grant()
        return groups

    async def on_published(self, version: int) -> None:
        """The engines now serve `version`: admission lets more groups start."""
        self.admission.set_version(version)
        await self.receiver.grant()

    async def stop(self, reason: str) -> None:
        """Tell the senders to start no more groups (groups already sent still arrive)."""
        await self.receiver.stop(reason)

    def pop_eval_reports(self) -> list[Report]:
        """Evaluation results that arrived since the last call."""
        reports, self._eval_reports = self._eval_reports, []
        return reports

    def summary(self) -> dict[str, Any]:
        """The group accounting at this moment (see the module docstring)."""
        stats = self.buffer.stats
        started = int(self.rollout_counters.get("groups_started", self.admission.num_granted))
        received = self.receiver.stats.num_groups
        buffered = len(self.buffer)
        accounted = stats.num_handed_out + stats.num_filtered + stats.num_evicted
        return {
            "groups_started": started,
            "groups_received": received,
            "groups_trained": stats.num_handed_out,
            "groups_filtered": stats.num_filtered,
            "groups_evicted": stats.num_evicted,
            "groups_buffered_at_stop": buffered,
            "groups_in_flight_at_stop": started - received,
            "groups_duplicate": self.receiver.stats.num_duplicates,
            "bad_frames": self.receiver.stats.num_bad_frames,
            "accounting_ok": received == accounted + buffered and started >= received,
            "buffer": stats.as_dict(),
            "rollout": self.rollout_counters,
        }

    # ---- callbacks of the parts ---------------------------------------------

    def _on_group(self, group: Group) -> None:
        self.generated_rewards.add(group)
        self.buffer.put(group)

    def _on_discard(self, group: Group, reason: str) -> None:
        """A filtered or evicted group: its budget goes back, its prompt is done for good."""
        self.admission.discarded()
        self.done_seqs.add(group.prompt_seq)

    def _on_report(self, report: Report) -> None:
        if report.kind == "rollout":
            self.rollout_counters = report.payload
        elif report.kind == "eval":
            self._eval_reports.append(report)
