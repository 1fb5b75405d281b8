"""Built-in tasks: small prompt sets with verifiable answers, generated from a seed.

`data.path = "builtin:<name>"` (optionally `builtin:<name>?n=500&seed=1`)
reads one of these through `streamrl.data.PromptSource`. Generation is
deterministic: the same (name, seed, n) gives the same rows on every machine
and Python version. The generation seed is the `seed` query parameter
(default 0), independent of `train.seed`, which only shuffles the order.

| task | what it asks | default reward |
| --- | --- | --- |
| `capitals` | the capital city of a well-known country (the quickstart task) | `streamrl.tasks:capital_reward` |
| `arithmetic` | a + b or a - b with a, b in [0, 50], "reply with only the number" | `streamrl.rewards.math:math_reward` |

docs/quickstart-task.md records why `capitals` is the quickstart task: it is
the candidate SmolLM2-135M-Instruct partly knows (about a third of samples
right at temperature 1.0), and a few small policy-gradient steps raise that.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamrl.rewards import RewardInput

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


# ---------------------------------------------------------------- capitals

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "Canada": "Ottawa", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Austria": "Vienna",
    "the United Kingdom": "London", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Thailand": "Bangkok", "South Korea": "Seoul",
    "Kenya": "Nairobi", "Turkey": "Ankara", "the Netherlands": "Amsterdam",
    "Belgium": "Brussels", "Denmark": "Copenhagen", "Finland": "Helsinki",
    "Hungary": "Budapest", "the Czech Republic": "Prague", "Cuba": "Havana",
    "Iran": "Tehran", "Iraq": "Baghdad", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
    "the Philippines": "Manila", "Venezuela": "Caracas", "Morocco": "Rabat",
    "Australia": "Canberra", "New Zealand": "Wellington", "Switzerland": "Bern",
    "Romania": "Bucharest", "Bulgaria": "Sofia", "Saudi Arabia": "Riyadh",
    "Pakistan": "Islamabad", "Afghanistan": "Kabul", "Syria": "Damascus",
    "Lebanon": "Beirut", "Iceland": "Reykjavik",
}  # fmt: skip
"""Countries whose capital is named unlike the country and spelt one way (the constitutional
capital: Amsterdam, not The Hague; Bern is the federal city)."""

_CAPITAL_QUESTIONS = (
    "What is the capital of {country}?",
    "What is the capital city of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital of {country}.",
)


def _capital_rows(rng: random.Random, num_rows: int) -> list[Row]:
    """Countries in shuffled rounds (each appears once per round), phrasing drawn per row."""
    countries = sorted(CAPITALS)
    rows: list[Row] = []
    while len(rows) < num_rows:
        rng.shuffle(countries)
        for country in countries[: num_rows - len(rows)]:
            question = rng.choice(_CAPITAL_QUESTIONS).format(country=country)
            rows.append(
                {"prompt": question, "label": CAPITALS[country], "metadata": {"country": country}}
            )
    return rows


def _fold(text: str) -> str:
    """Lower case without accents, so "Reykjavík" matches "reykjavik"."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).lower()


_CAPITAL_PATTERNS = {
    city: re.compile(rf"\b{re.escape(_fold(city))}\b") for city in CAPITALS.values()
}


def names_city(text: str, city: str) -> bool:
    """Whether `text` names `city` as a whole word (case and accents ignored)."""
    pattern = _CAPITAL_PATTERNS.get(city) or re.compile(rf"\b{re.escape(_fold(city))}\b")
    return bool(pattern.search(_fold(text)))


def capital_reward(inp: RewardInput) -> float:
    """1.0 if the response names the label's city and no other capital in the table, else 0.0.

    Naming a second capital scores 0, so listing cities cannot earn reward.
    """
    if not isinstance(inp.label, str) or not names_city(inp.response, inp.label):
        return 0.0
    folded = _fold(inp.response)
    for city, pattern in _CAPITAL_PATTERNS.items():
        if city != inp.label and pattern.search(folded):
            return 0.0
    return 1.0


# ---------------------------------------------------------------- arithmetic


def _arithmetic_rows(rng: random.Random, num_rows: int) -> list[Row]:
    """a + b or a - b (never negative) with a, b in [0, 50]; the label is the result as a string."""
    rows: list[Row] = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"What is {a} - {b}?", a - b
        rows.append(
            {
                "prompt": f"{question} Reply with only the number.",
                "label": str(answer),
                "metadata": {"a": a, "b": b},
            }
        )
    return rows


# ---------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="capitals",
            description="Name the capital of a well-known country (quickstart).",
            reward_fn="streamrl.tasks:capital_reward",
            make_rows=_capital_rows,
        ),
        Task(
            name="arithmetic",
            description="Add or subtract two numbers in [0, 50]; answer with the number.",
            reward_fn="streamrl.rewards.math:math_reward",
            make_rows=_arithmetic_rows,
        ),
    )
}


def get_task(name: str) -> Task:
    """The registered task called `name`; KeyError naming the known ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no builtin task {name!r}; known: {', '.join(sorted(TASKS))}") from None
