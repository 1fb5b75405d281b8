"""Admission control: how many new groups may start now.

AReaL's rule (arXiv 2505.24298, Eq. 3), counted in groups: with B groups
per training step, eta = max_staleness and v the weight version the engines
serve, a new group may start only while

    live < (v + eta + 1) * B,    live = groups started that will be (or were) trained

so the k-th live group is trained at step floor(k / B) <= v + eta while its
oldest token comes from version >= v. Groups that come back but are never
trained (filtered, evicted) and credits of a dead sender session are
subtracted from `live`, so they do not eat into the staleness budget. After a
resume at version v0 the count is rebased to v0 * B (AReaL issue #1388).

A second bound keeps the buffer within capacity: groups in flight plus
groups buffered never exceed it, so a finished group always has a slot.

Over-sampling (`rollout.over_sampling_batch_size` = O >= B, slime's flag): the
rule counts O groups per version instead of B, so when filters drop a share of
the groups, enough of them are already in flight for the buffer to hold B
trainable ones when the learner asks. If fewer than (O - B) / O of them are
dropped, the surplus waits in the buffer; the buffer's own bound still holds
(a group whose oldest token is more than eta versions old is evicted as stale
and counted, never trained), so every trained group keeps the staleness bound.

A bound that changes during the run (`buffer.max_staleness = "auto"`,
`streamrl.actors.auto_staleness`): admission applies a new eta at once, but a
group whose credit was granted under eta' while the engines served u is owed
eta' until the learner passes version u + eta' (the rule above trains it by
then). `BoundHistory` keeps those promises: the buffer evicts at the largest
bound still owed, so lowering eta never evicts a group admitted under a
higher one that is still within it.
"""

from __future__ import annotations

from collections.abc import Callable


class Admission:
    def __init__(
        self,
        *,
        batch_size: int,
        max_staleness: int,
        capacity: int,
        start_version: int = 0,
        num_buffered: Callable[[], int] = lambda: 0,
        groups_per_step: int = 0,
    ) -> None:
        if capacity < batch_size:
            raise ValueError(f"capacity {capacity} < batch size {batch_size}")
        if groups_per_step and groups_per_step < batch_size:
            raise ValueError(f"groups_per_step {groups_per_step} < batch size {batch_size}")
        self.batch_size = batch_size
        self.groups_per_step = groups_per_step or batch_size
        """B in the rule, or O with over-sampling (see the module docstring)."""
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.version = start_version
        self._base = start_version * self.groups_per_step
        self.num_granted = 0
        self.num_returned = 0
        self.num_revoked = 0
        self.num_discarded = 0
        self._num_buffered = num_buffered

    @property
    def num_in_flight(self) -> int:
        """Credits granted whose group has not come back (nor been revoked)."""
        return self.num_granted - self.num_returned - self.num_revoked

    @property
    def num_live(self) -> int:
        """Groups counted against the staleness budget: base + granted - revoked - discarded."""
        return self._base + self.num_granted - self.num_revoked - self.num_discarded

    def num_startable(self, num_buffered: int) -> int:
        """New groups that may start now, given how many wait in the buffer."""
        by_staleness = (
            self.version + self.max_staleness + 1
        ) * self.groups_per_step - self.num_live
        by_capacity = self.capacity - num_buffered - self.num_in_flight
        return max(0, min(by_staleness, by_capacity))

    def available(self) -> int:
        """New groups that may start now (the stream receiver's CreditSource)."""
        return self.num_startable(self._num_buffered())

    def granted(self, num_groups: int) -> None:
        self.num_granted += num_groups

    def returned(self) -> None:
        self.num_returned += 1

    def revoked(self, num_groups: int) -> None:
        """A sender session died holding these credits; its groups will never come."""
        self.num_revoked += num_groups

    def discarded(self, num_groups: int = 1) -> None:
        """Groups that came back but will not be trained (filtered or evicted)."""
        self.num_discarded += num_groups

    def add_live(self, num_groups: int) -> None:
        """Groups started before a resume that will still be trained (a checkpoint's
        buffered groups): they count against the staleness budget."""
        self._base += num_groups

    def set_version(self, version: int) -> None:
        """The engines now serve `version`: B (or O) more groups may start per version gained."""
        self.version = max(self.version, version)


class BoundHistory:
    """The staleness bounds set during a run, and the one each version's eviction must honour
    (see the module docstring)."""

    def __init__(self, bound: int) -> None:
        self.current = bound
        self._owed: list[tuple[int, int]] = []
        """(bound, last version it admitted groups at), for bounds replaced by a lower one."""

    def set(self, bound: int, version: int) -> None:
        """From now on admission uses `bound`; the engines serve `version`."""
        if bound < self.current:
            self._owed.append((self.current, version))
        self.current = bound

    def eviction_bound(self, version: int) -> int:
        """The bound groups trained at `version` are held to: the current one, or a higher one
        that admitted groups recently enough to be owed (bound + last version >= `version`)."""
        self._owed = [(bound, last) for bound, last in self._owed if last + bound >= version]
        return max([self.current, *(bound for bound, _ in self._owed)])
