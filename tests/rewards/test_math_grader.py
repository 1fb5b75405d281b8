"""The math grader on math-verify: the documented table, the earlier grader's pairs, and
grading in worker processes (math-verify's signal-based time limits need a main thread)."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest

from streamrl.rewards import RewardInput, score
from streamrl.rewards.math import grade, in_grader_process, math_reward

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def load_table_script():
    path = ROOT / "bench" / "cpu" / "math_grader_table.py"
    spec = importlib.util.spec_from_file_location("math_grader_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = load_table_script()


@pytest.mark.parametrize("case", TABLE.CASES, ids=lambda case: case.kind)
def test_every_pair_of_the_documented_table_gets_its_expected_grade(case):
    assert grade(case.label, case.response) is case.expected


def test_docs_rewards_md_holds_the_table_the_script_makes():
    page = (ROOT / "docs" / "rewards.md").read_text()
    assert TABLE.page_section(page) == TABLE.section(), (
        "run: python bench/cpu/math_grader_table.py --write"
    )


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        (42, r"\boxed{42}", True),
        ("42", "42.0", True),
        ("0.5", "1/2", True),
        ("1/2", r"\frac{1}{2}", True),
        (0.75, r"\boxed{\dfrac{3}{4}}", True),
        ("-0.5", r"\boxed{-\frac{1}{2}}", True),
        (1234, "It costs 1,234 dollars", True),
        ("5", "The answer is $5.", True),
        ("7", "So it is 7.", True),
        ("paris", r"\boxed{\text{Paris}}", True),
        ("x+1", r"\boxed{ x + 1 }", True),
        (42, r"\boxed{41}", False),
        ("0.33", r"\boxed{1/3}", False),
        ("1234", r"\boxed{12,34}", False),
        ("rome", "Paris", False),
        (None, r"\boxed{1}", False),
        (12, r"Adding them gives \boxed{12}.", True),
        ("12", "7 + 5 = 12", True),
        ("12", "The answer is 13.", False),
    ],
)
def test_the_earlier_graders_pairs_keep_their_grades(label, response, expected):
    assert grade(label, response) is expected


def test_grade_works_in_a_worker_thread_where_math_verify_signals_cannot():
    """math-verify's default time limits call signal.alarm, which raises off the main thread."""
    results = []
    thread = threading.Thread(target=lambda: results.append(grade("2^{10}", r"\boxed{1024}")))
    thread.start()
    thread.join()
    assert results == [True]


async def test_math_reward_scores_the_slime_seed_row_in_a_worker_process():
    row = RewardInput(prompt="Solve: 3x = 12", response=r"So \boxed{4}.", label="x = 4")
    assert await math_reward(row) == 1.0
    wrong = RewardInput(prompt="Solve: 3x = 12", response=r"\boxed{3}", label="x = 4")
    outcome = await score(math_reward, wrong, timeout_s=60)
    assert (outcome.reward, outcome.error) == (0.0, None)


async def test_a_grade_past_its_deadline_kills_the_worker_process():
    pid = await in_grader_process(os.getpid)  # the worker the next call reuses
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="over 1 s"):
        await in_grader_process(time.sleep, 120, timeout_s=1)  # hangs like sympy can
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
    assert await in_grader_process(os.getpid) != pid  # the next call starts a new one
