"""Built-in tasks: small prompt sets with verifiable answers, generated from a seed.

`data.path = "builtin:<name>"` (optionally `builtin:<name>?n=500&seed=1`)
reads one of these through `streamrl.data.source.PromptSource`. Generation is
deterministic: the same (name, seed, n) gives the same rows on every machine
and Python version. The generation seed is the `seed` query parameter
(default 0), independent of `train.seed`, which only shuffles the order.

| task | what it asks | default reward |
| --- | --- | --- |
| `capitals` (`streamrl.tasks.capitals`) | the capital city of a well-known country (the quickstart task) | `streamrl.tasks.capitals:capital_reward` |
| `world_capitals` (`streamrl.tasks.capitals`) | the capital of one of 138 countries, most less well known (the staleness benchmark's task) | `streamrl.tasks.capitals:capital_reward` |
| `arithmetic` (`streamrl.tasks.arithmetic`) | a + b or a - b with a, b in [0, 50], "reply with only the number" | `streamrl.rewards.math:math_reward` |
| `multistep` (`streamrl.tasks.multistep`) | a ± b ± c with a, b, c in [1, 20] (SmolLM2-135M: 0 of 24 greedily) | `streamrl.tasks.multistep:number_reward` (the last number is the result) |

One module per task holds its row generator (`rows(rng, num_rows)`) and, where
the task has its own, its reward. `streamrl.tasks.synthetic` holds the rewards
for random models (benchmarks and tests), which have no data of their own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamrl.tasks import arithmetic, capitals, multistep

Row = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """A generator of rows {"prompt", "label", "metadata"} plus its default reward."""

    name: str
    description: str
    """One line for `streamrl tasks` listings and docs."""
    reward_fn: str
    """Default `rollout.reward_fn` spec, `module:function`."""
    make_rows: Callable[[random.Random, int], list[Row]]
    default_num_rows: int = 500

    def rows(self, seed: int, num_rows: int) -> list[Row]:
        """`num_rows` rows generated deterministically from (task name, seed)."""
        if num_rows <= 0:
            raise ValueError(f"builtin:{self.name}: n must be > 0, got {num_rows}")
        return self.make_rows(random.Random(f"{self.name}/{seed}"), num_rows)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="capitals",
            description="Name the capital of a well-known country (quickstart).",
            reward_fn="streamrl.tasks.capitals:capital_reward",
            make_rows=capitals.rows,
        ),
        Task(
            name="world_capitals",
            description="Name the capital of one of 138 countries, most less well known.",
            reward_fn="streamrl.tasks.capitals:capital_reward",
            make_rows=capitals.world_rows,
        ),
        Task(
            name="arithmetic",
            description="Add or subtract two numbers in [0, 50]; answer with the number.",
            reward_fn="streamrl.rewards.math:math_reward",
            make_rows=arithmetic.rows,
        ),
        Task(
            name="multistep",
            description="Add and subtract three numbers in [1, 20]; answer with the number.",
            reward_fn="streamrl.tasks.multistep:number_reward",
            make_rows=multistep.rows,
        ),
    )
}


def get_task(name: str) -> Task:
    """The registered task called `name`; KeyError naming the known ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no builtin task {name!r}; known: {', '.join(sorted(TASKS))}") from None
