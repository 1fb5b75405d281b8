"""The embedded engine's HTTP server: SGLang's native protocol in front of `EngineCore`.

    aiohttp app ─ /generate ───────────► protocol.parse_generate ─► pause gate ─► core
                ─ health, info, load ──► this module
                ─ pause, continue, abort, flush
                ─ weight routes ───────► weight_endpoints.WeightEndpoints

While paused, new `/generate` calls wait in the server until
`/continue_generation` (an abort ends the wait with an empty abort result);
`/abort_request {rid}` aborts that rid and its n-expansion samples (`rid-j`).
The request and response bodies are `streamrl.engine.protocol`'s; docs/engine.md
lists the subset and where the embedded engine differs from SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from streamrl.engine.core import EngineCore, Output, Request, SamplingParams
from streamrl.engine.options import EngineOptions
from streamrl.engine.protocol import (
    SSE_DONE,
    BadRequest,
    GenerateCall,
    TextDecoder,
    aborted_before_start,
    error_response,
    json_response,
    parse_generate,
    read_json,
    render_result,
    sse_event,
)
from streamrl.engine.weight_endpoints import WeightEndpoints

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass
class _Flight:
    """A request the server holds: waiting at the pause gate or inside the core."""

    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    is_in_core: bool = False


class EngineServer:
    """The aiohttp application around one `EngineCore` (built by `load`)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.model_path = options.model
        """Where the weights came from (`/update_weights_from_disk` changes it)."""
        self.core: EngineCore | None = None
        self._decode: TextDecoder | None = None
        self.is_ready = False
        self.is_closing = False
        self._gate = asyncio.Event()  # set while not paused
        self._gate.set()
        self._flights: dict[str, _Flight] = {}
        self._warned_keys: set[str] = set()
        self.num_finished_reqs = 0  # samples answered by /generate since start
        self.weights = WeightEndpoints(
            lambda: self.core,
            abort_all=lambda: self._abort(None),
            on_loaded_from_disk=self._loaded_from_disk,
        )
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------
    async def load(self) -> None:
        """Build and start the core in a worker thread; /health turns 200 after."""
        self.core = await asyncio.to_thread(EngineCore, self.options)
        self._decode = TextDecoder(self.core.tokenizer)
        self.core.start()
        self.is_ready = True

    async def close(self) -> None:
        """Refuse new work; calls held by a pause and requests in the core end as aborts."""
        self.is_closing = True
        for flight in self._flights.values():
            flight.aborted.set()
        self._gate.set()
        if self.core is not None:
            # Aborts everything queued or running (partial outputs), then stops the thread.
            await asyncio.to_thread(self.core.shutdown)

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._errors])
        get = [
            ("/health", self.health),
            ("/health_generate", self.health_generate),
            ("/model_info", self.model_info),
            ("/get_model_info", self.model_info),
            ("/server_info", self.server_info),
            ("/get_server_info", self.server_info),
            ("/get_load", self.get_load),
        ]
        post = [
            ("/generate", self.generate),
            ("/flush_cache", self.flush_cache),
            ("/abort_request", self.abort_request),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
            *self.weights.routes(),
        ]
        for path, handler in get:
            app.router.add_get(path, handler)
        for path, handler in post:
            app.router.add_post(path, handler)
        # SGLang answers both verbs on these.
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_post("/health_generate", self.health_generate)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        if not self.is_ready and request.path not in ("/health", "/health_generate"):
            return error_response("the engine is still loading", 503)
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(f"{type(exc).__name__}: {exc}", 500)

    # ---- health and info -------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.is_ready or self.is_closing:
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """A one-token generation; while paused it reports healthy without generating, and
        while busy a decode step completing is the proof of health (as SGLang does: a full
        batch would make the probe wait for a free slot, not for a hung engine)."""
        if not self.is_ready or self.is_closing:
            return web.Response(status=503)
        if self.core.is_paused:
            return web.Response(status=200)
        if self.core.num_running > 0:
            return web.Response(status=200 if await self._makes_progress() else 503)
        tokenizer = self.core.tokenizer
        token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
        probe = Request(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=[token],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(self.core.generate([probe]), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _makes_progress(self) -> bool:
        """True once the core completes a decode step within the health timeout. The counter
        lives in the engine thread, so this samples it (every 50 ms) rather than awaiting it."""
        loop = asyncio.get_running_loop()
        start = self.core.stats["decode_steps"]
        deadline = loop.time() + HEALTH_GENERATE_TIMEOUT_S
        while loop.time() < deadline:
            await asyncio.sleep(0.05)
            if self.core.stats["decode_steps"] != start or self.core.num_running == 0:
                return True
        return False

    def _loaded_from_disk(self, model_path: str) -> None:
        self.model_path = model_path

    def _model_info(self) -> dict:
        info = dict(self.core.model_info)
        info["weight_version"] = self.core.weight_version
        info["model_path"] = self.model_path
        return info

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(self._model_info())

    def _load(self) -> dict:
        num_gated = sum(not flight.is_in_core for flight in self._flights.values())
        return {
            "dp_rank": 0,
            "num_reqs": self.core.num_running + self.core.num_waiting + num_gated,
            "num_running_reqs": self.core.num_running,
            "num_waiting_reqs": self.core.num_waiting,
            "num_paused_reqs": num_gated,
            "num_finished_reqs": self.num_finished_reqs,
            "is_receiving_weights": self.weights.is_receiving,
            "is_paused": self.core.is_paused,
            "weight_version": self.core.weight_version,
            # streamrl additions (not in SGLang): the engine's busy clock for benchmarks.
            "busy_s": self.core.busy_s,
            "uptime_s": self.core.uptime_s,
            "generated_tokens": self.core.scheduler.stats["generated_tokens"],
            "decode_steps": self.core.scheduler.stats["decode_steps"],
        }

    async def server_info(self, request: web.Request) -> web.Response:
        import streamrl

        info = msgspec.structs.asdict(self.options)
        info.update(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.options.tokenizer or self.model_path,
            }
        )
        info.update(
            {
                "tp_size": 1,
                "dp_size": 1,
                "device": str(self.core.device),
                "weight_version": self.core.weight_version,
                "version": f"streamrl-{getattr(streamrl, '__version__', '0')}",
                "internal_states": [self._load()],
            }
        )
        return json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        return json_response([self._load()])

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        if self.is_closing:
            return error_response("the engine is shutting down", 503)
        call = parse_generate(
            await read_json(request),
            tokenizer=self.core.tokenizer,
            in_flight=self._flights,
            warned=self._warned_keys,
        )
        if call.stream:
            return await self._stream(request, call, start)
        outputs = await self._run(call, self._requests(call))
        latency_s = time.perf_counter() - start
        results = [self._render(call, output, latency_s) for output in outputs]
        return json_response(results[0] if call.is_single else results)

    def _requests(self, call: GenerateCall, on_token=None) -> list[Request]:
        """The core requests of a parsed call (ValueError is a 400: checked before running)."""
        requests = [
            Request(
                rid=rid,
                input_ids=prompt,
                params=params,
                return_routed_experts=call.return_routed_experts,
                on_token=on_token,
            )
            for rid, prompt, params in zip(call.rids, call.prompts, call.params, strict=True)
        ]
        try:
            self.core.check(requests)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return requests

    async def _run(self, call: GenerateCall, requests: list[Request]) -> list[Output]:
        """Hold the call at the pause gate, run what was not aborted there; outputs in call order."""
        flights = {rid: _Flight() for rid in call.rids}
        self._flights.update(flights)
        try:
            await self._wait_for_gate(flights)
            to_run = [r for r in requests if not flights[r.rid].aborted.is_set()]
            for request_ in to_run:
                flights[request_.rid].is_in_core = True
            ran = await self.core.generate(to_run) if to_run else []
        finally:
            for rid in call.rids:
                self._flights.pop(rid, None)
        self.num_finished_reqs += len(call.rids)
        if len(ran) == len(requests):
            return ran
        by_rid = {output.rid: output for output in ran}
        return [
            by_rid.get(rid) or aborted_before_start(rid, len(prompt))
            for rid, prompt in zip(call.rids, call.prompts, strict=True)
        ]

    def _render(self, call: GenerateCall, output: Output, latency_s: float) -> dict:
        return render_result(
            call,
            output,
            decode=self._decode,
            weight_version=self.core.weight_version,
            latency_s=latency_s,
        )

    async def _stream(
        self, request: web.Request, call: GenerateCall, start: float
    ) -> web.StreamResponse:
        """Server-sent events: the response up to each token the interval rule marks (see
        `GenerateCall.stream_interval`), then the final one and `[DONE]`."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[str] = []
        marks: list[int] = []  # token counts to send an event at, oldest first
        arrived = asyncio.Event()
        interval = call.stream_interval

        def on_token(token: int, logprob: float, version: str) -> None:
            tokens.append(token)
            logprobs.append(logprob)
            versions.append(version)
            if interval == 1 or len(tokens) % interval == 1:
                marks.append(len(tokens))
                arrived.set()

        async def send(output: Output) -> None:
            elapsed = time.perf_counter() - start
            await response.write(sse_event(self._render(call, output, elapsed)))

        def upto(count: int) -> Output:
            return Output(
                rid=call.rids[0],
                output_ids=tokens[:count],
                logprobs=logprobs[:count],
                versions=versions[:count],
                finish_reason=None,
                prompt_tokens=len(call.prompts[0]),
            )

        requests = self._requests(call, on_token)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        run = asyncio.ensure_future(self._run(call, requests))
        try:
            while not run.done():
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait([run, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                arrived.clear()
                while marks and not run.done():
                    await send(upto(marks.pop(0)))
            (output,) = run.result()
            for count in marks:  # marked before the end; the final event covers the last one
                if count < len(output.output_ids):
                    await send(upto(count))
            await send(output)
            await response.write(SSE_DONE)
        finally:
            run.cancel()  # a client gone mid-stream: cancelling aborts the request in the core
        await response.write_eof()
        return response

    async def _wait_for_gate(self, flights: dict[str, _Flight]) -> None:
        """Wait while paused, or until every request of the call is aborted."""
        while not self._gate.is_set() and not all(f.aborted.is_set() for f in flights.values()):
            waits = [asyncio.ensure_future(self._gate.wait())]
            waits += [asyncio.ensure_future(f.aborted.wait()) for f in flights.values()]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    # ---- control ---------------------------------------------------------
    def _abort(self, rid: str | None) -> None:
        """Abort one rid (and its `rid-j` samples) or, with None, everything."""
        for flight_rid, flight in list(self._flights.items()):
            if rid is None or flight_rid == rid or flight_rid.startswith(f"{rid}-"):
                flight.aborted.set()
                if rid is not None and flight.is_in_core:
                    self.core.abort(flight_rid)
        if rid is None:
            self.core.abort(None)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("abort_all"):
            self._abort(None)
        elif body.get("rid"):
            self._abort(str(body["rid"]))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.core.flush_cache():
            return web.Response(status=200, text="Cache flushed.")
        return web.Response(status=400, text="Cache not flushed: requests are running.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_json(request)).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._gate.clear()
        await self.core.pause(mode)
        return json_response({"message": f"Generation paused ({mode}).", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.core.resume()
        self._gate.set()
        return json_response({"message": "Generation continued.", "status": "ok"})
