"""One conversation form for both APIs: what a session compares and the template renders.

A `Message` keeps what the chat template renders and nothing else: role, text content,
tool calls (name and arguments), the id a tool result answers, a name. OpenAI messages
(`openai_api`) and Anthropic messages (`anthropic_api`) both become `Message`s, so a
session's history check is one equality: `Message`s compare by role, content, tool
calls' names and decoded arguments, and name; ids are kept for the reply but do not take
part (clients echo them, templates mostly ignore them). Tool definitions become
`ToolSpec`s in OpenAI's function form, compared by their canonical JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from streamrl.agents.gateway.tool_calls import ToolCall

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the gateway refuses: answered with `status` and the message, which names
    the offending field (`messages[2].content`)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = field(default=None, compare=False)
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict `apply_chat_template` takes (arguments as objects, as HF templates expect)."""
        return self._as_dict(content=self.content, arguments_json=False)

    def to_openai(self) -> dict[str, Any]:
        """This message as an OpenAI chat message (what an episode's reward function sees)."""
        content = (self.content or None) if self.tool_calls else self.content
        return self._as_dict(content=content, arguments_json=True)

    def _as_dict(self, *, content: str | None, arguments_json: bool) -> dict[str, Any]:
        """role, content, and the tool fields this message has; a call's arguments as an
        object or (`arguments_json`) as the JSON string OpenAI sends."""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments_json if arguments_json else call.arguments,
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class ToolSpec:
    """A tool definition in OpenAI's form: `{"type": "function", "function": {...}}`."""

    name: str
    description: str
    parameters: dict[str, Any]
    canonical: str = field(default="", compare=True, repr=False)

    @classmethod
    def make(cls, name: str, description: str, parameters: dict[str, Any]) -> ToolSpec:
        canonical = json.dumps([name, description, parameters], sort_keys=True)
        return cls(name, description, parameters, canonical)

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def text_of(content: Any, where: str) -> str:
    """Text of a message content: a string, None, or a list of text parts / blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}[{index}]: only text content is supported, got {kind!r}"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(f"{where}: content must be a string or a list of text parts")


def decode_arguments(raw: Any, where: str) -> dict[str, Any] | str:
    """Tool-call arguments from a client: a JSON string (OpenAI) or an object (Anthropic)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    raise RequestError(f"{where}: arguments must be a JSON string or an object")


def describe_difference(recorded: tuple[Message, ...], sent: tuple[Message, ...]) -> str:
    """Where `sent` first departs from `recorded` (for a divergence error)."""
    for index, (mine, theirs) in enumerate(zip(recorded, sent, strict=False)):
        if mine != theirs:
            for name in ("role", "content", "tool_calls", "name"):
                a, b = getattr(mine, name), getattr(theirs, name)
                if a != b:
                    return f"messages[{index}].{name}: recorded {_short(a)}, sent {_short(b)}"
    return f"the session recorded {len(recorded)} messages, the request has {len(sent)}"


def _short(value: Any) -> str:
    if isinstance(value, tuple):
        value = [(call.name, call.arguments) for call in value]
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
