"""An arithmetic agent written against the Anthropic Python client, run as its own process.

Nothing here knows about streamrl. The `anthropic` client reads ANTHROPIC_BASE_URL and
ANTHROPIC_API_KEY from the environment; streamrl's gateway sets them to the episode's
session for every process it starts. The question comes as JSON on stdin (`text`); the
answer goes to stdout, and to STREAMRL_RESULT_FILE when that is set.

    streamrl run examples/anthropic_agent/config.toml                # trains it
    echo '{"text": "What is 47 * 86?"}' | ANTHROPIC_BASE_URL=... python examples/anthropic_agent/agent.py

The tool is the same Python sandbox as the OpenAI example's (`examples/openai_agent/sandbox.py`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openai_agent"))
from sandbox import run_python

PYTHON_TOOL = {
    "name": "python",
    "description": "Run Python code and return what it prints.",
    "input_schema": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source"}},
        "required": ["code"],
    },
}


def _demonstration(question: str, code: str, output: str, answer: str, use_id: str) -> list[dict]:
    call = {"type": "tool_use", "id": use_id, "name": "python", "input": {"code": code}}
    result = {"type": "tool_result", "tool_use_id": use_id, "content": output}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": answer},
    ]


DEMONSTRATIONS = [
    *_demonstration("What is 12 * 7?", "print(12 * 7)", "84\n", "84", "toolu_demo_1"),
    *_demonstration("What is 345 + 289?", "print(345 + 289)", "634\n", "634", "toolu_demo_2"),
    *_demonstration("What is 91 - 17?", "print(91 - 17)", "74\n", "74", "toolu_demo_3"),
]


def solve(client: anthropic.Anthropic, question: str, max_turns: int = 3) -> str:
    """The agent loop; returns the final answer ("" when it ran out of turns)."""
    messages = [*DEMONSTRATIONS, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.messages.create(
            model="policy", max_tokens=40, messages=messages, tools=[PYTHON_TOOL]
        )
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            return "".join(block.text for block in reply.content if block.type == "text")
        results = []
        for use in uses:
            code = use.input.get("code") if use.name == "python" else None
            output = (
                run_python(str(code)) if isinstance(code, str) else "Error: unknown tool or no code"
            )
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": output})
        messages.append({"role": "user", "content": results})
    return ""


def main() -> None:
    question = json.loads(sys.stdin.readline())["text"]
    with anthropic.Anthropic(max_retries=0) as client:
        answer = solve(client, question)
    print(answer)
    if "STREAMRL_RESULT_FILE" in os.environ:
        with open(os.environ["STREAMRL_RESULT_FILE"], "w") as handle:
            json.dump(answer, handle)


if __name__ == "__main__":
    main()
