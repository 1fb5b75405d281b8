"""Tool calls in a model turn's text, in the chat template's own format.

Two formats, the ones open chat models are trained on:

- `hermes` (Hermes, Qwen2/2.5/3, and streamrl's own tool prompt for templates without
  tools): each call is a JSON object `{"name": ..., "arguments": {...}}` inside
  `<tool_call>...</tool_call>`; a turn may hold several, with text around them. A
  missing `</tool_call>` at the very end of the turn (cut off, or stopped on it) is
  accepted.
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole turn is the JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several
  objects may be separated by `;`. A turn that is not entirely JSON calls is text.

`arguments` may also come as a JSON string holding an object, and `parameters` /
`arguments` are accepted in both formats; arguments that are not an object make the
block unreadable. A block that looks like a call but cannot be read stays in the content
and is reported in `ParsedTurn.problems` (the session counts them), never raised.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3"]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the decoded JSON object (a client may also send back a
    string that is not JSON, which is kept as it is)."""

    name: str
    arguments: dict[str, Any] | str
    id: str = field(default_factory=lambda: new_call_id(), compare=False)

    @property
    def arguments_json(self) -> str:
        """`arguments` as OpenAI sends them: a JSON string."""
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedTurn:
    """A model turn split into its text content and its tool calls."""

    content: str
    calls: list[ToolCall]
    problems: list[str] = field(default_factory=list)


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def parse_turn(text: str, tool_format: ToolFormat | None) -> ParsedTurn:
    """Split `text` (a model turn, special tokens removed) in `tool_format`; None: no calls."""
    if tool_format is None:
        return ParsedTurn(text, [])
    if tool_format == "hermes":
        return parse_hermes(text)
    if tool_format == "llama3":
        return parse_llama3(text)
    raise ValueError(f"unknown tool format {tool_format!r}; known: hermes, llama3")


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks; the text outside them is the content."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(text):
        call, problem = _call_from_json(match.group(1))
        if call is None:
            problems.append(f"unreadable <tool_call> block ({problem}): {match.group(0)[:200]}")
            continue  # the block stays in the content, as the model wrote it
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept)
    return ParsedTurn(content.strip() if calls else content, calls, problems)


def parse_llama3(text: str) -> ParsedTurn:
    """The whole turn as JSON calls (after an optional `<|python_tag|>`), else plain text."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return ParsedTurn(text, [])
    calls: list[ToolCall] = []
    position = 0
    while position < len(body):
        try:
            value, end = _DECODER.raw_decode(body, position)
        except ValueError as exc:
            return ParsedTurn(text, [], [f"unreadable JSON tool call ({exc}): {body[:200]}"])
        call, problem = _call_from_value(value)
        if call is None:
            # JSON that is not a call (an answer written as JSON) is content, not a problem.
            return ParsedTurn(text, [], [] if calls == [] else [problem])
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return ParsedTurn("", calls)


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    start = body.find("{")
    if start < 0:
        return None, "no JSON object"
    try:
        value, end = _DECODER.raw_decode(body, start)
    except ValueError as exc:
        return None, str(exc)
    if body[end:].strip():
        return None, f"text after the JSON object: {body[end:].strip()[:40]!r}"
    return _call_from_value(value)


def _call_from_value(value: Any) -> tuple[ToolCall | None, str]:
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not an object"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, "no string 'name'"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # a JSON object written as a string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None, "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"'arguments' is a JSON {type(arguments).__name__}, not an object"
    return ToolCall(name=name, arguments=arguments), ""


def detect_format(chat_template: str) -> ToolFormat | None:
    """The tool-call format a chat template teaches, from its source; None when unknown."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3"
    return None
