"""The `multistep` task: a ± b ± c with a, b, c in [1, 20], "reply with only the number";
scored by `streamrl.rewards.math:math_reward`.

Hard enough that SmolLM2-135M-Instruct does not saturate it in a short run: on 24 rows it
answered 0 of 24 greedily and 12 of 96 samples (12.5%) at temperature 1.0 (its greedy answer
to two-operand sums is usually right). The staleness benchmark uses it for that
(`configs/gpu/staleness_multistep.toml`)."""

from __future__ import annotations

import random
from typing import Any


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
