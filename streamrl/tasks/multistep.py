"""The `multistep` task: a ± b ± c with a, b, c in [1, 20], "reply with only the number";
scored by `number_reward`: the last number of the response must be the result.

Not `streamrl.rewards.math:math_reward`: math-verify evaluates an expression it parses, so a
response that only repeats the question ("17 - 14 - 18") grades as right. SmolLM2-135M
learned exactly that within 40 steps on an H200 (reward 0.999 at every eta). Here the
answer has to be the number itself.

The staleness benchmark uses this task (`configs/gpu/staleness_multistep.toml`) because
SmolLM2-135M-Instruct does not solve it outright: it answered 0 of 24 rows greedily. It
turned out too hard to learn from: 0.027 of samples right at temperature 1.0 and 0.04 of
greedy answers after 40 steps on an H200 (bench/results/gpu/staleness_multistep/). Two-operand
sums in [0, 50] are not much easier for it under this reward (5 of 32 greedily, 4 of 128
samples at temperature 1.0, on the CPU); the staleness benchmark now uses `world_capitals`."""

from __future__ import annotations

import random
import re
from typing import Any

from streamrl.rewards import RewardInput

_NUMBER = re.compile(r"-?\d+")


def rows(rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    """Three numbers in [1, 20] joined by + or -; the label is the (possibly negative) result."""
    out: list[dict[str, Any]] = []
    for _ in range(num_rows):
        numbers = [rng.randint(1, 20) for _ in range(3)]
        signs = [rng.choice((1, -1)) for _ in range(2)]
        answer = numbers[0] + signs[0] * numbers[1] + signs[1] * numbers[2]
        terms = " ".join(
            f"{'+' if sign > 0 else '-'} {number}"
            for sign, number in zip(signs, numbers[1:], strict=True)
        )
        out.append(
            {
                "prompt": f"What is {numbers[0]} {terms}? Reply with only the number.",
                "label": str(answer),
                "metadata": {"numbers": numbers, "signs": signs},
            }
        )
    return out


def number_reward(inp: RewardInput) -> float:
    """1.0 if the last integer in the response (a leading minus sign included) is the label."""
    numbers = _NUMBER.findall(inp.response.replace(",", ""))
    return 1.0 if numbers and inp.label is not None and numbers[-1] == str(inp.label) else 0.0
