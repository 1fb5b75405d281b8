"""OpenAI's Chat Completions and Completions formats: requests in, replies and chunks out.

Requests: `messages` (roles system / developer / user / assistant / tool; text content,
as a string or text parts), `tools` (`type: function`), `tool_choice` (`none` turns
parsing off; other values are accepted but not enforced: there is no constrained
decoding), `n`, `temperature`, `top_p`, `top_k` (an extension), `max_tokens` /
`max_completion_tokens`, `stop`, `seed`, `logprobs`, `top_logprobs`, `stream`,
`stream_options.include_usage`; other fields are ignored, as OpenAI-compatible servers
do. Replies carry the chosen token's logprob (`top_logprobs` lists are empty: engines
return only the sampled token's), `system_fingerprint` = "streamrl-v<weight version>".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from streamrl.agents.gateway.calls import ChatRequest, Choice, Reply, Sampling, TextRequest
from streamrl.agents.gateway.messages import (
    Message,
    RequestError,
    ToolSpec,
    decode_arguments,
    text_of,
)
from streamrl.agents.gateway.sse import split_text
from streamrl.agents.gateway.tool_calls import ToolCall

_ROLES = {"system": "system", "developer": "system", "user": "user"}
_ROLES.update(assistant="assistant", tool="tool")


# ---------------------------------------------------------------- requests


def parse_chat(body: dict[str, Any]) -> tuple[ChatRequest, dict[str, Any]]:
    """A `/v1/chat/completions` body -> the request and its output flags."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: a non-empty list is required")
    messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(raw))
    tools = parse_tools(body.get("tools"))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise RequestError(
            "response_format: only type 'text' is supported (no constrained decoding)"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    request = ChatRequest(
        messages=messages,
        tools=tools,
        sampling=parse_sampling(body, max_tokens),
        parse_tools=body.get("tool_choice") != "none",
    )
    return request, _flags(body)


def parse_completion(body: dict[str, Any]) -> tuple[TextRequest, dict[str, Any]]:
    """A `/v1/completions` body -> the request and its output flags."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if body.get("suffix") is not None:
        raise RequestError("suffix: not supported")
    request = TextRequest(sampling=parse_sampling(body, body.get("max_tokens", 16)))
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        request.prompt_ids = list(prompt)
    else:
        raise RequestError("prompt: one string or one list of token ids is supported")
    flags = _flags(body)
    flags["echo"] = bool(body.get("echo"))
    if flags["echo"] and request.prompt is None:
        raise RequestError("echo: needs a text prompt")
    return request, flags


def parse_tools(raw: Any) -> tuple[ToolSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("tools: must be a list")
    tools = []
    for index, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise RequestError(
                f"tools[{index}]: only {{'type': 'function', 'function': ...}} tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{index}].function.name: required")
        tools.append(
            ToolSpec.make(
                name, str(function.get("description") or ""), function.get("parameters") or {}
            )
        )
    return tuple(tools)


def parse_sampling(body: dict[str, Any], max_tokens: Any) -> Sampling:
    stop = body.get("stop", body.get("stop_sequences"))
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop: a string or a list of strings")
    sampling = Sampling(
        max_tokens=_number(body, "max_tokens", max_tokens, int, minimum=1),
        n=_number(body, "n", body.get("n"), int, minimum=1) or 1,
        stop=tuple(s for s in stop or () if s),
        temperature=_number(body, "temperature", body.get("temperature"), float, minimum=0),
        top_p=_number(body, "top_p", body.get("top_p"), float, minimum=0),
        top_k=_number(body, "top_k", body.get("top_k"), int, minimum=-1),
        seed=_number(body, "seed", body.get("seed"), int),
    )
    return sampling


def _number(body, key: str, value: Any, kind: type, minimum: float | None = None):
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and value != int(value))
    ):
        raise RequestError(
            f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    if minimum is not None and value < minimum:
        raise RequestError(f"{key}: must be >= {minimum}, got {value!r}")
    return kind(value)


def _flags(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("stream_options") or {}
    logprobs = body.get("logprobs")  # chat: a bool; completions: how many top entries (>= 0)
    wants_logprobs = logprobs is True or (type(logprobs) is int and logprobs >= 0)
    return {
        "model": str(body.get("model") or ""),
        "stream": bool(body.get("stream")),
        "include_usage": bool(options.get("include_usage")) if isinstance(options, dict) else False,
        "logprobs": wants_logprobs,
    }


def _message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise RequestError(f"{where}: must be an object")
    role = _ROLES.get(raw.get("role"))
    if role is None:
        raise RequestError(f"{where}.role: {raw.get('role')!r} is not supported")
    calls = []
    for index, call in enumerate(raw.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{index}]: needs function.name")
        arguments = decode_arguments(
            function.get("arguments", "{}"), f"{where}.tool_calls[{index}]"
        )
        calls.append(ToolCall(function["name"], arguments, id=str(call.get("id") or "")))
    return Message(
        role=role,
        content=text_of(raw.get("content"), f"{where}.content"),
        tool_calls=tuple(calls),
        tool_call_id=raw.get("tool_call_id"),
        name=raw.get("name") if role != "tool" else None,
    )


# ---------------------------------------------------------------- replies


def chat_response(reply: Reply, flags: dict, tokenizer: Any) -> dict[str, Any]:
    return {
        **_head(reply, flags, "chat.completion", "chatcmpl-"),
        "choices": [
            {
                "index": choice.index,
                "message": _assistant(choice),
                "logprobs": {"content": _logprobs(tokenizer, choice), "refusal": None}
                if flags["logprobs"]
                else None,
                "finish_reason": choice.finish,
            }
            for choice in reply.choices
        ],
        "usage": _usage(reply),
    }


def chat_chunks(reply: Reply, flags: dict, tokenizer: Any) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk` events of a reply (then the caller sends `[DONE]`)."""
    head = _head(reply, flags, "chat.completion.chunk", "chatcmpl-")

    def chunk(index: int, delta: dict, logprobs=None, finish=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    for choice in reply.choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
        entries = _logprobs(tokenizer, choice) if flags["logprobs"] else []
        for piece, entry_slice in _pieces(tokenizer, choice, len(entries)):
            logprobs = (
                {"content": entries[entry_slice], "refusal": None} if flags["logprobs"] else None
            )
            yield chunk(choice.index, {"content": piece}, logprobs)
        for position, call in enumerate(choice.tool_calls):
            start = {"index": position, "id": call.id, "type": "function"}
            yield chunk(
                choice.index,
                {"tool_calls": [{**start, "function": {"name": call.name, "arguments": ""}}]},
            )
            arguments = {"index": position, "function": {"arguments": call.arguments_json}}
            yield chunk(choice.index, {"tool_calls": [arguments]})
        yield chunk(choice.index, {}, finish=choice.finish)
    if flags["include_usage"]:
        yield {**head, "choices": [], "usage": _usage(reply)}


def completion_response(reply: Reply, flags: dict, tokenizer: Any, prompt: str | None) -> dict:
    echo = prompt if flags.get("echo") else ""
    return {
        **_head(reply, flags, "text_completion", "cmpl-"),
        "choices": [
            {
                "index": choice.index,
                "text": echo + choice.text,
                "logprobs": _text_logprobs(tokenizer, choice) if flags["logprobs"] else None,
                "finish_reason": "length" if choice.finish == "length" else "stop",
            }
            for choice in reply.choices
        ],
        "usage": _usage(reply),
    }


def completion_chunks(reply: Reply, flags: dict, tokenizer: Any, prompt: str | None):
    head = _head(reply, flags, "text_completion", "cmpl-")
    for choice in reply.choices:
        pieces = ([prompt] if flags.get("echo") and prompt else []) + [
            piece for piece, _ in split_text(tokenizer, choice.output_ids, choice.text)
        ]
        for piece in pieces:
            body = {"index": choice.index, "text": piece, "logprobs": None, "finish_reason": None}
            yield {**head, "choices": [body]}
        finish = "length" if choice.finish == "length" else "stop"
        body = {"index": choice.index, "text": "", "logprobs": None, "finish_reason": finish}
        yield {**head, "choices": [body]}
    if flags["include_usage"]:
        yield {**head, "choices": [], "usage": _usage(reply)}


def models_response(model_name: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "streamrl"}],
    }


