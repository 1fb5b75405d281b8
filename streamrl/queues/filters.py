"""Group filters: which finished groups the buffer keeps (DAPO's dynamic sampling and kin).

A filter is a callable Group -> bool, True to keep the group. The buffer applies them in
order as groups arrive and counts every dropped group under the name of the filter that
dropped it. `buffer.filters` names them: a built-in (below) or `module:function`, a user
filter imported when the run starts (`streamrl.mains.filters.load_filters`: the queues
import no user code), whose counter is that spec.
`buffer.min_response_tokens` / `max_response_tokens` add the length bounds, counted as
those key names.
"""

from __future__ import annotations

from collections.abc import Callable

from streamrl.types import FinishReason, Group, SampleStatus

GroupFilter = Callable[[Group], bool]
"""Returns True to keep a group."""

NamedFilter = tuple[str, GroupFilter]


def zero_std_filter(group: Group) -> bool:
    """Keep a group only if its rewards differ (DAPO's dynamic sampling): equal rewards give zero advantage."""
    rewards = group.rewards
    return len(rewards) > 0 and max(rewards) != min(rewards)


def truncated_filter(group: Group) -> bool:
    """Drop a group in which a sample ended by length (`finish_reason = length`): its reward
    judges an answer that was cut off."""
    return all(s.finish_reason != FinishReason.LENGTH for s in group.samples)


def generation_failed_filter(group: Group) -> bool:
    """Drop a group in which a sample could not be generated (its record stays in the counts)."""
    return all(s.status != SampleStatus.GENERATION_FAILED for s in group.samples)


def min_response_tokens_filter(bound: int) -> GroupFilter:
    """Drop a group in which a sample has fewer than `bound` response tokens."""

    def keep(group: Group) -> bool:
        return all(s.num_response_tokens >= bound for s in group.samples)

    return keep


def max_response_tokens_filter(bound: int) -> GroupFilter:
    """Drop a group in which a sample has more than `bound` response tokens."""

    def keep(group: Group) -> bool:
        return all(s.num_response_tokens <= bound for s in group.samples)

    return keep


FILTERS: dict[str, GroupFilter] = {
    "zero_std": zero_std_filter,
    "truncated": truncated_filter,
    "generation_failed": generation_failed_filter,
}
"""Built-in filters by name (`generation_failed` is always applied first by the intake)."""
