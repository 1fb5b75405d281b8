"""A user group filter for end-to-end tests (`buffer.filters = ["tests.e2e_filters:..."]`)."""

from __future__ import annotations

from streamrl.types import Group


def drop_odd_prompts(group: Group) -> bool:
    """Keep the groups of even prompt seqs: half of all groups are dropped."""
    return group.prompt_seq % 2 == 0


not_callable = 3


def needs_two(group: Group, other: Group) -> bool:
    return True


async def is_async(group: Group) -> bool:
    return True
