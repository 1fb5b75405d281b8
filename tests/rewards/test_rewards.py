"""Answer extraction, loading, and a scorer that turns every failure into an outcome (the
math grading itself: tests/rewards/test_math_grader.py)."""

from __future__ import annotations

import math
import threading
import time

import anyio
import pytest

from streamrl.rewards import RewardInput, RewardOutcome, load_reward_fn, score
from streamrl.rewards.math import exact_match, extract_answer, math_reward, normalize_answer
from streamrl.utils import import_object


def sample(response: str, label=None) -> RewardInput:
    return RewardInput(prompt="q", response=response, label=label, metadata={})


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{3} and then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}+{b}}", "{a}+{b}"),
        ("The answer is 42. Because 6 * 7.", "42"),
        ("First 3, then... Answer: 3.5", "3.5"),
        ("the answer is **17**.", "17"),
        ("I think 12, no wait, 13", "13"),
        ("It costs 1,234 dollars", "1,234"),
        ("about -0.5 or so", "-0.5"),
        ("no numbers here", None),
        ("unbalanced \\boxed{7 and 8", "8"),
    ],
)
def test_extract_answer_prefers_boxed_then_answer_phrase_then_last_number(text, expected):
    assert extract_answer(text) == expected


def test_normalize_answer_strips_latex_wrappers_and_trailing_period():
    assert normalize_answer(" $\\left( 1, 2 \\right)$. ") == "(1,2)"


def test_exact_match_compares_stripped_text():
    assert exact_match(sample("  Paris \n", label="Paris")) == 1.0
    assert exact_match(sample("Paris.", label="Paris")) == 0.0
    assert exact_match(sample("None", label=None)) == 0.0


# ---------------------------------------------------------------- loading


def test_load_reward_fn_resolves_specs_and_names_the_config_key_on_failure():
    assert load_reward_fn("streamrl.rewards.math:math_reward") is math_reward
    assert import_object("streamrl.rewards:RewardInput.__name__", "x") == "RewardInput"
    with pytest.raises(ValueError, match=r"rollout\.reward_fn: 'nope\.mod:f': module not found"):
        load_reward_fn("nope.mod:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_reward_fn("streamrl.rewards.math:missing")
    with pytest.raises(ValueError, match="not of the form"):
        load_reward_fn("streamrl.rewards.math")
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn("streamrl.tasks.capitals:CAPITALS")


def test_reward_kwargs_are_bound_after_the_sample_and_checked_against_the_signature():
    scaled = load_reward_fn("tests.e2e_rewards:response_length", {"scale": 0.5})
    assert scaled(sample("four")) == 2.0
    with pytest.raises(ValueError, match=r"^rollout\.reward_kwargs: .* does not take \['size'\]"):
        load_reward_fn("tests.e2e_rewards:response_length", {"size": 2})
    with pytest.raises(ValueError, match=r"^eval\.datasets\[1\]\.reward_kwargs: "):
        load_reward_fn(
            "tests.e2e_rewards:vowel_fraction", {"x": 1}, key="eval.datasets[1].reward_fn"
        )


# ---------------------------------------------------------------- score


def run_score(fn, timeout_s: float = 5.0) -> RewardOutcome:
    return anyio.run(lambda: score(fn, sample("r", label=1), timeout_s=timeout_s))


def test_a_raising_function_scores_zero_with_the_exception_as_error():
    def broken(inp):
        raise KeyError("label")

    outcome = run_score(broken)
    assert (outcome.reward, outcome.metrics, outcome.error) == (0.0, {}, "KeyError: 'label'")
    assert outcome.traceback.startswith("Traceback") and "in broken" in outcome.traceback


def test_a_hanging_sync_function_times_out_without_blocking_the_event_loop():
    release = threading.Event()
    ticks = []

    def hangs(inp):
        release.wait(10)
        return 1.0

    async def main():
        async def ticker():
            for _ in range(5):
                ticks.append(time.monotonic())
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            start = time.monotonic()
            outcome = await score(hangs, sample("r"), timeout_s=0.3)
            return outcome, time.monotonic() - start

    try:
        outcome, elapsed_s = anyio.run(main)
    finally:
        release.set()  # let the abandoned worker thread finish
    assert outcome.reward == 0.0 and outcome.error == "timeout after 0.3 s"
    assert elapsed_s < 1.5
    assert len(ticks) == 5  # the loop kept running while the function hung


def test_a_hanging_async_function_times_out():
    async def hangs(inp):
        await anyio.sleep(10)

    assert run_score(hangs, timeout_s=0.1).error == "timeout after 0.1 s"


def test_async_functions_and_dict_returns_are_supported():
    async def graded(inp):
        await anyio.sleep(0)
        return {"reward": 0.5, "format": 1, "correct": 0.0}

    outcome = run_score(graded)
    assert outcome == RewardOutcome(reward=0.5, metrics={"format": 1.0, "correct": 0.0})
    assert run_score(lambda inp: True).reward == 1.0
    assert run_score(lambda inp: 2).reward == 2.0


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (math.nan, "non-finite"),
        (math.inf, "non-finite"),
        ("1.0", "non-numeric"),
        (None, "non-numeric"),
        ({"score": 1.0}, "without a 'reward' key"),
        ({"reward": 1.0, "format": "yes"}, "metric 'format'"),
        ({"reward": math.nan}, "non-finite"),
    ],
)
def test_bad_return_values_are_errors_with_zero_reward(value, fragment):
    outcome = run_score(lambda inp: value)
    assert outcome.reward == 0.0
    assert outcome.error is not None and fragment in outcome.error
