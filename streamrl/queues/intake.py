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
`on_published`. The parts are private: the learner asks through the `StepSource`
interface (`streamrl.queues.source`: `take`, `stats`, `progress`, `cut`,
`done_seqs`, `pop_eval_reports`), the trainer through the methods below.

`progress(B)` reports what became of the groups since the learner's last batch
(`streamrl.queues.progress`: arrived, failed, filtered with their rewards, evicted) and
what the next batch waits for (buffered, in flight, startable): the learner's stall
report.

`accounting` follows the fate of every prompt seq (`streamrl.queues.accounting`):
`done_seqs` (trained, filtered or evicted) make a checkpoint's data position, and
`accounting_problems()` checks, at every step, that every group received is in
exactly one fate and every prompt the rollout started is received or in flight.
`summary()` gives the same accounting in counts at the end (over the run's whole
lineage: a resumed run restores the fates with `restore`).

`cut(step)` takes the intake's state at a consistent cut with the rollout for a
checkpoint (`IntakeState`): the buffered groups, every seq's fate and the groups in
flight with their tokens so far.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from streamrl.queues.accounting import Accounting, StreamState
from streamrl.queues.admission import Admission, BoundHistory
from streamrl.queues.buffer import Buffer
from streamrl.queues.filters import GroupFilter, NamedFilter
from streamrl.queues.horizon import StalenessRule
from streamrl.queues.progress import ProgressReport, SourceStats, StepProgress
from streamrl.queues.protocol import Fatal, Report
from streamrl.queues.receiver import StreamReceiver
from streamrl.types import Group, PartialGroup


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


class IntakeState(msgspec.Struct, kw_only=True):
    """The intake at a consistent cut with the rollout (a checkpoint's `async_state.msgpack`):
    the groups buffered, every prompt seq's fate, and the groups in flight with their
    tokens so far (`PartialGroup`), which the rollout reported right after the groups it had
    sent, so no group is in two of them."""

    buffered: list[Group] = []
    received: list[int] = []
    trained: list[int] = []
    filtered: list[int] = []
    evicted: list[int] = []
    in_flight: list[PartialGroup] = []
    is_complete: bool = False
    """False when the rollout did not answer in time: `in_flight` is then empty and those
    groups are generated again on resume."""
    cut_s: float = 0.0
    """From the request to the rollout's answer (generation was held for part of it)."""
    rollout_pause_s: float = 0.0
    """How long the rollout held its generation for the cut (`rollout_pause_s` <= `cut_s`):
    every engine request aborted, every call parked, the tokens read."""
    rollout_aborts: int = 0
    """How many times the rollout aborted the engines' requests for the cut (more than one:
    a call reached its engine after an abort; `streamrl.actors.in_flight.REABORT_S`)."""


