"""Rendering a conversation with the tokenizer's chat template, turn by turn, token-exact.

The first request of a branch is rendered whole: `prompt_ids(messages, tools)` is the
template's text for the conversation plus the assistant generation prompt, tokenized
with `add_special_tokens=False` (the template writes every special token itself).

A later request that extends a recorded history H (ending with a model turn whose
tokens the session keeps) is rendered only in its new part:

    hist  = render(H,            add_generation_prompt=False)   # ends with the turn close
    full  = render(H + new msgs, add_generation_prompt=True)
    delta = full[len(hist):]       (refused with TemplateError unless full starts with hist)
    ids   = tokenize(closing + delta)

`closing` is the part of the template's end-of-assistant-turn text (`turn_close`, found
by rendering a sentinel conversation) that the model did not write: for ChatML, "\\n"
after a turn the model ended with `<|im_end|>`, all of `<|im_end|>\\n` after a turn cut
off by the token limit or a stop string. The model's own tokens are never re-rendered
or re-tokenized, so there is no drift between what the engine saw and what is trained.

Tools. A template that renders tool definitions, assistant tool calls and `tool`
messages itself (its source uses them: Qwen2.5, Hermes, Llama 3.1) gets them natively
and `tools=` is passed to it; the tool-call format is read from its source (see
`tool_calls.detect_format`). A template without tool support (SmolLM2's ChatML) gets
streamrl's Hermes-style rendering in its own roles: the tool list appended to the
system message (`tools_prompt`), calls written as `<tool_call>{json}</tool_call>` in
the assistant's content, and each run of `tool` messages as one user message of
`<tool_response>` blocks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from streamrl.agents.gateway.messages import Message, ToolSpec
from streamrl.agents.gateway.tool_calls import ToolCall, ToolFormat, detect_format

ToolFormatOption = Literal["auto", "hermes", "llama3", "none"]

_USER, _ASSISTANT = "SENTINEL_USER_7f3a", "SENTINEL_ASSISTANT_7f3a"
_TOOL, _RESULT = "sentinel_tool_7f3a", "SENTINEL_RESULT_7f3a"


class TemplateError(ValueError):
    """The chat template cannot give an exact token layout for this conversation."""


def tools_prompt(tools: tuple[ToolSpec, ...]) -> str:
    """streamrl's tool instructions for templates without tool support (Hermes-style)."""
    listing = "\n".join(json.dumps(tool.to_openai()["function"]) for tool in tools)
    return (
        "You may call these tools:\n<tools>\n"
        + listing
        + "\n</tools>\n"
        + "To call a tool, reply with a JSON object inside tool_call tags:\n"
        + '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>\n'
        + "Each result comes back inside <tool_response></tool_response> tags."
    )


