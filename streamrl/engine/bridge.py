"""The embedded engine split in two processes: HTTP in one, the model in the other.

With `--http-process on` (the default on CUDA), `streamrl engine serve` answers HTTP in
its own process and runs `EngineCore` in a child process. Both are Python, and one
process has one GIL: in a single process the HTTP thread's parsing and rendering (a
burst of requests at once) and the engine thread's step loop take turns, and each
device step waits for the GIL. Split, the engine process does next to nothing per
request: generation crosses as msgpack frames over ZeroMQ (local `ipc://` sockets).

    HTTP process (`front.FrontServer`)              engine process (`serve` + `CoreBridge`)
    /generate, pause, continue, abort               every other route, on its own
      GenerateEndpoints over `RemoteCore` ──────►     loopback port, proxied as it is
        Submit / Abort / Pause / Resume   PUSH ─►PULL  `CoreBridge` (event loop thread)
        Finished / Tokens / Refused / Reply PULL◄─PUSH the engine thread (outputs, tokens)
                                                  ◄─PUSH the event loop (refusals, replies)

The engine thread sends a finished request's `Output` (and a streamed request's marked
tokens) itself, from `EngineCore.submit`'s callbacks: no cross-thread wake-up, no event
loop work per output in the engine process. Frames on one socket arrive in order, so a
request's tokens come before its output.

With `--http-processes N` there are N HTTP processes on one port, each with its own pair
of sockets (`addresses(directory, index)`) into the one engine process. What one of them
is asked that concerns them all, the engine process passes on to the others: a pause or
a resume (`Gate`: each closes or opens its own pause gate) and an abort (`Aborting`: each
ends the calls it holds at its gate). An abort by rid reaches the requests of that rid (and
its `rid-j` samples) whichever HTTP process sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from streamrl.engine.core import MemoryReleased, Output, Request, SamplingParams, check_requests

logger = logging.getLogger(__name__)


# -- frames: HTTP process -> engine process ------------------------------------------------


class WireRequest(msgspec.Struct, array_like=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_routed_experts: bool
    stream_interval: int
    streams: bool  # the HTTP process wants `Tokens` frames (its request has `on_tokens`)


class Submit(msgspec.Struct, tag="submit", array_like=True):
    requests: list[WireRequest]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    rid: str | None  # None: everything


class Pause(msgspec.Struct, tag="pause", array_like=True):
    call: int
    mode: str


class Resume(msgspec.Struct, tag="resume", array_like=True):
    pass


# -- frames: engine process -> HTTP process ------------------------------------------------


class Finished(msgspec.Struct, tag="finished", array_like=True):
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    finish_reason: dict
    prompt_tokens: int
    cached_tokens: int
    weight_version: str  # the engine's, when the request finished
    routed_experts: bytes | None = None  # int32, C order, of `routed_shape`
    routed_shape: list[int] = []


class Tokens(msgspec.Struct, tag="tokens", array_like=True):
    rid: str
    ids: list[int]
    logprobs: list[float]
    versions: list[str]


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """A `Submit` the core refused before running any of it."""

    rids: list[str]
    message: str
    memory_released: bool  # MemoryReleased, else a bad request (ValueError)


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call: int
    error: str = ""


class Gate(msgspec.Struct, tag="gate", array_like=True):
    """Another HTTP process paused (``paused``) or resumed generation."""

    paused: bool


class Aborting(msgspec.Struct, tag="aborting", array_like=True):
    """Another HTTP process was asked to abort ``rid`` (None: everything)."""

    rid: str | None


ToEngine = Submit | Abort | Pause | Resume
ToFront = Finished | Tokens | Refused | Reply | Gate | Aborting


def addresses(directory: str, index: int = 0) -> tuple[str, str]:
    """The sockets of HTTP process ``index`` in ``directory``: (requests, outputs)."""
    return f"ipc://{directory}/requests-{index}", f"ipc://{directory}/outputs-{index}"


def _finished(output: Output, weight_version: str) -> Finished:
    routed, shape = None, []
    if output.routed_experts is not None:
        routed, shape = output.routed_experts.tobytes(), list(output.routed_experts.shape)
    return Finished(
        rid=output.rid,
        output_ids=output.output_ids,
        logprobs=output.logprobs,
        versions=output.versions,
        finish_reason=output.finish_reason or {},
        prompt_tokens=output.prompt_tokens,
        cached_tokens=output.cached_tokens,
        weight_version=weight_version,
        routed_experts=routed,
        routed_shape=shape,
    )


def _output(frame: Finished) -> Output:
    routed = None
    if frame.routed_experts is not None:
        import numpy as np

        routed = np.frombuffer(frame.routed_experts, dtype=np.int32).reshape(frame.routed_shape)
    return Output(
        rid=frame.rid,
        output_ids=frame.output_ids,
        logprobs=frame.logprobs,
        versions=frame.versions,
        finish_reason=frame.finish_reason,
        prompt_tokens=frame.prompt_tokens,
        cached_tokens=frame.cached_tokens,
        routed_experts=routed,
    )


def _socket(context, kind: int, address: str, *, bind: bool):
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: the reader is local and drains
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def _log_send_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.error("sending a frame to the engine process failed: %r", sent.exception())


async def _received(sock) -> list[bytes]:
    """The next frame on ``sock`` and every other one already queued behind it (one wake-up
    of the event loop for a burst)."""
    frames = [await sock.recv()]
    with contextlib.suppress(zmq.Again):
        while True:
            frames.append(sock.recv(flags=zmq.NOBLOCK).result())
    return frames


# -- the engine process's end --------------------------------------------------------------


class CoreBridge:
    """Serves `EngineCore` to the HTTP processes (``num_fronts``, their sockets in
    ``directory``: `addresses`, bound by them). Runs on the engine process's event loop;
    outputs and tokens leave from the engine thread on sockets only it uses."""

    def __init__(self, core, directory: str, num_fronts: int = 1) -> None:
        self.core = core
        self._context = zmq.asyncio.Context()
        self._sync_context = zmq.Context()
        self._fronts = [_FrontEnd(self, index, directory) for index in range(num_fronts)]
        self._rids: dict[str, None] = {}
        """The rids in the core, in submission order (an abort by rid finds its samples)."""
        self.num_finished = 0  # outputs sent, for `/get_load`'s num_finished_reqs
        self._tasks: list[asyncio.Task] = []
        self._pauses: set[asyncio.Task] = set()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(front.serve(), name=f"core-bridge-{front.index}")
            for front in self._fronts
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for front in self._fronts:
            front.close()
        self._context.term()
        self._sync_context.term()

    def dispatch(self, front: _FrontEnd, frame) -> None:
        if isinstance(frame, Submit):
            self._submit(front, frame)
        elif isinstance(frame, Abort):
            self._abort(front, frame.rid)
        elif isinstance(frame, Resume):
            self.core.resume()
            self._tell_others(front, Gate(paused=False))
        else:  # answered by a `Reply` when the core has paused
            self._tell_others(front, Gate(paused=True))
            self._pauses.add(pause := asyncio.create_task(self._pause(front, frame)))
            pause.add_done_callback(self._pauses.discard)

    def _submit(self, front: _FrontEnd, frame: Submit) -> None:
        requests = [
            Request(
                rid=wire.rid,
                input_ids=wire.input_ids,
                params=wire.params,
                return_routed_experts=wire.return_routed_experts,
                on_tokens=front.tokens_sender(wire.rid) if wire.streams else None,
                stream_interval=wire.stream_interval,
            )
            for wire in frame.requests
        ]
        rids = [r.rid for r in requests]
        self._rids.update(dict.fromkeys(rids))  # before the engine thread can finish one
        try:
            self.core.submit(requests, front.send_output)
        except (ValueError, MemoryReleased) as error:
            for rid in rids:
                self._rids.pop(rid, None)
            front.reply(Refused(rids, str(error), isinstance(error, MemoryReleased)))

    def _abort(self, front: _FrontEnd, rid: str | None) -> None:
        if rid is None:
            self.core.abort(None)
        else:  # the rid and its n-expansion samples, whichever HTTP process sent them
            prefix = f"{rid}-"
            for known in [r for r in list(self._rids) if r == rid or r.startswith(prefix)]:
                self.core.abort(known)
        self._tell_others(front, Aborting(rid))

    def finished(self, rid: str) -> None:  # on the engine thread
        self._rids.pop(rid, None)
        self.num_finished += 1

    def _tell_others(self, front: _FrontEnd, frame) -> None:
        for other in self._fronts:
            if other is not front:
                other.reply(frame)

    async def _pause(self, front: _FrontEnd, frame: Pause) -> None:
        error = ""
        try:
            await self.core.pause(frame.mode)
        except Exception as exc:  # the caller raises it on its side
            error = f"{type(exc).__name__}: {exc}"
        front.reply(Reply(frame.call, error))


class _FrontEnd:
    """`CoreBridge`'s sockets to one HTTP process: its requests in, replies out (event loop),
    outputs and tokens out (engine thread)."""

    def __init__(self, bridge: CoreBridge, index: int, directory: str) -> None:
        self.bridge = bridge
        self.index = index
        requests_address, outputs_address = addresses(directory, index)
        self._inbox = _socket(bridge._context, zmq.PULL, requests_address, bind=False)
        self._replies = _socket(bridge._context, zmq.PUSH, outputs_address, bind=False)
        # Used by the engine thread alone (a zmq socket belongs to one thread at a time).
        self._outputs = _socket(bridge._sync_context, zmq.PUSH, outputs_address, bind=False)
        self._encoder = msgspec.msgpack.Encoder()  # the engine thread's
        self._reply_encoder = msgspec.msgpack.Encoder()  # the event loop's
        self._decoder = msgspec.msgpack.Decoder(ToEngine)

    def close(self) -> None:
        self._inbox.close()
        self._replies.close()
        self._outputs.close()

    async def serve(self) -> None:
        while True:
            for raw in await _received(self._inbox):
                try:
                    frame = self._decoder.decode(raw)
                except msgspec.DecodeError:  # never from our own HTTP process: say so, go on
                    logger.error(
                        "dropped an undecodable frame of %d bytes from HTTP process %d",
                        len(raw), self.index,
                    )  # fmt: skip
                    continue
                self.bridge.dispatch(self, frame)

    def reply(self, frame) -> None:  # on the event loop
        self._replies.send(self._reply_encoder.encode(frame))

    def send_output(self, output: Output) -> None:  # on the engine thread
        self.bridge.finished(output.rid)
        frame = _finished(output, self.bridge.core.weight_version)
        self._outputs.send(self._encoder.encode(frame))

    def tokens_sender(self, rid: str) -> Callable[[list[int], list[float], list[str]], None]:
        def send(ids: list[int], logprobs: list[float], versions: list[str]) -> None:
            self._outputs.send(self._encoder.encode(Tokens(rid, ids, logprobs, versions)))

        return send


# -- the HTTP process's end ----------------------------------------------------------------


class EngineGone(RuntimeError):
    """The engine process exited while requests were in it."""


class RemoteCore:
    """What `GenerateEndpoints` needs of `EngineCore`, served by the engine process over
    the bridge. `connect` binds the sockets (before the engine process starts); `attach`
    takes the engine's `/model_info` and the tokenizer once it is up."""

    def __init__(self, requests_address: str, outputs_address: str) -> None:
        self._context = zmq.asyncio.Context()
        self._outbox = _socket(self._context, zmq.PUSH, requests_address, bind=True)
        self._inbox = _socket(self._context, zmq.PULL, outputs_address, bind=True)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToFront)
        self._outputs: dict[str, asyncio.Future] = {}
        self._streams: dict[str, Callable] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._calls = itertools.count()
        self._queued: list[WireRequest] = []  # `generate` calls of this turn of the loop
        self._reader: asyncio.Task | None = None
        self._gone: str = ""
        self.tokenizer: Any = None
        self.model_info: dict = {}
        self.weight_version = ""
        self.memory_refusal = ""  # the engine process refuses (`Refused`): nothing known here
        self.on_gate: Callable[[bool], None] = lambda paused: None
        """Called when another HTTP process paused (True) or resumed (False) generation."""
        self.on_aborting: Callable[[str | None], None] = lambda rid: None
        """Called when another HTTP process was asked to abort a rid (None: everything)."""

    def attach(self, model_info: dict, tokenizer: Any) -> None:
        self.model_info = model_info
        self.weight_version = model_info.get("weight_version", "")
        self.tokenizer = tokenizer
        self._reader = asyncio.create_task(self._read(), name="remote-core")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._outbox.close()
        self._inbox.close()
        self._context.term()

    def engine_gone(self, message: str) -> None:
        """Fail every request and call waiting on the engine process (it exited)."""
        self._gone = message
        for future in [*self._outputs.values(), *self._replies.values()]:
            if not future.done():
                future.set_exception(EngineGone(message))
        self._outputs.clear()
        self._replies.clear()
        self._streams.clear()

    # -- what GenerateEndpoints calls -------------------------------------------------------

    def check(self, requests: list[Request]) -> None:
        check_requests(requests, self.model_info["vocab_size"], self.model_info["max_seq_len"])

    async def generate(self, requests: list[Request]) -> list[Output]:
        if self._gone:
            raise EngineGone(self._gone)
        loop = asyncio.get_running_loop()
        futures = []
        wires = []
        for request in requests:
            future = loop.create_future()
            self._outputs[request.rid] = future
            futures.append(future)
            if request.on_tokens is not None:
                self._streams[request.rid] = request.on_tokens
            wires.append(
                WireRequest(
                    rid=request.rid,
                    input_ids=request.input_ids,
                    params=request.params,
                    return_routed_experts=request.return_routed_experts,
                    stream_interval=request.stream_interval,
                    streams=request.on_tokens is not None,
                )
            )
        if not self._queued:  # one Submit for every call made in this turn of the loop
            loop.call_soon(self._flush)
        self._queued.extend(wires)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for request in requests:
                self.abort(request.rid)
            raise
        finally:
            for request in requests:
                self._outputs.pop(request.rid, None)
                self._streams.pop(request.rid, None)

    def abort(self, rid: str | None = None) -> None:
        self._send_nowait(Abort(rid))

    async def pause(self, mode: str = "abort") -> None:
        call = next(self._calls)
        reply = self._replies[call] = asyncio.get_running_loop().create_future()
        self._send_nowait(Pause(call, mode))
        try:
            error = await reply
        finally:
            self._replies.pop(call, None)
        if error:
            raise ValueError(error)

    def resume(self) -> None:
        self._send_nowait(Resume())

    def _send_nowait(self, frame) -> None:
        self._flush()  # requests queued before this frame reach the engine before it
        self._send(frame)

    def _flush(self) -> None:
        """Send the queued requests as one `Submit` (a burst of HTTP requests handled in one
        turn of the event loop: one frame, one decode and one `submit` in the engine)."""
        if self._queued:
            wires, self._queued = self._queued, []
            if not self._gone:  # else their futures failed with `EngineGone` already
                self._send(Submit(wires))

    def _send(self, frame) -> None:
        """Send without waiting: at once, or (no engine end connected yet) as soon as one
        is, after the frames sent before it. Never with NOBLOCK, which would raise with no
        peer connected and jump the queue of frames still waiting."""
        sent = self._outbox.send(self._encoder.encode(frame))
        sent.add_done_callback(_log_send_failure)

    # -- frames from the engine process -----------------------------------------------------

    async def _read(self) -> None:
        while True:
            for raw in await _received(self._inbox):
                self._dispatch(raw)

    def _dispatch(self, raw: bytes) -> None:
        try:
            frame = self._decoder.decode(raw)
        except msgspec.DecodeError:
            logger.error("dropped an undecodable frame of %d bytes from the engine", len(raw))
            return
        if isinstance(frame, Tokens):
            deliver = self._streams.get(frame.rid)
            if deliver is not None:
                deliver(frame.ids, frame.logprobs, frame.versions)
        elif isinstance(frame, Finished):
            self.weight_version = frame.weight_version
            self._resolve(self._outputs.get(frame.rid), result=_output(frame))
        elif isinstance(frame, Refused):
            error_type = MemoryReleased if frame.memory_released else ValueError
            for rid in frame.rids:
                self._resolve(self._outputs.get(rid), error=error_type(frame.message))
        elif isinstance(frame, Reply):
            self._resolve(self._replies.get(frame.call), result=frame.error)
        elif isinstance(frame, Gate):
            self.on_gate(frame.paused)
        else:
            self.on_aborting(frame.rid)

    @staticmethod
    def _resolve(future: asyncio.Future | None, *, result=None, error=None) -> None:
        if future is None or future.done():
            return  # a request aborted and answered already, or cancelled by its caller
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
