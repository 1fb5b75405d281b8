"""The group accounting, by prompt seq, checked at every step.

    started = trained + filtered + evicted + buffered + in flight (+ in transit)

Two checks, each on sets of prompt seqs rather than counts:

- **The intake's partition** (any moment): every group that arrived is in exactly one of
  trained, filtered, evicted or buffered, and none was trained twice.
- **The cut with a rollout worker** (each of its reports): the worker reports where its
  prompt stream stands (`StreamState`); the report travels on the same ZeroMQ connection
  as its groups, after them, so when it arrives every group the worker had sent before it
  has arrived too. Every seq the worker started must then have arrived, be in flight at
  the worker, or be in transit (sent, not yet acknowledged); and nothing may be in flight
  that it never started. Prompts skipped for length (`data.max_prompt_tokens`) were never
  started.

`Accounting.problems()` lists what breaks either check (empty when all is well); the
learner loop stops the run with them.

The seqs done for good (trained, filtered or evicted) are also where a resume starts:
`position_after` turns them into a `DataPosition`, the prompt stream's resume state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec


class DataPosition(msgspec.Struct, kw_only=True):
    """Resume state: hand out `next_seq`, `next_seq + 1`, ... except the seqs in `skip`."""

    next_seq: int = 0
    """Low-water mark: every seq below it is done."""
    skip: list[int] = []
    """Done seqs at or above `next_seq` (sorted); they are not handed out again."""


def position_after(
    trained_seqs: Iterable[int], *, since: DataPosition | None = None
) -> DataPosition:
    """The position that resumes after `trained_seqs` (and everything `since` had done).

    "Trained" means done for good: trained, or deliberately dropped (e.g. a
    group filtered for zero reward variance). Seqs neither trained nor covered
    by `since` come back on resume, even if they were handed out before.
    """
    since = since or DataPosition()
    done = {s for s in trained_seqs if s >= since.next_seq}
    done.update(since.skip)
    low = since.next_seq
    while low in done:
        done.discard(low)
        low += 1
    return DataPosition(next_seq=low, skip=sorted(s for s in done if s > low))


class AccountingError(RuntimeError):
    """A group lost or counted twice: the run stops with the numbers."""


MAX_LISTED = 10
"""Seqs named per problem (the counts are always given)."""


class StreamState(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rollout process's prompt stream stands (in its reports)."""

    first_seq: int
    """The stream position the process started from (seqs below it were done before)."""
    start_skip: list[int] = []
    """Seqs at or above `first_seq` that were done before the process started."""
    next_seq: int
    """The next seq its prompt source will consider."""
    too_long: list[int] = []
    """Seqs it skipped for length (never started)."""
    in_flight: list[int] = []
    """Seqs started and not yet sent."""
    unacked: list[int] = []
    """Seqs sent and not yet acknowledged."""
    resumed: list[int] = []
    """Seqs of groups saved in flight by a checkpoint that this process started again."""

    def started(self) -> set[int]:
        """Every seq this process started."""
        skipped = set(self.start_skip) | set(self.too_long)
        fresh = {seq for seq in range(self.first_seq, self.next_seq) if seq not in skipped}
        return fresh | set(self.resumed)

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


@dataclass
class Accounting:
    """The fate of every prompt seq the intake has seen (see the module docstring)."""

    received: set[int] = field(default_factory=set)
    trained: set[int] = field(default_factory=set)
    filtered: set[int] = field(default_factory=set)
    evicted: set[int] = field(default_factory=set)
    num_trained_twice: int = 0
    cut_problems: list[str] = field(default_factory=list)
    """Problems found at the latest rollout report."""
    moving: set[int] = field(default_factory=set)
    """Seqs in flight or in transit, not yet received, at the latest rollout report."""
    last_started: set[int] = field(default_factory=set)
    """Every seq the rollout process of the latest report started."""

    @property
    def num_started(self) -> int:
        """Seqs started: those the latest rollout process started, and every one received.
        Equal to received + in flight only when none is lost (the identity's test)."""
        return len(self.last_started | self.received)

    @property
    def in_flight(self) -> int:
        """Seqs in flight or in transit at the latest report and not received since: a group
        that arrives after the worker's last report (the run's stop comes before the next)
        is received, not in flight, so that started = received + in flight."""
        return len(self.moving - self.received)

    def on_trained(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self.num_trained_twice += seq in self.trained
            self.trained.add(seq)

    def on_discarded(self, seq: int, reason: str) -> None:
        (self.evicted if reason.startswith("evicted") else self.filtered).add(seq)

    def on_report(self, state: StreamState) -> None:
        """Check the cut at a rollout report (see the module docstring)."""
        started = state.started()
        moving = set(state.in_flight) | set(state.unacked)
        problems = []
        missing = started - self.received - moving
        if missing:
            problems.append(
                f"{len(missing)} started seqs neither received nor in flight: {_some(missing)}"
            )
        unknown = moving - started
        if unknown:
            problems.append(
                f"{len(unknown)} seqs in flight that were never started: {_some(unknown)}"
            )
        self.cut_problems = problems
        self.moving = moving - self.received
        self.last_started = started

    def problems(self, buffered: Iterable[int]) -> list[str]:
        """Everything that breaks the partition or the latest cut (empty when all is well)."""
        buffered = set(buffered)
        fates = (self.trained, self.filtered, self.evicted, buffered)
        problems = list(self.cut_problems)
        if self.num_trained_twice:
            problems.append(f"{self.num_trained_twice} seqs trained twice")
        for index, first in enumerate(fates):
            for second in fates[index + 1 :]:
                if first & second:
                    problems.append(f"seqs in two fates at once: {_some(first & second)}")
        accounted = set().union(*fates)
        if accounted != self.received:
            problems.append(
                f"received {len(self.received)} != accounted {len(accounted)}: "
                f"unaccounted {_some(self.received - accounted)}, "
                f"never received {_some(accounted - self.received)}"
            )
        return problems

    def as_metrics(self, buffered: Iterable[int]) -> dict[str, int]:
        """The numbers of the identity, for metrics.jsonl (`accounting/...`)."""
        num_buffered = len(set(buffered))
        received = len(self.received)
        return {
            "accounting/started": self.num_started,
            "accounting/received": received,
            "accounting/trained": len(self.trained),
            "accounting/filtered": len(self.filtered),
            "accounting/evicted": len(self.evicted),
            "accounting/buffered": num_buffered,
            "accounting/in_flight": self.in_flight,
        }

    def as_runs(self, buffered: Iterable[int]) -> dict[str, list[list[int]]]:
        """Every fate's seqs as runs `[first, end)` (accounting.json at the end of a run)."""
        fates = {
            "received": self.received,
            "trained": self.trained,
            "filtered": self.filtered,
            "evicted": self.evicted,
            "buffered": set(buffered),
            "in_flight_or_transit": self.moving,
        }
        return {name: runs(seqs) for name, seqs in fates.items()}


def runs(seqs: Iterable[int]) -> list[list[int]]:
    """Sorted seqs as `[first, end)` runs: {1, 2, 3, 7} -> [[1, 4], [7, 8]]."""
    out: list[list[int]] = []
    for seq in sorted(seqs):
        if out and out[-1][1] == seq:
            out[-1][1] = seq + 1
        else:
            out.append([seq, seq + 1])
    return out


def _some(seqs: set[int]) -> str:
    listed = sorted(seqs)[:MAX_LISTED]
    return ", ".join(map(str, listed)) + (" ..." if len(seqs) > MAX_LISTED else "")
