"""Guess the number: a multi-step text environment whose episodes last a dozen turns.

The model looks for a secret integer in [low, high] (default [1, 1000]:
binary search needs up to 10 guesses, 9 on average) with `max_guesses` tries
(default 10), so every episode that does not find the number lasts 10 turns. After each guess the environment answers "Higher" or "Lower"
and restates the interval that is still possible, so each turn can be decided
from the last observation alone.

Reward (per episode, the sum of step rewards, in [0, 1 + find_bonus]): every
guess earns a credit in [0, 1], divided by `max_guesses`:

    no number in the reply                                  0
    a number                                                format_credit (0.2)
      ... inside the possible interval and not a repeat     + range_credit (0.4)
      ... and close to the interval's middle                + middle_credit (0.4) * (1 - |g - mid| / half)

Finding the number earns 1 for that guess and for every guess left unused,
plus `find_bonus`. So a model that only writes numbers starts above zero,
one that stays inside the interval gets about half, and binary search gets
everything; each step of that ladder is a gradient GRPO can follow.

Rows: `make_rows(seed, n)`, or `python -m streamrl.agents.examples.guess_number OUT.jsonl`;
the label is the secret, the metadata holds low, high and max_guesses.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from typing import Any

from streamrl.agents.env import StepResult
from streamrl.types import Prompt

_INTEGER = re.compile(r"-?\d+")
_ONLY_A_NUMBER = re.compile(r"^\W*-?\d+\W*$")

PROMPT = (
    "I am thinking of a whole number from {low} to {high}. You have {max_guesses} guesses. "
    "After each guess I say whether my number is higher or lower. "
    "Reply with only your guess, a single number."
)


class GuessNumber:
    """The environment; the secret and the range come from the prompt's label and metadata."""

    def __init__(
        self,
        *,
        format_credit: float = 0.2,
        range_credit: float = 0.4,
        middle_credit: float = 0.4,
        find_bonus: float = 0.5,
    ) -> None:
        self.format_credit = format_credit
        self.range_credit = range_credit
        self.middle_credit = middle_credit
        self.find_bonus = find_bonus
        self.secret = self.low = self.high = self.max_guesses = 0
        self.num_turns = 0
        self.guesses: list[int] = []

    async def reset(self, prompt: Prompt) -> str:
        metadata = prompt.metadata
        self.secret = int(prompt.label)
        self.low, self.high = int(metadata.get("low", 1)), int(metadata.get("high", 1000))
        self.max_guesses = int(metadata.get("max_guesses", 10))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} outside [{self.low}, {self.high}]")
        self.num_turns, self.guesses = 0, []
        return prompt.text

    async def step(self, action: str) -> StepResult:
        match = _INTEGER.search(action)
        guess = int(match.group()) if match else None
        credit = self.credit(guess, action)
        self.num_turns += 1
        turns_left = self.max_guesses - self.num_turns
        if guess is not None:
            self.guesses.append(guess)
        info = {"turns": self.num_turns, "low": self.low, "high": self.high}
        if guess == self.secret:
            reward = (1.0 + turns_left) / self.max_guesses + self.find_bonus
            return StepResult("Correct!", reward, done=True, info={**info, "found": True})
        if guess is None:
            feedback = f"Reply with one number from {self.low} to {self.high}."
        elif guess < self.secret:
            self.low = max(self.low, guess + 1)
            feedback = f"Higher. From {self.low} to {self.high}."
        else:
            self.high = min(self.high, guess - 1)
            feedback = f"Lower. From {self.low} to {self.high}."
        done = turns_left <= 0
        return StepResult(feedback, credit / self.max_guesses, done, {**info, "found": False})

    def credit(self, guess: int | None, action: str) -> float:
        """The per-guess credit in [0, 1] (before this guess updates the interval)."""
        if guess is None:
            return 0.0
        credit = (
            self.format_credit if _ONLY_A_NUMBER.match(action.strip()) else self.format_credit / 2
        )
        if not self.low <= guess <= self.high or guess in self.guesses:
            return credit
        middle = (self.low + self.high) / 2
        half = max((self.high - self.low) / 2, 1.0)
        return credit + self.range_credit + self.middle_credit * (1 - abs(guess - middle) / half)


def make_rows(
    seed: int, num_rows: int, *, low: int = 1, high: int = 1000, max_guesses: int = 10
) -> list[dict[str, Any]]:
    """Deterministic rows: one secret per row, drawn uniformly from [low, high]."""
    rng = random.Random(f"guess_number/{seed}")
    prompt = PROMPT.format(low=low, high=high, max_guesses=max_guesses)
    return [
        {
            "prompt": prompt,
            "label": rng.randint(low, high),
            "metadata": {"low": low, "high": high, "max_guesses": max_guesses},
        }
        for _ in range(num_rows)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write guess-the-number rows as JSONL.")
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=1000)
    parser.add_argument("--max-guesses", type=int, default=10)
    args = parser.parse_args(argv)
    rows = make_rows(args.seed, args.n, low=args.low, high=args.high, max_guesses=args.max_guesses)
    with open(args.out, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
