"""Group filters: which finished groups the buffer keeps (DAPO's dynamic sampling and kin).

A filter is a callable Group -> bool, True to keep the group. The buffer applies them in
order as groups arrive and counts every dropped group under the name of the filter that
dropped it. `buffer.filters` names them: a built-in (below) or `module:function`, a user
filter imported when the run starts (`load_filters`), whose counter is that spec.
`buffer.min_response_tokens` / `max_response_tokens` add the length bounds, counted as
those key names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from streamrl.types import FinishReason, Group, SampleStatus
from streamrl.utils import import_object

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


def load_filters(
    names: Sequence[str], *, min_response_tokens: int = 0, max_response_tokens: int = 0
) -> list[NamedFilter]:
    """(name, filter) for `buffer.filters` and the length bounds, in that order.

    A `module:function` entry is imported and checked to be a callable taking one
    argument; any problem raises ValueError naming `buffer.filters[i]`."""
    filters: list[NamedFilter] = []
    for index, name in enumerate(names):
        key = f"buffer.filters[{index}]"
        if name in FILTERS:
            filters.append((name, FILTERS[name]))
            continue
        if ":" not in name:
            raise ValueError(
                f"{key}: {name!r} is neither a built-in filter ({', '.join(FILTERS)}) "
                "nor 'module:function'"
            )
        function = import_object(name, key)
        _check_filter(function, name, key)
        filters.append((name, function))
    if min_response_tokens:
        filters.append(("min_response_tokens", min_response_tokens_filter(min_response_tokens)))
    if max_response_tokens:
        filters.append(("max_response_tokens", max_response_tokens_filter(max_response_tokens)))
    return filters


def _check_filter(function: object, name: str, key: str) -> None:
    if not callable(function):
        raise ValueError(f"{key}: {name!r} is a {type(function).__name__}, not a callable")
    if inspect.iscoroutinefunction(function):
        raise ValueError(f"{key}: {name!r} is async; a filter is a plain Group -> bool function")
    try:
        inspect.signature(function).bind(None)
    except TypeError as exc:
        raise ValueError(f"{key}: {name!r} must take one argument (the Group): {exc}") from None
    except ValueError:  # a builtin without a signature: let it be
        pass