def error_body(error: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": error.kind, "param": None, "code": None}}


def _head(reply: Reply, flags: dict, kind: str, prefix: str) -> dict[str, Any]:
    return {
        "id": prefix + uuid.uuid4().hex[:24],
        "object": kind,
        "created": reply.created,
        "model": flags["model"],
        "system_fingerprint": f"streamrl-v{reply.version}",
    }


def _assistant(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content, "refusal": None}
    if choice.tool_calls:
        message["content"] = choice.content or None
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in choice.tool_calls
        ]
    return message


def _usage(reply: Reply) -> dict[str, int]:
    completion = sum(len(choice.output_ids) for choice in reply.choices)
    return {
        "prompt_tokens": reply.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": reply.num_prompt_tokens + completion,
    }


def _reported_ids(tokenizer: Any, choice: Choice) -> list[int]:
    """Output tokens shown with logprobs: all but a final special token (the eos)."""
    ids = choice.output_ids
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return ids[:-1] if ids and ids[-1] in special else ids


def _logprobs(tokenizer: Any, choice: Choice) -> list[dict[str, Any]]:
    out = []
    for token_id, logprob in zip(_reported_ids(tokenizer, choice), choice.logprobs, strict=False):
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        out.append(
            {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}
        )
    return out


def _text_logprobs(tokenizer: Any, choice: Choice) -> dict[str, Any]:
    entries = _logprobs(tokenizer, choice)
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _pieces(tokenizer: Any, choice: Choice, num_entries: int):
    """Content deltas with the slice of logprob entries each carries (the rest go last)."""
    pieces = split_text(tokenizer, choice.output_ids, choice.content) if choice.content else []
    position = 0
    for number, (piece, num_tokens) in enumerate(pieces):
        end = num_entries if number == len(pieces) - 1 else min(position + num_tokens, num_entries)
        yield piece, slice(position, end)
        position = end
