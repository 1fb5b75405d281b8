"""Built-in tasks: deterministic rows and rewards that measure what they claim."""

from __future__ import annotations

import pytest

from streamrl.rewards import RewardInput, load_reward_fn
from streamrl.rewards.math import grade
from streamrl.tasks import TASKS, get_task
from streamrl.tasks.capitals import CAPITALS, MORE_CAPITALS, WORLD_CAPITALS, capital_reward


def scored(fn, response: str, label) -> float:
    return fn(RewardInput(prompt="q", response=response, label=label, metadata={}))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_are_deterministic_per_seed_and_well_formed(name):
    task = get_task(name)
    rows = task.rows(0, 120)
    assert rows == task.rows(0, 120)
    assert rows != task.rows(1, 120)
    assert task.rows(0, 30) == rows[:30]
    assert len(rows) == 120
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"]
        assert isinstance(row["label"], str) and row["label"]
        assert isinstance(row["metadata"], dict)
    assert callable(load_reward_fn(task.reward_fn))
    assert task.description


def test_capitals_cover_every_country_once_per_round():
    rows = get_task("capitals").rows(3, 2 * len(CAPITALS))
    first_round = [row["metadata"]["country"] for row in rows[: len(CAPITALS)]]
    assert sorted(first_round) == sorted(CAPITALS)
    assert all(CAPITALS[row["metadata"]["country"]] == row["label"] for row in rows)


def test_world_capitals_cover_both_tables_once_per_round_with_one_city_each():
    assert not set(CAPITALS) & set(MORE_CAPITALS)
    assert len(set(WORLD_CAPITALS.values())) == len(WORLD_CAPITALS) == 138
    rows = get_task("world_capitals").rows(0, len(WORLD_CAPITALS))
    assert sorted(row["metadata"]["country"] for row in rows) == sorted(WORLD_CAPITALS)
    assert all(WORLD_CAPITALS[row["metadata"]["country"]] == row["label"] for row in rows)
    # A country's name never names a capital (else the question would give it away), and
    # no capital's name holds another's (else naming one would count as naming both).
    for country, city in WORLD_CAPITALS.items():
        assert scored(capital_reward, f"It is {country}.", city) == 0.0, country
        assert scored(capital_reward, city, city) == 1.0, city


def test_naming_a_second_capital_from_either_table_scores_nothing():
    assert scored(capital_reward, "Abuja", "Abuja") == 1.0
    assert scored(capital_reward, "Abuja, or maybe Accra", "Abuja") == 0.0
    assert scored(capital_reward, "Oslo or Bishkek", "Oslo") == 0.0


def test_unknown_tasks_and_bad_sizes_are_errors():
    with pytest.raises(KeyError, match="known: arithmetic, capitals, multistep, world_capitals"):
        get_task("nope")
    with pytest.raises(ValueError, match="n must be > 0"):
        get_task("capitals").rows(0, 0)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("The capital of Norway is Oslo.", 1.0),
        ("Oslo", 1.0),
        ("OSLO, of course", 1.0),
        ("The capital of Norway is Bergen.", 0.0),  # right format, wrong answer
        ("Oslo or Stockholm, I am not sure.", 0.0),  # hedging across capitals
        ("Osloville is lovely", 0.0),  # not the word
        ("", 0.0),
    ],
)
def test_capital_reward(response, expected):
    assert scored(capital_reward, response, "Oslo") == expected


def test_capital_reward_ignores_accents_and_case():
    assert scored(capital_reward, "It is Reykjavík.", "Reykjavik") == 1.0
    assert scored(capital_reward, "Mexico City is the capital.", "Mexico City") == 1.0
    assert scored(capital_reward, "It is Mexico.", "Mexico City") == 0.0
    assert scored(capital_reward, "Paris", None) == 0.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("39", 1.0),
        ("27 + 12 = 39", 1.0),
        ("The answer is 39.", 1.0),
        ("The answer is 38.", 0.0),  # right format, wrong answer
        ("Let me think about numbers.", 0.0),  # no answer at all
    ],
)
def test_arithmetic_rows_are_scored_by_math_reward(response, expected):
    task = get_task("arithmetic")
    assert task.reward_fn == "streamrl.rewards.math:math_reward"
    assert grade("39", response) is bool(expected)  # what math_reward runs in its process


def test_arithmetic_labels_are_the_correct_results():
    for row in get_task("arithmetic").rows(0, 200):
        question = row["prompt"].removeprefix("What is ").split("?")[0]
        a, op, b = question.split()
        assert int(row["label"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_multistep_labels_are_the_results_of_their_expressions_and_negative_ones_grade():
    rows = get_task("multistep").rows(0, 300)
    for row in rows:
        first, op1, second, op2, third = (
            row["prompt"].removeprefix("What is ").split("?")[0].split()
        )
        value = int(first) + (1 if op1 == "+" else -1) * int(second)
        value += (1 if op2 == "+" else -1) * int(third)
        assert int(row["label"]) == value
        assert all(1 <= n <= 20 for n in row["metadata"]["numbers"])
    negative = next(row for row in rows if int(row["label"]) < 0)
    assert grade(negative["label"], f"The answer is {negative['label']}.")
    assert not grade(negative["label"], f"The answer is {negative['label'].lstrip('-')}.")