class Intake:
    """Receiver + admission + buffer of one run (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        batch_size: int,
        max_staleness: int,
        capacity: int,
        staleness_rule: StalenessRule,
        filters: Iterable[str | GroupFilter | NamedFilter],
        start_version: int = 0,
        max_episode_staleness: int = 0,
        groups_per_step: int = 0,
    ) -> None:
        self._admission = Admission(
            batch_size=batch_size,
            max_staleness=max_staleness,
            capacity=capacity,
            start_version=start_version,
            num_buffered=lambda: len(self._buffer),
            groups_per_step=groups_per_step,
        )
        self._bounds = BoundHistory(max_staleness)
        self._buffer = Buffer(
            capacity=capacity,
            max_staleness=max_staleness,
            filters=["generation_failed", *filters],
            on_discard=self._on_discard,
            staleness_rule=staleness_rule,
            max_episode_staleness=max_episode_staleness,
        )
        self._receiver = StreamReceiver(
            address,
            credits=self._admission,
            on_group=self._on_group,
            on_report=self._on_report,
            on_fatal=self._on_fatal,
        )
        self._accounting = Accounting()
        """The fate of every prompt seq (`streamrl.queues.accounting`)."""
        self._generated_rewards = GeneratedRewards()
        self._progress = StepProgress()
        self._rollout_counters: dict[str, Any] = {}
        """The rollout worker's latest counters (its `rollout` reports)."""
        self.fatal: Fatal | None = None
        """The rollout's error that a restart cannot fix, once one arrived (the run stops)."""
        self.fatal_arrived = anyio.Event()
        self._eval_reports: list[Report] = []
        self._cuts: dict[int, IntakeState] = {}
        self._cut_arrived = anyio.Event()

    def bind(self) -> str:
        """Bind the receiver now; returns the address rollout processes connect to."""
        return self._receiver.bind()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive groups until cancelled (readiness once bound)."""
        await self._receiver.run(task_status=task_status)

    async def take(self, num_groups: int, version: int) -> list[Group]:
        """The `num_groups` oldest trainable groups at `version` (waits while short); their
        slots go back to admission as credits."""
        self._buffer.max_staleness = self._bounds.eviction_bound(version)
        groups = await self._buffer.take(num_groups, version)
        self._progress.on_taken()
        self._accounting.on_trained(group.prompt_seq for group in groups)
        await self._receiver.grant()
        return groups

    async def on_published(self, version: int) -> None:
        """The engines now serve `version`: admission lets more groups start."""
        self._admission.set_version(version)
        await self._receiver.grant()

    async def set_max_staleness(self, bound: int) -> None:
        """Admit new groups under `bound` from now on; groups admitted under a higher bound keep
        it until they are due (`BoundHistory`). A higher bound lets more groups start now."""
        self._bounds.set(bound, self._admission.version)
        self._admission.max_staleness = bound
        await self._receiver.grant()

    async def stop(self, reason: str) -> None:
        """Tell the senders to start no more groups (groups already sent still arrive)."""
        await self._receiver.stop(reason)

    @property
    def received_seqs(self) -> set[int]:
        """Prompt seqs whose group arrived (once each: resends are de-duplicated)."""
        return self._accounting.received

    @property
    def done_seqs(self) -> set[int]:
        """Prompt seqs finished for good: trained, filtered or evicted."""
        accounting = self._accounting
        return accounting.trained | accounting.filtered | accounting.evicted

    def accounting_problems(self) -> list[str]:
        """What breaks the accounting identity now (empty when every seq is accounted for)."""
        return self._accounting.problems(self._buffer.seqs)

    def accounting_runs(self) -> dict[str, list[list[int]]]:
        """Every fate's seqs as `[first, end)` runs (the run's accounting.json)."""
        return self._accounting.as_runs(self._buffer.seqs)

    def stats(self) -> SourceStats:
        """The step's counters (`StepSource.stats`): buffer, rollout, accounting; the mean
        reward of what arrived since the previous call."""
        return SourceStats(
            buffer=self._buffer.stats,
            num_buffered=len(self._buffer),
            max_staleness=self._buffer.max_staleness,
            generated_reward_mean=self._generated_rewards.pop_mean(),
            rollout=self._rollout_counters,
            accounting=self._accounting.as_metrics(self._buffer.seqs),
            accounting_problems=self.accounting_problems(),
        )

    def progress(self, num_needed: int) -> ProgressReport:
        """What became of the groups since the learner's last batch, and what a batch of
        `num_needed` waits for (`StepSource.progress`)."""
        return self._progress.report(
            num_needed=num_needed,
            num_buffered=len(self._buffer),
            num_in_flight=self._accounting.in_flight,
            num_startable=self._admission.available(),
        )

    async def cut(self, step: int, *, timeout_s: float) -> IntakeState:
        """This intake's state at a cut with the rollout worker (`IntakeState`): the worker
        is asked for its groups in flight, and the cut is taken when its answer arrives.
        Without an answer within `timeout_s` the state is taken now, without them."""
        started = time.perf_counter()
        if await self._receiver.request_in_flight(step):
            with anyio.move_on_after(timeout_s):
                while step not in self._cuts:
                    arrived = self._cut_arrived
                    await arrived.wait()
        state = self._cuts.pop(step, None) or self._state_at_cut([], is_complete=False)
        state.cut_s = time.perf_counter() - started
        return state

    def restore(self, state: IntakeState) -> None:
        """Take back a checkpoint's state: its groups buffered again, every seq's fate. The
        buffered groups count against the staleness budget as groups started."""
        self._buffer.restore(state.buffered)
        accounting = self._accounting
        accounting.received.update(state.received)
        accounting.trained.update(state.trained)
        accounting.filtered.update(state.filtered)
        accounting.evicted.update(state.evicted)
        self._admission.add_live(len(state.buffered))

    def _state_at_cut(self, in_flight: list[PartialGroup], *, is_complete: bool) -> IntakeState:
        accounting = self._accounting
        return IntakeState(
            buffered=self._buffer.groups(),
            received=sorted(accounting.received),
            trained=sorted(accounting.trained),
            filtered=sorted(accounting.filtered),
            evicted=sorted(accounting.evicted),
            in_flight=in_flight,
            is_complete=is_complete,
        )

    def pop_eval_reports(self) -> list[Report]:
        """Evaluation results that arrived since the last call."""
        reports, self._eval_reports = self._eval_reports, []
        return reports

    def summary(self) -> dict[str, Any]:
        """The group accounting at this moment (see the module docstring)."""
        stats, accounting = self._buffer.stats, self._accounting
        received = len(accounting.received)
        return {
            "groups_started": accounting.num_started,
            "groups_received": received,
            "groups_trained": len(accounting.trained),
            "groups_filtered": len(accounting.filtered),
            "groups_evicted": len(accounting.evicted),
            "groups_buffered_at_stop": len(self._buffer),
            "groups_in_flight_at_stop": accounting.in_flight,
            "groups_duplicate": self._receiver.stats.num_duplicates,
            "bad_frames": self._receiver.stats.num_bad_frames,
            "accounting_ok": not self.accounting_problems(),
            "buffer": stats.as_dict(),
            "rollout": self._rollout_counters,
        }

    # ---- callbacks of the parts ---------------------------------------------

    def _on_group(self, group: Group) -> None:
        self._accounting.received.add(group.prompt_seq)
        self._generated_rewards.add(group)
        self._progress.on_arrived(group)
        self._buffer.put(group)

    def _on_discard(self, group: Group, reason: str) -> None:
        """A filtered or evicted group: its budget goes back, its prompt is done for good."""
        self._admission.discarded()
        self._accounting.on_discarded(group.prompt_seq, reason)
        self._progress.on_discarded(group, reason)

    def _on_fatal(self, fatal: Fatal) -> None:
        if self.fatal is None:  # the first is the cause
            self.fatal = fatal
        self.fatal_arrived.set()

    def _on_report(self, report: Report) -> None:
        if report.kind == "rollout":
            self._rollout_counters = report.payload
            if "stream" in report.payload:
                self._accounting.on_report(msgspec.convert(report.payload["stream"], StreamState))
        elif report.kind == "eval":
            self._eval_reports.append(report)
        elif report.kind == "in_flight":  # the cut: every group sent before it has arrived
            payload = report.payload
            in_flight = msgspec.convert(payload.get("groups", []), list[PartialGroup])
            complete = bool(payload.get("complete", False))
            cut = self._state_at_cut(in_flight, is_complete=complete)
            cut.rollout_pause_s = float(payload.get("seconds", 0.0))
            cut.rollout_aborts = int(payload.get("aborts", 0))
            self._cuts[int(payload["step"])] = cut
            self._cut_arrived.set()
            self._cut_arrived = anyio.Event()
