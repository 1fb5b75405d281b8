"""The bounded, staleness-aware buffer between the rollout stream and the learner.

Invariants (tested with hypothesis in tests/queues/test_buffer.py, and for multi-turn
episodes in tests/agents/test_gateway_horizon.py):
- at most `capacity` groups are held;
- a group handed to the learner at version v has staleness
  v - oldest_token_version <= max_staleness; under `staleness_rule = "per_turn"`
  (`streamrl.queues.horizon`) that holds for each sample's last turn, and consecutive
  turns are at most max_staleness versions apart (the same check for one turn);
- every accepted group is handed out exactly once, or counted as filtered
  (at `put`) or evicted (stale, or overflow when a put finds the buffer full).

Batches go out oldest-first: by oldest token version, then arrival order, so
the groups closest to the staleness bound are trained before they cross it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio

from streamrl.queues import horizon
from streamrl.queues.filters import FILTERS, GroupFilter, NamedFilter
from streamrl.types import Group

log = logging.getLogger(__name__)


@dataclass
class LengthStats:
    num_samples: int = 0
    num_tokens: int = 0

    def add(self, group: Group) -> None:
        self.num_samples += len(group.samples)
        self.num_tokens += group.num_response_tokens

    @property
    def mean(self) -> float:
        return self.num_tokens / self.num_samples if self.num_samples else 0.0


@dataclass
class BufferStats:
    """Cumulative counters of everything that passed through the buffer."""

    num_accepted: int = 0
    num_handed_out: int = 0
    filtered: collections.Counter = field(default_factory=collections.Counter)
    evicted: collections.Counter = field(default_factory=collections.Counter)
    staleness: collections.Counter = field(default_factory=collections.Counter)
    """Histogram of staleness of handed-out groups."""
    versions_spanned: collections.Counter = field(default_factory=collections.Counter)
    """Histogram of how many weight versions handed-out groups span."""
    turn_staleness: collections.Counter = field(default_factory=collections.Counter)
    """Histogram of staleness of each model turn of handed-out groups (see horizon.py)."""
    num_past_bound: int = 0
    """Handed-out groups whose oldest token was older than max_staleness (per-turn rule)."""
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0
    generated: LengthStats = field(default_factory=LengthStats)
    trained: LengthStats = field(default_factory=LengthStats)

    @property
    def num_filtered(self) -> int:
        return sum(self.filtered.values())

    @property
    def num_evicted(self) -> int:
        return sum(self.evicted.values())

    def as_dict(self) -> dict:
        handed = max(self.num_handed_out, 1)
        return {
            "groups_accepted": self.num_accepted,
            "groups_trained": self.num_handed_out,
            "groups_filtered": self.num_filtered,
            "groups_evicted": self.num_evicted,
            "filtered_by": dict(self.filtered),
            "evicted_by": dict(self.evicted),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "versions_spanned_histogram": {
                str(k): v for k, v in sorted(self.versions_spanned.items())
            },
            "turn_staleness_histogram": {str(k): v for k, v in sorted(self.turn_staleness.items())},
            "groups_trained_past_bound": self.num_past_bound,
            "buffer_wait_s_mean": self.wait_s_total / handed,
            "buffer_wait_s_max": self.wait_s_max,
            "response_len_generated_mean": self.generated.mean,
            "response_len_trained_mean": self.trained.mean,
        }


@dataclass(order=True)
class _Entry:
    oldest_version: int
    arrival: int
    arrived_at: float = field(compare=False)
    group: Group = field(compare=False)


class Buffer:
    """Holds finished groups until the learner takes them; see the module docstring."""

    def __init__(
        self,
        *,
        capacity: int,
        max_staleness: int,
        staleness_rule: horizon.StalenessRule,
        filters: Iterable[str | GroupFilter | NamedFilter],
        clock: Callable[[], float] = time.monotonic,
        on_discard: Callable[[Group, str], None] | None = None,
        max_episode_staleness: int = 0,
    ) -> None:
        """`staleness_rule` and `filters` have no default here: the run's are
        `buffer.staleness_rule`'s and `buffer.filters`'."""
        if capacity <= 0:
            raise ValueError("buffer capacity must be positive")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.staleness_rule = staleness_rule
        self.max_episode_staleness = max_episode_staleness
        self.filters = [_named(f) for f in filters]
        self.stats = BufferStats()
        self._clock = clock
        self._on_discard = on_discard
        self._heap: list[_Entry] = []
        self._arrivals = itertools.count()
        self._changed = anyio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, group: Group) -> str:
        """Offer a finished group. Returns `accepted`, or `filtered:<name>`."""
        self.stats.num_accepted += 1
        self.stats.generated.add(group)
        for name, keep in self.filters:
            if not keep(group):
                self.stats.filtered[name] += 1
                self._discard(group, f"filtered:{name}")
                return f"filtered:{name}"
        if self.staleness_rule == "per_turn" and horizon.max_turn_gap(group) > self.max_staleness:
            self.stats.evicted["turn_stale"] += 1
            log.warning(
                "group %s evicted: a turn was %d versions old when the next began (> %d)",
                group.group_id,
                horizon.max_turn_gap(group),
                self.max_staleness,
            )
            self._discard(group, "evicted:turn_stale")
            return "evicted:turn_stale"
        if len(self._heap) >= self.capacity:
            victim = heapq.heappop(self._heap)
            self.stats.evicted["overflow"] += 1
            log.warning(
                "buffer full (%d groups): evicted group %s", self.capacity, victim.group.group_id
            )
            self._discard(victim.group, "evicted:overflow")
        # The heap key is the version the bound is measured from (the oldest token, or the
        # last turn's oldest token under the per-turn rule): stale groups surface first.
        oldest = horizon.bound_version(group, self.staleness_rule)
        entry = _Entry(-1 if oldest is None else oldest, next(self._arrivals), self._clock(), group)
        heapq.heappush(self._heap, entry)
        self._notify()
        return "accepted"

    def evict_stale(self, version: int) -> int:
        """Evict groups that can no longer be trained at `version` (staleness > max)."""
        num_evicted = self._evict_episode_stale(version)
        while self._heap and version - self._heap[0].oldest_version > self.max_staleness:
            if self._heap[0].oldest_version < 0:  # nothing trainable in it: never stale
                break
            entry = heapq.heappop(self._heap)
            self.stats.evicted["stale"] += 1
            num_evicted += 1
            spanned = entry.group.num_versions_spanned
            log.warning(
                "group %s evicted: staleness %d > %d%s",
                entry.group.group_id,
                version - entry.oldest_version,
                self.max_staleness,
                f" (its episode spans {spanned} versions: set buffer.staleness_rule = "
                f"'per_turn', or raise buffer.max_staleness above the versions it lives through)"
                if spanned > self.max_staleness and self.staleness_rule == "episode"
                else "",
            )
            self._discard(entry.group, "evicted:stale")
        return num_evicted

    def pop_batch(self, num_groups: int, version: int) -> list[Group] | None:
        """The `num_groups` oldest trainable groups at `version`, or None if there are fewer."""
        self.evict_stale(version)
        if len(self._heap) < num_groups:
            return None
        now = self._clock()
        batch = []
        for _ in range(num_groups):
            entry = heapq.heappop(self._heap)
            group = entry.group
            wait_s = now - entry.arrived_at
            self.stats.num_handed_out += 1
            self.stats.staleness[group.staleness(version)] += 1
            self.stats.versions_spanned[group.num_versions_spanned] += 1
            self.stats.turn_staleness.update(horizon.turn_staleness(group, version))
            if group.staleness(version) > self.max_staleness:  # per-turn rule: say so
                self.stats.num_past_bound += 1
                log.info(
                    "group %s trained at staleness %d > %d under the per-turn rule (turns: %s)",
                    group.group_id,
                    group.staleness(version),
                    self.max_staleness,
                    horizon.turn_staleness(group, version),
                )
            self.stats.wait_s_total += wait_s
            self.stats.wait_s_max = max(self.stats.wait_s_max, wait_s)
            self.stats.trained.add(group)
            batch.append(group)
        return batch

    async def take(self, num_groups: int, version: int) -> list[Group]:
        """Wait until `num_groups` trainable groups are held, then pop them."""
        while (batch := self.pop_batch(num_groups, version)) is None:
            changed = self._changed
            await changed.wait()
        return batch

    def groups(self) -> list[Group]:
        """The groups held, oldest first (a checkpoint's copy; they stay held)."""
        return [entry.group for entry in sorted(self._heap)]

    def restore(self, groups: Iterable[Group]) -> None:
        """Hold checkpointed groups again (they passed the filters when they arrived)."""
        for group in groups:
            oldest = group.oldest_version
            entry = _Entry(
                -1 if oldest is None else oldest, next(self._arrivals), self._clock(), group
            )
            heapq.heappush(self._heap, entry)
        self._notify()

    @property
    def seqs(self) -> list[int]:
        """Prompt seqs of the groups held."""
        return [entry.group.prompt_seq for entry in self._heap]

    def drain(self) -> list[Group]:
        """Remove and return every held group (at shutdown; they count as in flight at stop)."""
        groups = [entry.group for entry in sorted(self._heap)]
        self._heap.clear()
        return groups

    def _evict_episode_stale(self, version: int) -> int:
        """Evict groups whose oldest token is past `max_episode_staleness` (when > 0)."""
        limit = self.max_episode_staleness
        if not limit:
            return 0
        stale = [e for e in self._heap if e.group.staleness(version) > limit]
        if not stale:
            return 0
        self._heap = [e for e in self._heap if e.group.staleness(version) <= limit]
        heapq.heapify(self._heap)
        for entry in stale:
            self.stats.evicted["episode_stale"] += 1
            log.warning(
                "group %s evicted: its oldest token is %d versions old (> "
                "buffer.max_episode_staleness = %d)",
                entry.group.group_id,
                entry.group.staleness(version),
                limit,
            )
            self._discard(entry.group, "evicted:episode_stale")
        return len(stale)

    def _discard(self, group: Group, reason: str) -> None:
        if self._on_discard is not None:
            self._on_discard(group, reason)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


def _named(spec: str | GroupFilter | NamedFilter) -> NamedFilter:
    """(name, filter) for a built-in name, a (name, filter) pair or a bare callable."""
    if isinstance(spec, str):
        return spec, FILTERS[spec]
    if isinstance(spec, tuple):
        return spec
    return spec.__name__, spec
