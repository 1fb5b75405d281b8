"""Anthropic's Messages format: requests in, messages and stream events out.

Requests: `max_tokens` (required), `system` (a string or text blocks), `messages` whose
content is a string or blocks (`text`; `tool_use` in assistant turns; `tool_result` in
user turns, each becoming one `tool` message, with "Error: " before the content of an
`is_error` result), `tools` (`name`, `description`, `input_schema`), `tool_choice`
(`none` turns parsing off; `any` / `tool` are accepted but not enforced),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`. Replies: `text` and
`tool_use` content blocks; `stop_reason` end_turn, max_tokens, stop_sequence or
tool_use; usage in tokens. Streams: message_start, content_block_start /
content_block_delta (text_delta, input_json_delta) / content_block_stop per block,
message_delta, message_stop.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from streamrl.agents.gateway.calls import ChatRequest, Choice, Reply
from streamrl.agents.gateway.messages import Message, RequestError, ToolSpec, text_of
from streamrl.agents.gateway.openai_api import parse_sampling
from streamrl.agents.gateway.sse import split_text
from streamrl.agents.gateway.tool_calls import ToolCall


def parse_messages(body: dict[str, Any]) -> tuple[ChatRequest, dict[str, Any]]:
    """A `/v1/messages` body -> the request and its output flags."""
    if "max_tokens" not in body:
        raise RequestError("max_tokens: required")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: a non-empty list is required")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        messages.append(Message("system", text_of(system, "system")))
    for index, message in enumerate(raw):
        messages.extend(_messages(message, f"messages[{index}]"))
    choice = body.get("tool_choice") or {}
    sampling = parse_sampling(
        {**body, "n": None, "stop": body.get("stop_sequences")}, body["max_tokens"]
    )
    request = ChatRequest(
        messages=tuple(messages),
        tools=_tools(body.get("tools")),
        sampling=sampling,
        parse_tools=not (isinstance(choice, dict) and choice.get("type") == "none"),
    )
    flags = {"model": str(body.get("model") or ""), "stream": bool(body.get("stream"))}
    return request, flags


def _tools(raw: Any) -> tuple[ToolSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("tools: must be a list")
    tools = []
    for index, tool in enumerate(raw):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "custom") != "custom"
            or not tool.get("name")
        ):
            raise RequestError(f"tools[{index}]: only client tools with a name and input_schema")
        schema = tool.get("input_schema") or {}
        tools.append(ToolSpec.make(str(tool["name"]), str(tool.get("description") or ""), schema))
    return tuple(tools)


def _messages(raw: Any, where: str) -> list[Message]:
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where}.role: must be 'user' or 'assistant'")
    role, content = raw["role"], raw.get("content")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: a string or a list of content blocks")
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{index}]"
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("input"), dict):
                raise RequestError(f"{at}.input: must be an object")
            calls.append(
                ToolCall(str(block.get("name")), block["input"], id=str(block.get("id") or ""))
            )
        elif kind == "tool_result" and role == "user":
            text = text_of(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                text = "Error: " + text
            results.append(Message("tool", text, tool_call_id=str(block.get("tool_use_id") or "")))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the gateway never returns them; nothing to render
        else:
            raise RequestError(f"{at}: block type {kind!r} is not supported in a {role} message")
    if role == "assistant":
        return [Message("assistant", "".join(texts), tuple(calls))]
    return results + ([Message("user", "".join(texts))] if texts or not results else [])


def message_response(reply: Reply, flags: dict) -> dict[str, Any]:
    (choice,) = reply.choices
    return {
        **_head(flags),
        "content": _blocks(choice),
        "stop_reason": _stop_reason(choice),
        "stop_sequence": choice.stop_sequence,
        "usage": {"input_tokens": reply.num_prompt_tokens, "output_tokens": len(choice.output_ids)},
    }


def message_events(reply: Reply, flags: dict, tokenizer: Any) -> Iterator[tuple[str, dict]]:
    """(event name, data) of a streamed reply, message_start to message_stop."""
    (choice,) = reply.choices
    start = {
        **_head(flags),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": reply.num_prompt_tokens, "output_tokens": 0},
    }
    yield "message_start", {"type": "message_start", "message": start}
    index = 0
    if choice.content or not choice.tool_calls:
        yield _block_start(index, {"type": "text", "text": ""})
        for piece, _ in split_text(tokenizer, choice.output_ids, choice.content):
            delta = {"type": "text_delta", "text": piece}
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1
    for call in choice.tool_calls:
        yield _block_start(
            index, {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        )
        delta = {"type": "input_json_delta", "partial_json": call.arguments_json}
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1
    delta = {"stop_reason": _stop_reason(choice), "stop_sequence": choice.stop_sequence}
    usage = {"output_tokens": len(choice.output_ids)}
    yield "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}
    yield "message_stop", {"type": "message_stop"}


def models_response(model_name: str) -> dict[str, Any]:
    model = {
        "type": "model",
        "id": model_name,
        "display_name": model_name,
        "created_at": "1970-01-01T00:00:00Z",
    }
    return {"data": [model], "has_more": False, "first_id": model_name, "last_id": model_name}


def error_body(error: RequestError) -> dict[str, Any]:
    kind = error.kind if error.kind in _ERROR_TYPES else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


_ERROR_TYPES = ("invalid_request_error", "not_found_error", "rate_limit_error", "api_error")


def _head(flags: dict) -> dict[str, Any]:
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": flags["model"],
    }


def _blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        blocks.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        arguments = (
            call.arguments if isinstance(call.arguments, dict) else {"input": call.arguments}
        )
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return blocks


def _stop_reason(choice: Choice) -> str:
    if choice.finish == "tool_calls":
        return "tool_use"
    if choice.finish == "length":
        return "max_tokens"
    return "stop_sequence" if choice.stop_sequence else "end_turn"


def _block_start(index: int, block: dict) -> tuple[str, dict]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }
