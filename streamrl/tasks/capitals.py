"""The `capitals` task: name the capital city of a well-known country (the quickstart task),
and `world_capitals`: the same question over 138 countries, most of them less well known.

docs/quickstart-task.md records why `capitals`: it is the candidate SmolLM2-135M-Instruct
partly knows (about a third of samples right at temperature 1.0), and a few small
policy-gradient steps raise that, to about 0.98 within 20 steps on an H200. That saturation
is why `world_capitals` exists: the staleness benchmark needs a task the model is still
learning after 40 steps. Both are scored by `capital_reward`.
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

MORE_CAPITALS = {
    "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Tanzania": "Dodoma",
    "Uganda": "Kampala", "Rwanda": "Kigali", "Senegal": "Dakar", "Mali": "Bamako",
    "Niger": "Niamey", "Sudan": "Khartoum", "Libya": "Tripoli", "Zimbabwe": "Harare",
    "Zambia": "Lusaka", "Mozambique": "Maputo", "Angola": "Luanda", "Namibia": "Windhoek",
    "Botswana": "Gaborone", "Madagascar": "Antananarivo", "Cameroon": "Yaounde",
    "Gabon": "Libreville", "Burkina Faso": "Ouagadougou", "Guinea": "Conakry",
    "Sierra Leone": "Freetown", "Liberia": "Monrovia", "Malawi": "Lilongwe",
    "Somalia": "Mogadishu", "Eritrea": "Asmara", "Mauritania": "Nouakchott", "Togo": "Lome",
    "the Democratic Republic of the Congo": "Kinshasa", "the Republic of the Congo": "Brazzaville",
    "South Sudan": "Juba", "Lesotho": "Maseru", "India": "New Delhi", "Bangladesh": "Dhaka",
    "Nepal": "Kathmandu", "Cambodia": "Phnom Penh", "Laos": "Vientiane",
    "Malaysia": "Kuala Lumpur", "Kazakhstan": "Astana", "Uzbekistan": "Tashkent",
    "Kyrgyzstan": "Bishkek", "Tajikistan": "Dushanbe", "Turkmenistan": "Ashgabat",
    "Azerbaijan": "Baku", "Armenia": "Yerevan", "Georgia": "Tbilisi", "Jordan": "Amman",
    "Qatar": "Doha", "Oman": "Muscat", "the United Arab Emirates": "Abu Dhabi",
    "Bahrain": "Manama", "North Korea": "Pyongyang", "Bhutan": "Thimphu", "Belarus": "Minsk",
    "Lithuania": "Vilnius", "Latvia": "Riga", "Estonia": "Tallinn", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Croatia": "Zagreb", "Serbia": "Belgrade",
    "Bosnia and Herzegovina": "Sarajevo", "Montenegro": "Podgorica",
    "North Macedonia": "Skopje", "Albania": "Tirana", "Moldova": "Chisinau", "Malta": "Valletta",
    "Cyprus": "Nicosia", "Brazil": "Brasilia", "Colombia": "Bogota", "Ecuador": "Quito",
    "Paraguay": "Asuncion", "Uruguay": "Montevideo", "Jamaica": "Kingston",
    "Haiti": "Port-au-Prince", "the Dominican Republic": "Santo Domingo",
    "Honduras": "Tegucigalpa", "Nicaragua": "Managua", "Costa Rica": "San Jose",
    "Guyana": "Georgetown", "Suriname": "Paramaribo", "Trinidad and Tobago": "Port of Spain",
    "the Bahamas": "Nassau", "Barbados": "Bridgetown", "Fiji": "Suva",
    "Papua New Guinea": "Port Moresby", "Samoa": "Apia",
}  # fmt: skip
"""`world_capitals`' countries beyond `CAPITALS`, chosen by the same rule (a capital named unlike
the country, one capital, one usual spelling up to accents): no Bolivia, Sri Lanka or South
Africa (more than one capital), no Ukraine or Myanmar (spellings differ)."""

WORLD_CAPITALS = CAPITALS | MORE_CAPITALS

_CAPITAL_QUESTIONS = (
    "What is the capital of {country}?",
    "What is the capital city of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital of {country}.",
)


def rows(rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    """`CAPITALS`' countries in shuffled rounds (each once per round), phrasing drawn per row."""
    return _rows(CAPITALS, rng, num_rows)


def world_rows(rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    """`rows` over `WORLD_CAPITALS`."""
    return _rows(WORLD_CAPITALS, rng, num_rows)


def _rows(capitals: dict[str, str], rng: random.Random, num_rows: int) -> list[dict[str, Any]]:
    countries = sorted(capitals)
    out: list[dict[str, Any]] = []
    while len(out) < num_rows:
        rng.shuffle(countries)
        for country in countries[: num_rows - len(out)]:
            question = rng.choice(_CAPITAL_QUESTIONS).format(country=country)
            out.append(
                {"prompt": question, "label": capitals[country], "metadata": {"country": country}}
            )
    return out


def _fold(text: str) -> str:
    """Lower case without accents, so "Reykjavík" matches "reykjavik"."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).lower()


_CAPITAL_PATTERNS = {
    city: re.compile(rf"\b{re.escape(_fold(city))}\b") for city in WORLD_CAPITALS.values()
}


def names_city(text: str, city: str) -> bool:
    """Whether `text` names `city` as a whole word (case and accents ignored)."""
    pattern = _CAPITAL_PATTERNS.get(city) or re.compile(rf"\b{re.escape(_fold(city))}\b")
    return bool(pattern.search(_fold(text)))


def capital_reward(inp: RewardInput) -> float:
    """1.0 if the response names the label's city and no other capital of `WORLD_CAPITALS`.

    Naming a second capital scores 0, so listing cities cannot earn reward.
    """
    if not isinstance(inp.label, str) or not names_city(inp.response, inp.label):
        return 0.0
    folded = _fold(inp.response)
    for city, pattern in _CAPITAL_PATTERNS.items():
        if city != inp.label and pattern.search(folded):
            return 0.0
    return 1.0