class ChatTemplate:
    """A tokenizer's chat template, probed once: native tool support, tool-call format and
    the end-of-assistant-turn text."""

    def __init__(self, tokenizer: Any, tool_format: ToolFormatOption = "auto") -> None:
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            raise TemplateError(
                "the tokenizer has no (single) chat template; the gateway needs one"
            )
        self.tokenizer = tokenizer
        self.native_tools = _renders_tools(tokenizer)
        detected = detect_format(source) if self.native_tools else "hermes"
        if tool_format == "auto":
            self.tool_format: ToolFormat | None = detected
        elif tool_format == "none":
            self.tool_format = None
        else:
            if not self.native_tools and tool_format != "hermes":
                raise TemplateError(
                    f"rollout.generate_kwargs.tool_format = {tool_format!r}: this template has no "
                    "tool support, and streamrl's own tool prompt uses the 'hermes' format"
                )
            self.tool_format = tool_format
        self.turn_close = self._probe_close()
        self.special_ids = set(getattr(tokenizer, "all_special_ids", ()))

    # ---------------------------------------------------------------- rendering

    def render(
        self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...], *, generation: bool
    ) -> str:
        """The template's text for `messages` (plus the assistant header when `generation`)."""
        if self.native_tools:
            dicts = [message.to_template() for message in messages]
            specs = [tool.to_openai() for tool in tools] or None
        else:
            dicts, specs = _hermes_in_text(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(
                dicts, tools=specs, tokenize=False, add_generation_prompt=generation
            )
        except Exception as exc:  # jinja raises for roles or orders a template refuses
            raise TemplateError(f"the chat template refused the conversation: {exc}") from exc

    def prompt_ids(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> list[int]:
        """Ids of a whole conversation plus the generation prompt (a branch's first turn)."""
        return self.encode(self.render(messages, tools, generation=True))

    def continuation_ids(
        self,
        history: tuple[Message, ...],
        messages: tuple[Message, ...],
        tools: tuple[ToolSpec, ...],
        model_ids: list[int],
    ) -> list[int]:
        """Ids that follow a recorded model turn (`model_ids`, the last of `history`) to
        show `messages[len(history):]` and open the next assistant turn."""
        hist = self.render(history, tools, generation=False)
        full = self.render(messages, tools, generation=True)
        if not full.startswith(hist):
            raise TemplateError(
                "the chat template renders the recorded history differently once new messages "
                f"follow it (prefix property fails), so the new turn has no exact token layout:\n"
                f"{hist[-300:]!r}\nvs\n{full[len(hist) - 300 : len(hist)]!r}"
            )
        if not hist.endswith(self.turn_close):
            raise TemplateError(
                f"the recorded assistant turn does not end with the template's turn close "
                f"{self.turn_close!r}: {hist[-120:]!r}"
            )
        return self.encode(self.closing(model_ids) + full[len(hist) :])

    def closing(self, model_ids: list[int]) -> str:
        """The part of `turn_close` the model did not write at the end of its turn."""
        if model_ids and model_ids[-1] in self.special_ids:
            emitted = self.tokenizer.decode(model_ids[-1:], skip_special_tokens=False)
            if emitted and self.turn_close.startswith(emitted):
                return self.turn_close[len(emitted) :]
        return self.turn_close

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _probe_close(self) -> str:
        convo = (Message("user", _USER), Message("assistant", _ASSISTANT))
        text = self.render(convo, (), generation=False)
        if text.count(_ASSISTANT) != 1:
            raise TemplateError("the chat template drops or repeats assistant content")
        return text[text.index(_ASSISTANT) + len(_ASSISTANT) :]


def _renders_tools(tokenizer: Any) -> bool:
    """Whether the template itself renders tool definitions, calls and results."""
    spec = {
        "type": "function",
        "function": {"name": _TOOL, "description": "d", "parameters": {"type": "object"}},
    }
    call = {"id": "c1", "type": "function", "function": {"name": _TOOL, "arguments": {"a": 1}}}
    convo = [
        {"role": "user", "content": _USER},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": _RESULT},
    ]
    try:
        defs = tokenizer.apply_chat_template(
            convo[:1], tools=[spec], tokenize=False, add_generation_prompt=True
        )
        calls = tokenizer.apply_chat_template(
            convo, tools=[spec], tokenize=False, add_generation_prompt=True
        )
    except Exception:
        return False
    return _TOOL in defs and calls.count(_TOOL) >= 2 and _RESULT in calls


def _hermes_in_text(messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> list[dict]:
    """`messages` in plain roles for a template without tool support (see the module doc)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = message.content
        if message.tool_calls:
            calls = "\n".join(_call_text(call) for call in message.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": message.role, "content": content})
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    for message in out:
        message.pop("_tool_results", None)
    return out


def _call_text(call: ToolCall) -> str:
    body = {"name": call.name, "arguments": call.arguments}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


_TEMPLATES: dict[tuple[int, str], tuple[Any, ChatTemplate]] = {}


def template_for(tokenizer: Any, tool_format: ToolFormatOption = "auto") -> ChatTemplate:
    """The (cached) `ChatTemplate` of `tokenizer`."""
    key = (id(tokenizer), tool_format)
    cached = _TEMPLATES.get(key)
    if cached is None or cached[0] is not tokenizer:
        cached = _TEMPLATES[key] = (tokenizer, ChatTemplate(tokenizer, tool_format))
    return cached[1]
