"""Server-sent events: the framing both APIs stream in.

OpenAI sends `data: {json}` events and ends with `data: [DONE]`; Anthropic names each
event (`event: message_start` then `data: {json}`). A streamed reply is generated
first and then sent as events (the engine call is not streamed), so the events carry
exactly the text, tool calls and usage of the non-streamed reply; `split_text` cuts the
text where its tokens end, so clients see token-sized deltas.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
        },
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, data: Any, *, event: str | None = None) -> None:
    """One event: `data` is JSON-encoded unless it is a string (`[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {payload}\n\n".encode())


def split_text(tokenizer: Any, output_ids: list[int], text: str) -> list[tuple[str, int]]:
    """`text` as (piece, number of tokens) deltas: each token's new text while the decoded
    tokens stay a prefix of `text`, then the rest in one piece. The pieces join to `text`."""
    pieces: list[tuple[str, int]] = []
    emitted = ""
    pending = 0
    for end in range(1, len(output_ids) + 1):
        decoded = tokenizer.decode(output_ids[:end], skip_special_tokens=True)
        pending += 1
        if decoded.endswith("\ufffd") or not text.startswith(decoded):
            continue  # half a character, or text the reply does not show (a tool call)
        if len(decoded) > len(emitted):
            pieces.append((decoded[len(emitted) :], pending))
            emitted, pending = decoded, 0
        if emitted == text:
            break
    if len(emitted) < len(text):
        pieces.append((text[len(emitted) :], pending))
    return pieces
