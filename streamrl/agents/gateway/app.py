"""The gateway's HTTP server: OpenAI and Anthropic endpoints over sessions.

    POST /s/<session>/v1/chat/completions   OpenAI Chat Completions (stream: SSE chunks)
    POST /s/<session>/v1/completions        OpenAI Completions
    POST /s/<session>/v1/messages           Anthropic Messages (stream: SSE events)
    GET  /s/<session>/v1/models             the one model (OpenAI's list, or Anthropic's
                                            when the request has `anthropic-version`)
    GET  /health

The same endpoints without `/s/<session>` take the session from the API key
(`Authorization: Bearer <session>` for OpenAI clients, `x-api-key: <session>` for
Anthropic ones), for agents whose base URL is fixed. An episode's base URLs are
`Session.openai_base_url` (…/s/<session>/v1: the `openai` client appends
/chat/completions) and `anthropic_base_url` (…/s/<session>: the `anthropic` client
appends /v1/messages). A call for a session that is not open (the episode ended) is a
404.

One gateway serves a whole rollout process (`serving` starts it; `streamrl _rollout`
does when `rollout.generate_fn` is the gateway's, binding `rollout.gateway.host/port`).
It binds 127.0.0.1 on a free port unless configured otherwise: anything that can reach
it can generate with the policy.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

import streamrl.agents.gateway.anthropic_api as anthropic_api
import streamrl.agents.gateway.openai_api as openai_api
import streamrl.agents.gateway.sse as sse
from streamrl.agents.api import GenerateContext
from streamrl.agents.gateway.messages import RequestError
from streamrl.agents.gateway.sessions import Session, SessionOptions
from streamrl.agents.gateway.templates import ToolFormatOption, template_for

log = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[Gateway | None] = contextvars.ContextVar(
    "streamrl_gateway", default=None
)


class Gateway:
    """The HTTP server and the open sessions of one process."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy"):
        self.host = host
        self.port = port
        self.model_name = model_name
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/messages", self._messages)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # A client that hangs up cancels its call (and the engine request behind it); at
        # shutdown, calls still running get a few seconds (their episodes are abandoned).
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("agent API gateway on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- sessions

    def open_session(
        self,
        ctx: GenerateContext,
        options: SessionOptions | None = None,
        *,
        tool_format: ToolFormatOption = "auto",
    ) -> Session:
        """A new session for one episode (its id is unguessable: it is also the API key)."""
        session_id = "sess-" + secrets.token_hex(12)
        session = Session(
            session_id, ctx, template_for(ctx.tokenizer, tool_format), options or SessionOptions()
        )
        session.openai_base_url = f"{self.url}/s/{session_id}/v1"
        session.anthropic_base_url = f"{self.url}/s/{session_id}"
        self.sessions[session_id] = session
        return session

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)

    def _session(self, request: web.Request) -> Session:
        session_id = request.match_info.get("session")
        if session_id is None:
            key = request.headers.get("x-api-key") or ""
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                key = key or auth[7:].strip()
            session_id = key
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(
                f"no open session {session_id!r} (its episode ended, or the base URL / API key "
                "does not name one)",
                status=404,
                kind="not_found_error",
            )
        return session

    # ---------------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        if "anthropic-version" in request.headers:
            return _json(anthropic_api.models_response(self.model_name))
        return _json(openai_api.models_response(self.model_name))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            chat, flags = openai_api.parse_chat(await _body(request))
            reply = await session.chat(chat)
        except RequestError as exc:
            return _json(openai_api.error_body(exc), exc.status)
        tokenizer = session.ctx.tokenizer
        if not flags["stream"]:
            return _json(openai_api.chat_response(reply, flags, tokenizer))
        return await _openai_stream(request, openai_api.chat_chunks(reply, flags, tokenizer))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            text, flags = openai_api.parse_completion(await _body(request))
            reply = await session.complete(text)
        except RequestError as exc:
            return _json(openai_api.error_body(exc), exc.status)
        tokenizer = session.ctx.tokenizer
        if not flags["stream"]:
            return _json(openai_api.completion_response(reply, flags, tokenizer, text.prompt))
        chunks = openai_api.completion_chunks(reply, flags, tokenizer, text.prompt)
        return await _openai_stream(request, chunks)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            chat, flags = anthropic_api.parse_messages(await _body(request))
            reply = await session.chat(chat)
        except RequestError as exc:
            return _json(anthropic_api.error_body(exc), exc.status)
        if not flags["stream"]:
            return _json(anthropic_api.message_response(reply, flags))
        stream = await sse.open_stream(request)
        for event, data in anthropic_api.message_events(reply, flags, session.ctx.tokenizer):
            await sse.send(stream, data, event=event)
        return stream


async def _openai_stream(request: web.Request, chunks) -> web.StreamResponse:
    """OpenAI's server-sent events: one `data:` event per chunk, then `data: [DONE]`."""
    stream = await sse.open_stream(request)
    for chunk in chunks:
        await sse.send(stream, chunk)
    await sse.send(stream, "[DONE]")
    return stream


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


@contextlib.asynccontextmanager
async def serving(
    *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy"
) -> AsyncIterator[Gateway]:
    """Run a gateway for the duration of the block; generate functions started inside it
    (in this task or tasks it starts) find it through `current_gateway()`."""
    gateway = Gateway(host=host, port=port, model_name=model_name)
    await gateway.start()
    token = _CURRENT.set(gateway)
    try:
        yield gateway
    finally:
        _CURRENT.reset(token)
        await gateway.stop()


def current_gateway() -> Gateway | None:
    """The gateway `serving` runs for this context, if any."""
    return _CURRENT.get()
