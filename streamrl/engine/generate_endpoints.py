"""The embedded engine's generation endpoints: `/generate` and what holds it.

    /generate             parse (`streamrl.engine.protocol`) ─► pause gate ─► core ─► render
                          (JSON, or server-sent events with `stream`)
    /pause_generation     close the gate (new calls wait in the server), pause the core
    /continue_generation  resume the core, open the gate
    /abort_request        abort one rid and its n-expansion samples (`rid-j`), or all

While paused, new `/generate` calls wait at the gate until `/continue_generation`; an
abort ends the wait with an empty abort result. With several HTTP processes
(`--http-processes`) each has its gate, closed and opened together: the engine process
tells the others of a pause, a resume or an abort (`hold`, `abort_gated`). Every call the server holds, at the gate
or in the core, is a flight until it is answered. While the engine's memory is released
(`streamrl.engine.memory_endpoints`) a call that reaches the core is refused with 400.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from streamrl.engine.core import EngineCore, MemoryReleased, Output, Request
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
from streamrl.engine.runner.scheduler import PAUSE_MODES


@dataclass
class _Flight:
    """A request the server holds: waiting at the pause gate or inside the core."""

    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    is_in_core: bool = False


class GenerateEndpoints:
    """Generation, the pause gate and aborts over one `EngineCore` (`core()` once loaded)."""

    def __init__(self, core: Callable[[], EngineCore | None], *, is_shared: bool = False) -> None:
        self._core = core
        self._is_shared = is_shared
        """Whether other HTTP processes share the core (`--http-processes`)."""
        self._decode: TextDecoder | None = None
        self._gate = asyncio.Event()  # set while not paused
        self._gate.set()
        self._flights: dict[str, _Flight] = {}
        self._warned_keys: set[str] = set()
        self.is_closing = False
        self.num_finished_reqs = 0  # samples answered by /generate since start

    def routes(self) -> list[tuple[str, Callable]]:
        """(path, handler) of every POST endpoint here."""
        return [
            ("/generate", self.generate),
            ("/abort_request", self.abort_request),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
        ]

    @property
    def num_gated(self) -> int:
        """Requests waiting at the pause gate (not yet in the core)."""
        return sum(not flight.is_in_core for flight in self._flights.values())

    def close(self) -> None:
        """Refuse new calls; calls held at the gate end as aborts."""
        self.is_closing = True
        for flight in self._flights.values():
            flight.aborted.set()
        self._gate.set()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        if self.is_closing:
            return error_response("the engine is shutting down", 503)
        if self._gate.is_set() and self._core().memory_refusal:  # (a paused call waits)
            raise BadRequest(self._core().memory_refusal)
        call = parse_generate(
            await read_json(request),
            tokenizer=self._core().tokenizer,
            in_flight=self._flights,
            warned=self._warned_keys,
        )
        if call.stream:
            return await self._stream(request, call, start)
        outputs = await self._run(call, self._requests(call))
        latency_s = time.perf_counter() - start
        results = [self._render(call, output, latency_s) for output in outputs]
        return json_response(results[0] if call.is_single else results)

    def _requests(self, call: GenerateCall, on_tokens=None) -> list[Request]:
        """The core requests of a parsed call (ValueError is a 400: checked before running)."""
        requests = [
            Request(
                rid=rid,
                input_ids=prompt,
                params=params,
                return_routed_experts=call.return_routed_experts,
                on_tokens=on_tokens,
                stream_interval=call.stream_interval,
            )
            for rid, prompt, params in zip(call.rids, call.prompts, call.params, strict=True)
        ]
        try:
            self._core().check(requests)
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
            ran = await self._core().generate(to_run) if to_run else []
        except MemoryReleased as exc:  # the gate opened on released memory
            raise BadRequest(str(exc)) from None
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
        core = self._core()
        if self._decode is None:
            self._decode = TextDecoder(core.tokenizer)
        return render_result(
            call,
            output,
            decode=self._decode,
            weight_version=core.weight_version,
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

        def on_tokens(ids: list[int], lps: list[float], vers: list[str]) -> None:
            # The core calls this at each token the interval rule marks.
            tokens.extend(ids)
            logprobs.extend(lps)
            versions.extend(vers)
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

        requests = self._requests(call, on_tokens)
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

    def abort(self, rid: str | None) -> None:
        """Abort one rid (and its `rid-j` samples) or, with None, everything."""
        for flight_rid, flight in list(self._flights.items()):
            if rid is None or flight_rid == rid or flight_rid.startswith(f"{rid}-"):
                flight.aborted.set()
                if rid is not None and flight.is_in_core and not self._is_shared:
                    self._core().abort(flight_rid)
        if rid is None or self._is_shared:
            # (with several HTTP processes the rid may be another's: the engine process
            # finds its requests and their samples, and tells the others, `engine.bridge`)
            self._core().abort(rid)

    def abort_gated(self, rid: str | None) -> None:
        """Another HTTP process was asked to abort ``rid`` (None: everything): end the calls
        of it held at this one's gate (the engine process aborted those in it)."""
        for flight_rid, flight in list(self._flights.items()):
            matches = rid is None or flight_rid == rid or flight_rid.startswith(f"{rid}-")
            if matches and not flight.is_in_core:
                flight.aborted.set()

    def hold(self, paused: bool) -> None:
        """Another HTTP process paused (True) or resumed generation: close or open the gate."""
        if paused:
            self._gate.clear()
        else:
            self._gate.set()

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("abort_all"):
            self.abort(None)
        elif body.get("rid"):
            self.abort(str(body["rid"]))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_json(request)).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._gate.clear()
        await self._core().pause(mode)
        return json_response({"message": f"Generation paused ({mode}).", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._core().resume()
        self._gate.set()
        return json_response({"message": "Generation continued.", "status": "ok"})
