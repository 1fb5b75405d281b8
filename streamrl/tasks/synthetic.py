"""Synthetic text rewards for models that know nothing yet (random initialisation: tests,
benchmarks).

They measure a property of what is generated, so a policy can learn them from
scratch; they say nothing about language ability. `rollout.reward_fn` names one of
`vowel_fraction` (dense) and `starts_with_vowel` (sparse: a random model starts near
the vowel share of its first tokens and learns it in a few dozen steps).

Rewards read from tokens and logprobs instead of text (`confidence`, `repeat`,
`token_mod`) come with their generate function, `streamrl.agents.synthetic`.
"""

from __future__ import annotations

from streamrl.rewards import RewardInput

VOWELS = "aeiou"


def vowel_fraction(inp: RewardInput) -> float:
    """Fraction of the response's letters that are vowels (a weak, dense signal)."""
    letters = [c for c in inp.response.lower() if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in VOWELS for c in letters) / len(letters)


def starts_with_vowel(inp: RewardInput) -> float:
    """1 if the first letter of the response is a vowel, else 0 (a sparse, sharp signal:
    a random model starts near the vowel share of its first tokens and learns it in a few
    dozen steps)."""
    for character in inp.response.lower():
        if character.isalpha():
            return 1.0 if character in VOWELS else 0.0
    return 0.0
