"""The `arithmetic` task: a + b or a - b with a, b in [0, 50], "reply with only the number";
scored by `streamrl.rewards.math:math_reward`."""

from __future__ import annotations

import random
from typing import Any


def rows(rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    """a + b or a - b (never negative) with a, b in [0, 50]; the label is the result as a string."""
    out: list[dict[str, Any]] = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"What is {a} - {b}?", a - b
        out.append(
            {
                "prompt": f"{question} Reply with only the number.",
                "label": str(answer),
                "metadata": {"a": a, "b": b},
            }
        )
    return out
