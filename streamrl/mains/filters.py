"""`buffer.filters` and the length bounds as the buffer's (name, filter) list.

The built-in filters live with the buffer (`streamrl.queues.filters`); a `module:function`
entry is user code, imported here, by the trainer, so that the queues import nothing but
the wire types.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from streamrl.queues.filters import (
    FILTERS,
    NamedFilter,
    max_response_tokens_filter,
    min_response_tokens_filter,
)
from streamrl.utils import import_object


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
