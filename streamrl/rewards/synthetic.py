"""Synthetic rewards for models that know nothing yet (random initialisation, benchmarks).

They measure a property of the generated text, so a policy can learn them
from scratch; they say nothing about language ability. Used by the tests'
tiny models and by the GPU benchmarks, where no pretrained model exists.
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
