"""What one API call asks (`ChatRequest`, `TextRequest`, their `Sampling`) and what it
gets (`Reply` of `Choice`s): the form both APIs' parsers produce and their replies read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from streamrl.agents.gateway.messages import Message, ToolSpec
from streamrl.agents.gateway.tool_calls import ToolCall


@dataclass
class Sampling:
    """What a request asks of one generation (None: the episode's sampling params)."""

    max_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


@dataclass
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    parse_tools: bool = True
    """False for `tool_choice: none`: the text is returned as it is."""


@dataclass
class TextRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: Sampling = field(default_factory=Sampling)


@dataclass
class Choice:
    index: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    """The model's text (special tokens removed, a matched stop string trimmed)."""
    content: str
    """`text` without its tool calls."""
    tool_calls: list[ToolCall]
    finish: Literal["stop", "length", "tool_calls"]
    stop_sequence: str | None = None


@dataclass
class Reply:
    choices: list[Choice]
    num_prompt_tokens: int
    """Tokens the engine was given (the whole context)."""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def version(self) -> int:
        """Newest weight version among the reply's tokens (-1 without tokens)."""
        return max((v for c in self.choices for v in c.versions), default=-1)
