"""Reward functions for end-to-end tests on tiny random models (importable by child processes)."""

from __future__ import annotations

from streamrl.rewards import RewardInput


def vowel_fraction(inp: RewardInput) -> float:
    """Fraction of the response's letters that are vowels: varies between samples of a random
    model, so groups have reward variance, and a policy can raise it."""
    letters = [c for c in inp.response.lower() if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in "aeiou" for c in letters) / len(letters)


def always_raises(inp: RewardInput) -> float:
    raise RuntimeError("this reward function always fails")


def response_length(inp: RewardInput, *, scale: float = 1.0) -> float:
    """`scale` times the response's length in characters (a reward with `reward_kwargs`)."""
    return scale * len(inp.response)


def constant(inp: RewardInput) -> float:
    """The same reward for every sample: every group has zero variance."""
    return 0.0
