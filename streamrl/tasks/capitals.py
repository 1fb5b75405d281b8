"""The `capitals` task: name the capital city of a well-known country (the quickstart task).

docs/quickstart-task.md records why: it is the candidate SmolLM2-135M-Instruct
partly knows (about a third of samples right at temperature 1.0), and a few
small policy-gradient steps raise that. Its reward is `capital_reward`.
"""

from __future__ import annotations

import random
import re
import unicodedata
from typing import Any

from streamrl.rewards import RewardInput

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


def rows(rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    """Countries in shuffled rounds (each appears once per round), phrasing drawn per row."""
    countries = sorted(CAPITALS)
    out: list[dict[str, Any]] = []
    while len(out) < num_rows:
        rng.shuffle(countries)
        for country in countries[: num_rows - len(out)]:
            question = rng.choice(_CAPITAL_QUESTIONS).format(country=country)
            out.append(
                {"prompt": question, "label": CAPITALS[country], "metadata": {"country": country}}
            )
    return out


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
