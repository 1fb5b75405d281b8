"""streamrl's math grade next to math-verify's own on answer pairs; the table in docs/rewards.md.

    python bench/cpu/math_grader_table.py            # print the table and a summary line
    python bench/cpu/math_grader_table.py --write    # rewrite the table in docs/rewards.md

For each (label, response) pair: the grade a reader would expect, `streamrl.rewards.math.grade`
(what `math_reward` runs), math-verify called plainly, `verify(parse(label), parse(response))`
with the label as the data set holds it, and the same with the label inside `$...$` (how
math-verify reads a gold answer as LaTeX). tests/rewards/test_math_grader.py checks that the page
holds this script's table and that streamrl gives every expected grade.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "rewards.md"
START = "<!-- math-grader-table:start (bench/cpu/math_grader_table.py --write) -->"
END = "<!-- math-grader-table:end -->"


class Case(NamedTuple):
    kind: str
    label: Any
    response: str
    expected: bool


CASES = [
    Case("the slime seed's row", "x = 4", r"\boxed{4}", True),
    Case("bare value, assignment answer", "4", r"So $x = 4$.", True),
    Case("assignment to an expression", "y = 2x + 3", r"\boxed{2x+3}", True),
    Case("number label", 4, r"\boxed{4}", True),
    Case("fraction", "1/2", r"\boxed{\frac12}", True),
    Case("root", r"\sqrt{2}", r"\boxed{\sqrt2}", True),
    Case("root times fraction", r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}\sqrt3}", True),
    Case("power", "2^{10}", r"\boxed{1024}", True),
    Case("power, reversed", "1024", r"\boxed{2^{10}}", True),
    Case("polynomial", "(x+1)^2", r"\boxed{x^2+2x+1}", True),
    Case("decimal", "3", r"\boxed{3.0}", True),
    Case("set, any order", r"\{1,2,3\}", r"\boxed{\{3,2,1\}}", True),
    Case("solutions as a list", "2, 3", r"$x=2$ or $x=3$, so \boxed{3, 2}", True),
    Case("interval", "[0, 1)", r"\boxed{[0,1)}", True),
    Case("interval, to infinity", r"(-\infty, 3]", r"The solution set is $(-\infty, 3]$.", True),
    Case("units in the label", r"10\text{ cm}", r"\boxed{10}", True),
    Case("units in the answer", "10", r"\boxed{10\text{ cm}}", True),
    Case("degrees in the label", r"30^\circ", r"\boxed{30}", True),
    Case("degrees in the answer", "30", r"The angle is $30^{\circ}$.", True),
    Case("percent as a fraction", r"50\%", r"\boxed{0.5}", True),
    Case("percent in the answer", "50", r"\boxed{50\%}", True),
    Case("thousands separator", "1,234", r"\boxed{1234}", True),
    Case("thousands in plain text", "1234", "The total is 1,234.", True),
    Case("currency", r"\$5", r"\boxed{5}", True),
    Case("complex number", "1+2i", r"\boxed{2i+1}", True),
    Case(
        "vector",
        r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}",
        r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}",
        True,
    ),
    Case("no box: last equation", "12", "7 + 5 = 12", True),
    Case("no box: answer phrase", "12", "The answer is 12.", True),
    Case("the last box counts", "4", r"\boxed{3}, checking again: \boxed{4}", True),
    Case("text label", "Paris", r"\boxed{\text{Paris}}", True),
    Case("text label, other case", "no solution", r"\boxed{\text{No solution}}", True),
    Case("wrong: other value", "x = 4", r"\boxed{x = 5}", False),
    Case("wrong: answer phrase", "12", "The answer is 13.", False),
    Case("wrong: an earlier box", "3", r"\boxed{3}, checking again: \boxed{4}", False),
    Case("wrong: every candidate", "4", r"\boxed{1, 2, 3, 4}", False),
    Case("wrong: hedged", "4", "x = 4 or x = -4", False),
    Case("wrong: interval ends", "[0, 1)", r"\boxed{(0,1]}", False),
    Case("wrong: rounded label", "0.333", r"\boxed{1/3}", False),
    Case("wrong: degrees for radians", r"\frac{\pi}{2}", r"\boxed{90^\circ}", False),
    Case("wrong: near miss", "3", r"\boxed{2.9999999}", False),
    Case("wrong: letters reordered", "Paris", r"\boxed{Sirap}", False),
    Case("malformed: unclosed box", "12", r"\boxed{", False),
    Case("malformed: empty box", "12", r"\boxed{}", False),
    Case("malformed: broken fraction", r"\frac{1}{2}", r"\boxed{\frac{1}{}}", False),
    Case("malformed: empty response", "12", "", False),
    Case("malformed: empty label", "", "12", False),
]


def streamrl_grade(case: Case) -> bool:
    from streamrl.rewards.math import grade

    return grade(case.label, case.response)


def math_verify_grade(case: Case, *, as_latex: bool = False) -> bool:
    from math_verify import parse, verify

    gold = f"${case.label}$" if as_latex else str(case.label)
    return verify(parse(gold), parse(case.response))


def mark(grade: bool, expected: bool) -> str:
    return f"{int(grade)}" if grade == expected else f"{int(grade)} ✗"


def render() -> tuple[str, str]:
    """The markdown table and its summary line."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    rows = [
        "| # | case | label | response | expected | streamrl | math-verify | math-verify, `$label$` |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    right = {"streamrl": 0, "plain": 0, "latex": 0}
    agree = {"plain": 0, "latex": 0}
    for number, case in enumerate(CASES, 1):
        grades = {
            "streamrl": streamrl_grade(case),
            "plain": math_verify_grade(case),
            "latex": math_verify_grade(case, as_latex=True),
        }
        for name, grade in grades.items():
            right[name] += grade == case.expected
        for name in agree:
            agree[name] += grades[name] == grades["streamrl"]
        label = f"`{case.label}`" if case.label != "" else "(empty)"
        response = f"`{case.response}`" if case.response else "(empty)"
        marks = " | ".join(mark(grade, case.expected) for grade in grades.values())
        rows.append(
            f"| {number} | {case.kind} | {label} | {response} | {int(case.expected)} | {marks} |"
        )
    total = len(CASES)
    summary = (
        f"{total} pairs: streamrl grades {right['streamrl']} as expected, math-verify "
        f"{right['plain']} (label as given; agrees with streamrl on {agree['plain']}, "
        f"disagrees on {total - agree['plain']}) and {right['latex']} (label in `$...$`; agrees "
        f"on {agree['latex']}, disagrees on {total - agree['latex']})."
    )
    return "\n".join(rows) + "\n", summary


def section() -> str:
    """What docs/rewards.md holds between the markers."""
    table, summary = render()
    return f"{START}\n{table}\n{summary}\n{END}"


def page_section(text: str) -> str:
    return text[text.index(START) : text.index(END) + len(END)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in the page")
    args = parser.parse_args()
    new = section()
    if args.write:
        text = PAGE.read_text()
        PAGE.write_text(text.replace(page_section(text), new))
    else:
        print(new)
    print(new.splitlines()[-2], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
