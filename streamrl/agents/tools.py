"""Tool calling in the model's chat format, as an environment for `run_episode`.

The format (Hermes / Qwen style, which SmolLM2's instruct data also uses):

- the system prompt (`system_prompt(tools)`) lists each tool's JSON schema
  inside `<tools>...</tools>` and asks for calls as
  `<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>`;
- a model turn may hold several calls; inside one `<tool_call>` block the
  parser accepts a JSON object or a JSON list of objects, `arguments` as an
  object or as a JSON string (or under `parameters`), text or code fences
  around the JSON, and a missing `</tool_call>` at the end of the turn;
- every call's outcome comes back in one masked user turn, one block per call:
  `<tool_response>\\n{"name": ..., "result": ...}\\n</tool_response>` (or
  `"error": ...` instead of `result`);
- a turn with no `<tool_call>` is the final answer: the episode ends, and
  `rollout.reward_fn` scores that turn's text (`trajectory.text`). An episode
  that runs out of turns without a final answer has empty text.

A tool runs with a deadline (`tool_timeout_s`, or the tool's own): an async
tool is cancelled, a sync tool runs in a worker thread and is abandoned there
(Python cannot stop a thread; a separate thread limiter keeps hung tools from
starving reward functions). A tool that raises, times out, is unknown or gets
bad arguments answers with an error block, the episode goes on, and the
sample's metadata counts `tool_calls`, `tool_errors`, `tool_timeouts`.

Configure with `rollout.generate_fn = "streamrl.agents.tools:generate"` and

    [rollout.generate_kwargs]
    tools = ["streamrl.agents.examples.calculator:CALCULATOR"]
    max_turns = 4
    tool_timeout_s = 5.0
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.agents.env import (
    EpisodeLimits,
    StepResult,
    chat_format,
    log_episode,
    parse_options,
    run_episode,
)
from streamrl.utils import import_object

log = logging.getLogger(__name__)

_TOOL_THREADS = anyio.CapacityLimiter(16)
"""Worker threads for sync tools (hung ones stay here, not in anyio's default pool)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `fn(**arguments)`, sync or async."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""
    fn: Callable[..., Any]
    timeout_s: float | None = None
    """Overrides `tool_timeout_s` for this tool."""

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def system_prompt(tools: list[Tool], preamble: str = "") -> str:
    """The system message that teaches the call format and lists `tools`."""
    if not tools:
        raise ValueError("system_prompt needs at least one tool")
    listing = "\n".join(json.dumps(tool.schema()) for tool in tools)
    return (
        (preamble.strip() + "\n\n" if preamble.strip() else "")
        + "You can use these tools:\n<tools>\n"
        + listing
        + "\n</tools>\n\n"
        + "To use a tool, reply with a JSON object inside tool_call tags, for example\n"
        + '<tool_call>{"name": "'
        + tools[0].name
        + '", "arguments": {...}}</tool_call>\n'
        + "The result comes back inside <tool_response></tool_response> tags. "
        + "When you know the answer, reply with the answer and no tool call."
    )


# ---------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in a model turn, and a description of each block that could not be read."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    for match in _BLOCK.finditer(text):
        body = match.group(1)
        start = min((i for i in (body.find("{"), body.find("[")) if i >= 0), default=-1)
        try:
            if start < 0:
                raise ValueError("no JSON object")
            value, _ = _DECODER.raw_decode(body, start)
        except ValueError as exc:
            problems.append(f"unreadable tool call ({exc}): {body.strip()[:200]}")
            continue
        for item in value if isinstance(value, list) else [value]:
            call = _as_call(item)
            if isinstance(call, str):
                problems.append(call)
            else:
                calls.append(call)
    return calls, problems


def _as_call(item: Any) -> ToolCall | str:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return f"a tool call needs a string 'name': {json.dumps(item)[:200]}"
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return f"tool {item['name']!r}: arguments are not JSON: {arguments[:200]}"
    if not isinstance(arguments, dict):
        return (
            f"tool {item['name']!r}: arguments must be an object, got {json.dumps(arguments)[:200]}"
        )
    return ToolCall(item["name"], arguments)


# ---------------------------------------------------------------- running


@dataclass
class ToolOutcome:
    text: str
    status: str
    """"ok", "error" or "timeout"."""


async def call_tool(tool: Tool, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
    """Run one call with a deadline; failures become an outcome, never an exception."""
    timeout_s = tool.timeout_s or timeout_s
    result: Any = None
    with anyio.move_on_after(timeout_s) as scope:
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await tool.fn(**arguments)
            else:
                result = await anyio.to_thread.run_sync(
                    functools.partial(tool.fn, **arguments),
                    abandon_on_cancel=True,
                    limiter=_TOOL_THREADS,
                )
                if inspect.isawaitable(result):
                    result = await result
        except Exception as exc:
            return ToolOutcome(f"{type(exc).__name__}: {exc}", "error")
    if scope.cancelled_caught:
        return ToolOutcome(f"timed out after {timeout_s:g} s", "timeout")
    return ToolOutcome(result if isinstance(result, str) else json.dumps(result), "ok")


@dataclass
class ToolStats:
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that raised, were unreadable, named an unknown tool or had bad arguments."""
    tool_timeouts: int = 0


@dataclass
class ToolEnvironment:
    """An `Environment` whose actions are tool calls and whose observations are results."""

    tools: dict[str, Tool]
    timeout_s: float = 10.0
    max_calls_per_turn: int = 4
    max_result_chars: int = 1000
    stats: ToolStats = field(default_factory=ToolStats)
    final_answer: str | None = None

    async def reset(self, prompt: Any) -> str:
        missing = [name for name in self.tools if name not in prompt.text]
        if missing:
            _warn_once(
                f"the prompt does not describe tool(s) {missing}: put "
                "streamrl.agents.tools.system_prompt(tools) in the data's system message"
            )
        return prompt.text

    async def step(self, action: str) -> StepResult:
        calls, problems = parse_tool_calls(action)
        if not calls and not problems:
            self.final_answer = action
            return StepResult(observation="", done=True, info=dict(self.stats.__dict__))
        blocks = [self._block("?", "error", problem) for problem in problems]
        self.stats.tool_calls += len(calls) + len(problems)
        self.stats.tool_errors += len(problems)
        for index, call in enumerate(calls):
            if index >= self.max_calls_per_turn:
                outcome = ToolOutcome(
                    f"more than {self.max_calls_per_turn} calls in one turn", "error"
                )
            elif (tool := self.tools.get(call.name)) is None:
                outcome = ToolOutcome(f"unknown tool; known: {', '.join(self.tools)}", "error")
            else:
                outcome = await call_tool(tool, call.arguments, timeout_s=self.timeout_s)
            if outcome.status == "timeout":
                self.stats.tool_timeouts += 1
            elif outcome.status == "error":
                self.stats.tool_errors += 1
            blocks.append(self._block(call.name, outcome.status, outcome.text))
        return StepResult(observation="\n".join(blocks), info=dict(self.stats.__dict__))

    def _block(self, name: str, status: str, text: str) -> str:
        text = text[: self.max_result_chars]
        key = "result" if status == "ok" else "error"
        return "<tool_response>\n" + json.dumps({"name": name, key: text}) + "\n</tool_response>"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# ---------------------------------------------------------------- the generate function


class ToolOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rollout.generate_kwargs` of `streamrl.agents.tools:generate`."""

    tools: list[str]
    """`module:attribute` of each `Tool` (or of a list of them)."""
    max_turns: int = 4
    """Model turns per episode, tool calls and the final answer included."""
    max_total_tokens: int = 0
    """Prompt plus response tokens per episode at most; 0: no limit."""
    max_new_tokens: int = 0
    """Tokens per model turn; 0 means rollout.sampling.max_new_tokens."""
    tool_timeout_s: float = 10.0
    max_calls_per_turn: int = 4
    max_result_chars: int = 1000
    """Longer results are cut (they cost context tokens)."""
    episode_log: str = ""
    """As in `streamrl.agents.env.EnvOptions`."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.tool_timeout_s <= 0 or self.max_calls_per_turn < 1:
            raise ValueError("max_turns, max_calls_per_turn must be >= 1; tool_timeout_s > 0")


@functools.cache
def load_tools(specs: tuple[str, ...]) -> dict[str, Tool]:
    """The tools named by `specs`, by name; a spec may name one Tool or a list of them."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        value = import_object(spec, "rollout.generate_kwargs.tools")
        for tool in value if isinstance(value, list | tuple) else [value]:
            if not isinstance(tool, Tool):
                raise TypeError(f"rollout.generate_kwargs.tools: {spec} is not a Tool")
            tools[tool.name] = tool
    return tools


async def generate(ctx: GenerateContext, prompt: Any) -> Trajectory:
    """`rollout.generate_fn` for tool use: call tools until a final answer, then score it."""
    options = parse_options(ctx.kwargs, ToolOptions)
    env = ToolEnvironment(
        load_tools(tuple(options.tools)),
        timeout_s=options.tool_timeout_s,
        max_calls_per_turn=options.max_calls_per_turn,
        max_result_chars=options.max_result_chars,
    )
    started = time.monotonic()
    trajectory = await run_episode(
        ctx,
        prompt,
        env,
        EpisodeLimits(options.max_turns, options.max_total_tokens, options.max_new_tokens),
        chat=chat_format(ctx.tokenizer),
        reward="reward_fn",
    )
    trajectory.text = env.final_answer or ""
    trajectory.metadata.update(env.stats.__dict__)
    trajectory.metadata["has_final_answer"] = env.final_answer is not None
    if options.episode_log:
        log_episode(options.episode_log, prompt, trajectory, time.monotonic() - started)
    return trajectory


generate.needs_chat_template = True
"""Turns are rendered with the tokenizer's chat template (`streamrl check` asks for one)."""
