"""A calculator tool (a safe arithmetic evaluator) and arithmetic word problems that need it.

`evaluate` never hands model text to `eval`/`exec`: it parses the expression
with `ast` and walks a whitelist — int and float literals, `+ - * / // % **`,
unary `+`/`-`, parentheses (which `ast` folds away). Limits keep every call
cheap: at most `MAX_EXPRESSION_CHARS` characters and `MAX_NODES` syntax
nodes, exponents of magnitude at most `MAX_EXPONENT`, and every intermediate
value within `MAX_MAGNITUDE`. `^` is read as a power (models write it so),
`×`/`÷`/`−` as `*`/`/`/`-`, and thousands separators (`1,250`) are removed.

Word problems: `make_rows(seed, n)` gives JSONL rows whose prompt is a chat
(system message with the tool schema, user question) and whose label is the
integer answer, scored by `streamrl.rewards.math:math_reward`;
`python -m streamrl.agents.examples.calculator OUT.jsonl [--n N] [--seed S]` writes them.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
from typing import Any

from streamrl.agents.tools import Tool, system_prompt

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


class CalculatorError(ValueError):
    """An expression outside the whitelist or the limits (the message says which)."""


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip().rstrip("=").strip()
    text = text.replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    text = _THOUSANDS.sub("", text)
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise CalculatorError(
            f"not an arithmetic expression: {exc.msg if hasattr(exc, 'msg') else exc}"
        ) from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalculatorError("division by zero")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (OverflowError, ArithmeticError) as exc:
            raise CalculatorError(f"arithmetic error: {exc}") from None
        if isinstance(value, complex):
            raise CalculatorError("complex result (negative number to a fractional power)")
        return _bounded(value)
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"number larger than {MAX_MAGNITUDE:.0e}")
    return value


def calculate(expression: str) -> str:
    """The tool function: the value as text (integers without a decimal point)."""
    value = evaluate(expression)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
        "required": ["expression"],
    },
    fn=calculate,
    timeout_s=2.0,
)

# ---------------------------------------------------------------- word problems

_NAMES = ("Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cards", "coins", "shells")


def _problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, integer answer, expression) of one word problem."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return (
            f"{name} buys {a} boxes of {item} with {b} {item} in each box. "
            f"How many {item} does {name} buy?",
            a * b,
            f"{a} * {b}",
        )
    if kind == 1:
        a, b, c = rng.randint(200, 999), rng.randint(20, 199), rng.randint(20, 199)
        return (
            f"{name} has {a} {item}, gives away {b} and then gets {c} more. "
            f"How many {item} does {name} have now?",
            a - b + c,
            f"{a} - {b} + {c}",
        )
    if kind == 2:
        each, count = rng.randint(12, 60), rng.randint(6, 24)
        return (
            f"{each * count} {item} are shared equally among {count} children. "
            f"How many {item} does each child get?",
            each,
            f"{each * count} / {count}",
        )
    if kind == 3:
        a, b, c = rng.randint(15, 95), rng.randint(6, 30), rng.randint(50, 400)
        return (
            f"{name} saves {a} dollars every week for {b} weeks and then spends {c} "
            f"dollars. How many dollars are left?",
            a * b - c,
            f"{a} * {b} - {c}",
        )
    a, b, c = rng.randint(11, 60), rng.randint(11, 60), rng.randint(3, 12)
    return (
        f"A shelf holds {a} {item} and another holds {b}. {name} puts the same number "
        f"on each of {c} more shelves as on the first two together. How many {item} are "
        f"on the {c} new shelves?",
        (a + b) * c,
        f"({a} + {b}) * {c}",
    )


SYSTEM_PREAMBLE = (
    "You solve arithmetic word problems. Use the calculator for every computation, "
    "then reply with only the final number."
)


DEMONSTRATION = [
    {"role": "user", "content": "Tom has 48 bags with 25 nuts in each bag. How many nuts?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "48 * 25"}}'
        "</tool_call>",
    },
    {
        "role": "user",
        "content": '<tool_response>\n{"name": "calculator", "result": "1200"}\n</tool_response>',
    },
    {"role": "assistant", "content": "1200"},
]
"""One worked exchange in the exact turn format `streamrl.agents.tools` produces."""


def make_rows(seed: int, num_rows: int, *, demonstration: bool = True) -> list[dict[str, Any]]:
    """Deterministic word-problem rows: chat prompt (system message with the tool schema,
    optionally one worked exchange, the question) and the integer answer as label."""
    rng = random.Random(f"calculator/{seed}")
    head = [{"role": "system", "content": system_prompt([CALCULATOR], SYSTEM_PREAMBLE)}]
    if demonstration:
        head += DEMONSTRATION
    rows = []
    for _ in range(num_rows):
        question, answer, expression = _problem(rng)
        rows.append(
            {
                "prompt": [*head, {"role": "user", "content": question}],
                "label": str(answer),
                "metadata": {"expression": expression},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write calculator word problems as JSONL.")
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-demonstration", action="store_true", help="leave out the worked exchange"
    )
    args = parser.parse_args(argv)
    with open(args.out, "w") as handle:
        for row in make_rows(args.seed, args.n, demonstration=not args.no_demonstration):
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
