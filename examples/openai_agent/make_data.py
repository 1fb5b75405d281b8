"""Two-digit multiplication questions for the agent examples (deterministic).

    python examples/openai_agent/make_data.py examples/openai_agent/data/train.jsonl --n 200

SmolLM2-135M cannot multiply two-digit numbers in its head; with the Python tool it can.
Each row: {"prompt": "What is 47 * 86?", "label": "4042"}.
"""

from __future__ import annotations

import argparse
import json
import random


def rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        out.append({"prompt": f"What is {a} * {b}?", "label": str(a * b)})
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w") as handle:
        for row in rows(args.seed, args.n):
            handle.write(json.dumps(row) + "\n")
