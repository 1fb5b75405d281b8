"""Math answers graded with math-verify (HuggingFace, PyPI `math-verify`).

`math_reward` is the default `rollout.reward_fn`: 1.0 when the response's final answer is
mathematically equal to the row's label, else 0.0. `grade` does the work:

- the label is the gold answer, read as LaTeX: wrapped in `$...$` unless it has math
  delimiters already, so `\\frac12`, `2^{10}`, `(x+1)^2`, `\\{1,2\\}` and `[0, 1)` parse as
  math. A label that assigns a value (`x = 4`) matches the bare value (`\\boxed{4}`), and a
  bare label matches an assignment; `y = 2x + 3` matches `2x + 3`;
- the response's answer is its last `\\boxed{}` (as slime's `boxed_` rewards take it);
  without one, math-verify finds it: an "answer is" phrase, else the last LaTeX or plain
  expression;
- equality is sympy's: numbers exactly or to 6 decimals, roots, powers, polynomials in any
  form, sets in any order, intervals with their open/closed ends, tuples, matrices; units
  (`\\text{ cm}`) and degree signs (`^\\circ`) are dropped, `50\\%` is 0.5;
- a label of plain words (`Paris`, `no solution`) is compared as text with the response's
  final answer (`extract_answer`), case, spaces and LaTeX wrappers aside, and so is any
  label when math-verify finds no math in it.

math-verify's own time limits use `signal.alarm`, which works only in a process's main
thread, while streamrl scores inside an event loop (and runs sync rewards in worker
threads). So `math_reward` runs `grade` in a worker process (`anyio.to_process`), where those
limits work, and kills that process when a call passes `GRADE_TIMEOUT_S`: sympy can hang on
adversarial input, and a thread could not be stopped.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_process
from anyio.lowlevel import RunVar

from streamrl.rewards import RewardInput

STEP_TIMEOUT_S = 5
"""math-verify's limit on one parse or one comparison (whole seconds, `signal.alarm`); it
applies where `grade` runs in a main thread, as in the worker processes."""
GRADE_TIMEOUT_S = 30.0
"""A `math_reward` call past this is stopped by killing its worker process (TimeoutError:
the sample counts as a reward failure)."""
NUM_GRADER_PROCESSES = min(4, os.cpu_count() or 1)
"""Worker processes grading at once per event loop (each imports sympy once, ~100 MB)."""

_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(?P<rest>[^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\boxed|\\\(|\\\[")
_WORDS = re.compile(r"[A-Za-z][A-Za-z '\-]*[A-Za-z]")
T = TypeVar("T")
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("streamrl_math_graders")


async def math_reward(inp: RewardInput) -> float:
    """1.0 if the response's final answer equals the label (see `grade`), else 0.0; graded
    in a worker process, killed after `GRADE_TIMEOUT_S`."""
    return 1.0 if await in_grader_process(grade, inp.label, inp.response) else 0.0


async def in_grader_process(fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
    """`fn(*args)` in a grader worker process (`anyio.to_process`; `fn` and its arguments are
    pickled, so `fn` is a module-level function). Past `timeout_s` (None: `GRADE_TIMEOUT_S`)
    the process is killed and TimeoutError raised; the next call starts a new process."""
    timeout_s = GRADE_TIMEOUT_S if timeout_s is None else timeout_s
    with anyio.move_on_after(timeout_s):
        return await anyio.to_process.run_sync(
            fn, *args, cancellable=True, limiter=_grader_limiter()
        )
    raise TimeoutError(
        f"grading took over {timeout_s:g} s ({getattr(fn, '__name__', fn)}); its worker "
        "process was killed"
    )


def grade(label: Any, response: str) -> bool:
    """Whether `response`'s final answer equals the gold answer `label` (module docstring).

    Runs in the calling process: math-verify's time limits apply in a main thread only, so
    in any other thread a hard input can take as long as sympy does.
    """
    if label is None:
        return False
    gold_text = str(label).strip()
    if not gold_text:
        return False
    if _WORDS.fullmatch(gold_text):  # `Paris` as LaTeX would be the product P*a*r*i*s
        return _is_same_text(gold_text, response)
    from math_verify import parse, verify
    from sympy import Basic, MatrixBase

    seconds = STEP_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(gold_text), parsing_timeout=seconds)
    if not any(isinstance(value, Basic | MatrixBase) for value in gold):
        return _is_same_text(gold_text, response)
    boxed = _last_boxed(response)  # math-verify alone would join every box into one set
    answer = parse(response if boxed is None else f"\\boxed{{{boxed}}}", parsing_timeout=seconds)
    return verify(gold, answer, timeout_seconds=seconds) or _is_same_text(gold_text, response)


def _as_latex(gold: str) -> str:
    """The label as math-verify reads LaTeX: inside `$...$` unless it has delimiters."""
    return gold if _MATH_DELIMITER.search(gold) else f"${gold}$"


def _is_same_text(gold: str, response: str) -> bool:
    """Whether the response, or its final answer, is the label as text (`normalize_answer`)."""
    expected = normalize_answer(gold)
    answer = extract_answer(response)
    return any(normalize_answer(text) == expected for text in (answer, response) if text)


def _grader_limiter() -> anyio.CapacityLimiter:
    """This event loop's limit on grading processes (`NUM_GRADER_PROCESSES`)."""
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(NUM_GRADER_PROCESSES)
        _LIMITER.set(limiter)
        return limiter


def extract_answer(text: str) -> str | None:
    """The final answer in `text` as a string, or None when there is none.

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


def exact_match(inp: RewardInput) -> float:
    """1.0 if the stripped response equals the stripped `str(label)`, else 0.0."""
    if inp.label is None:
        return 0.0
    return 1.0 if inp.response.strip() == str(inp.label).strip() else 0.0
