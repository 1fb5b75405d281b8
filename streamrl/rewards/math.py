"""Math-answer verifiers: pull the final answer out of a response and compare it.

`math_reward` is the default `rollout.reward_fn`. Equivalence is deliberately
simple and predictable: exact rational equality of numbers (integers,
decimals, fractions, thousands separators, `\\frac{a}{b}`), otherwise equality
of normalised strings. It does not prove symbolic equivalence.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from streamrl.rewards import RewardInput

_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(?P<rest>[^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def extract_answer(text: str) -> str | None:
    """The final answer in `text`, or None when there is none.

    In order of preference: the content of the last `\\boxed{...}` (nested
    braces allowed); the phrase after the last "answer is" / "Answer:" (up to
    the end of its line or sentence); the last number in the text.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        rest = matches[-1].group("rest")
        rest = re.split(r"\.\s", rest, maxsplit=1)[0]  # first sentence; keeps "3.5"
        rest = rest.strip(" \t*").rstrip(".").strip(" \t*")
        if rest:
            return rest
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}`, matching nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: treat as no box


def normalize_answer(text: str) -> str:
    """Canonical string form of an answer: LaTeX wrappers, `$`, spaces and a final "." removed."""
    s = text.strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    while True:
        unwrapped = _TEXT.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = s.replace("$", "").replace("\\%", "%")
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\s+", "", s)
    return s.lower()


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact rational (integer, decimal, a/b, \\frac{a}{b}, 1,234, 50%), else None.

    A trailing "%" is dropped, so "50%" equals 50 (the MATH convention), not 0.5.
    """
    s = normalize_answer(text)
    s = _FRAC.sub(r"\1/\2", s).removesuffix("%")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    numerator, slash, denominator = s.partition("/")
    try:
        value = Fraction(numerator)
        if slash:
            value /= Fraction(denominator)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def is_equivalent(pred: str | None, label: Any) -> bool:
    """Whether a predicted answer matches the label: equal numbers, else equal normalised strings."""
    if pred is None or label is None:
        return False
    label_text = str(label)
    pred_number, label_number = parse_number(pred), parse_number(label_text)
    if pred_number is not None and label_number is not None:
        return pred_number == label_number
    return normalize_answer(pred) == normalize_answer(label_text)


def math_reward(inp: RewardInput) -> float:
    """1.0 if the response's final answer (see `extract_answer`) equals the label, else 0.0."""
    return 1.0 if is_equivalent(extract_answer(inp.response), inp.label) else 0.0


def exact_match(inp: RewardInput) -> float:
    """1.0 if the stripped response equals the stripped `str(label)`, else 0.0."""
    if inp.label is None:
        return 0.0
    return 1.0 if inp.response.strip() == str(inp.label).strip() else 0.0
