"""An arithmetic agent written against the OpenAI Python client, with a Python tool.

Nothing here knows about streamrl: `run` takes a base URL (any OpenAI-compatible
server: streamrl's gateway during training, a vLLM or OpenAI endpoint otherwise) and a
question, and loops: ask the model, run the Python tool calls it makes in a sandbox
(`sandbox.py`), send the results back, until it answers without a tool call.

    streamrl run examples/openai_agent/config.toml      # trains it (see README.md)
    python examples/openai_agent/agent.py http://127.0.0.1:8000/v1 "What is 47 * 86?"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio.to_thread
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sandbox import run_python

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
    },
}


def _demonstration(question: str, code: str, output: str, answer: str, call_id: str) -> list[dict]:
    """One worked exchange in the tool-call format (few-shot prompting)."""
    call = {"name": "python", "arguments": json.dumps({"code": code})}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": call}
        ]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
        {"role": "assistant", "content": answer},
    ]  # fmt: skip


DEMONSTRATIONS = [
    *_demonstration("What is 12 * 7?", "print(12 * 7)", "84\n", "84", "call_demo_1"),
    *_demonstration("What is 345 + 289?", "print(345 + 289)", "634\n", "634", "call_demo_2"),
    *_demonstration("What is 91 - 17?", "print(91 - 17)", "74\n", "74", "call_demo_3"),
]


async def solve(
    client: AsyncOpenAI, question: str, *, max_turns: int = 3, max_tokens: int = 40
) -> str:
    """The agent loop; returns the final answer ("" when it ran out of turns)."""
    messages: list[Any] = [*DEMONSTRATIONS, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[PYTHON_TOOL], max_tokens=max_tokens
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": await _run_tool(call)}
            )
    return ""


async def _run_tool(call: Any) -> str:
    if call.function.name != "python":
        return f"Error: unknown tool {call.function.name!r}"
    try:
        code = json.loads(call.function.arguments)["code"]
    except (ValueError, KeyError, TypeError):
        return "Error: the arguments must be a JSON object with a string 'code'"
    return await anyio.to_thread.run_sync(run_python, str(code))


async def run(base_url: str, prompt: Any, max_turns: int = 3, max_tokens: int = 40) -> str:
    """streamrl's entry point (`rollout.generate_kwargs.agent`): the prompt's text is the
    question; the returned answer is what `rollout.reward_fn` scores."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    async with client:
        return await solve(client, prompt.text, max_turns=max_turns, max_tokens=max_tokens)


if __name__ == "__main__":
    import anyio

    async def _main() -> None:
        async with AsyncOpenAI(base_url=sys.argv[1], api_key="unused") as client:
            print(await solve(client, sys.argv[2]))

    anyio.run(_main)
