"""The embedded engine's generation core: one thread owns the model, callers await.

Threads: `EngineCore.start` launches one scheduler thread that owns the
runner (model + KV cache) and the `Scheduler`. Every other thread talks to
it only through a command queue: a command is a closure run on the engine
thread between decode steps (with no step in flight), so pause, abort and
weight updates act at step boundaries. Results come back to asyncio callers
through ``loop.call_soon_threadsafe``. The thread blocks on the queue when it
has nothing to run (no polling).

RL semantics kept here (see runner/sampling.py for the logprob convention):
each output token carries the weight version current when its step was
launched; `update_weights` copies in place and changes the version only after
every copy finished; a retracted request keeps its tokens and their versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from streamrl import models
from streamrl.engine.options import EngineOptions
from streamrl.engine.runner.occupation import Occupation
from streamrl.engine.runner.scheduler import PAUSE_MODES, Scheduler
from streamrl.engine.runner.select import build_runner
from streamrl.engine.runner.sequence import Sequence, StopStringChecker
from streamrl.models import devices

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0: whole vocabulary
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # None: drawn from the engine's seeded generator

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError(f"invalid sampling params {self}")
        if self.max_new_tokens < 0 or self.min_new_tokens < 0:
            raise ValueError(f"negative token counts in {self}")


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_routed_experts: bool = False
    on_tokens: Callable[[list[int], list[float], list[str]], None] | None = None
    """Streaming: called with the output tokens (ids, logprobs, versions) produced since its
    previous call (on the caller's event loop for `generate`, on the engine thread for
    `submit`), after each output token that SGLang's
    interval rule marks (token k when k % stream_interval == 1; every token at 1), except
    the token that ends the request: it, and any after the last mark, come only in the
    final `Output`. None: only the final `Output`."""
    stream_interval: int = 1


@dataclass
class Output:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]  # per output token: the weight version its step was launched under
    # {"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}; None while running
    finish_reason: dict | None
    prompt_tokens: int
    cached_tokens: int = 0
    # MoE models on the hf runner, when asked: int32 [prompt + output tokens - 1, layers, top_k]
    routed_experts: Any = None


class EngineCore:
    """Generation over one model; see the module docstring for the threading contract."""

    def __init__(self, options: EngineOptions):
        if options.num_threads > 0:
            torch.set_num_threads(options.num_threads)
        self.options = options
        self.device = devices.resolve_device(options.device)
        self.dtype = devices.resolve_dtype(options.dtype, self.device)
        self.tokenizer = models.load_tokenizer(options.tokenizer or options.model)
        max_prefill_tokens = options.max_prefill_tokens
        if max_prefill_tokens <= 0:
            max_prefill_tokens = 32768 if self.device.type == "cuda" else 4096
        compile_elementwise = options.compile_elementwise
        if compile_elementwise is None:  # measured on the H200: 48.7k -> 70.2k tokens/s at 256
            # On CUDA with graphs or without: eager steps run the kernels the graphs replay.
            compile_elementwise = self.device.type == "cuda"
        self.runner, config = build_runner(
            options.model,
            runner=options.runner,
            device=self.device,
            dtype=self.dtype,
            max_batch_size=options.max_batch_size,
            max_seq_len=options.max_seq_len,
            max_prefill_tokens=max_prefill_tokens,
            cuda_graphs=options.cuda_graphs,
            compile_elementwise=compile_elementwise,
            seed=options.seed,
        )
        if options.lora_adapter:  # a resumed LoRA run: the base plus its checkpoint's adapter
            from streamrl.weights.adapters import read_wire_tensors

            adapter = read_wire_tensors(options.lora_adapter)
            self.runner.load_weights(self.runner.plan_weights(adapter))
        self.max_seq_len = max_seq_len = options.max_seq_len
        self.scheduler = Scheduler(
            self.runner,
            eos_token_ids=_eos_token_ids(self.tokenizer, config),
            max_seq_len=max_seq_len,
            weight_version=options.weight_version,
            seed=options.seed,
            admit_hold_steps=options.admit_hold_steps,
        )
        self.model_info: dict[str, Any] = {
            "model_path": options.model,
            "tokenizer_path": options.tokenizer or options.model,
            "model_type": getattr(config, "model_type", ""),
            "architectures": list(getattr(config, "architectures", None) or []),
            "is_generation": True,
            "max_seq_len": max_seq_len,
            "max_batch_size": options.max_batch_size,
            "vocab_size": config.vocab_size,
            "eos_token_ids": sorted(self.scheduler.eos_token_ids),
            "runner": self.runner.name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        self._commands: queue.SimpleQueue[Callable[[], None] | _Arrival | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self.occupation = Occupation(self.runner)
        """Which memory regions are released (`release_memory`, `resume_memory`)."""
        self.weights_are_stale = False
        """Resumed weights hold zeros until the next update loads some (then False)."""
        self.is_paused = False
        self.busy_s = 0.0
        """Seconds the engine thread spent in scheduler steps (it steps only while requests
        run or wait, so uptime minus this is idle time: paused, or nothing to do)."""
        self._started_at = time.monotonic()

    # -- state read by other threads (plain attribute reads) -------------------

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def stats(self) -> dict:
        return dict(self.scheduler.stats)

    @property
    def memory_refusal(self) -> str:
        """Why generation is refused now ("" when it is not): released memory, or weights
        resumed but not yet updated."""
        if self.occupation.released:
            released = ", ".join(sorted(self.occupation.released))
            return (
                f"the engine's memory is released ({released}): call "
                f"/resume_memory_occupation and load weights first"
            )
        if self.weights_are_stale:
            return "the engine's weights were released and not updated since the resume"
        return ""

    @property
    def uptime_s(self) -> float:
        """Seconds since `start` (the clock `busy_s` is measured against)."""
        return time.monotonic() - self._started_at

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="streamrl-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort everything still queued or running, then stop the engine thread."""
        if self._thread is None:
            return
        self._commands.put(lambda: self.scheduler.abort(None, "engine shut down"))
        self._commands.put(None)
        self._thread.join(timeout=60)
        self._thread = None

    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            try:
                command = self._commands.get(block=not scheduler.has_work())
            except queue.Empty:
                command = _NO_COMMAND
            try:
                if command is None:
                    scheduler.drain()
                    return
                if isinstance(command, _Arrival):
                    # New sequences only join the waiting queue: the step in flight goes on
                    # (a burst of requests costs no pipeline drain per request).
                    scheduler.add(command.seqs)
                    continue
                if command is not _NO_COMMAND:
                    scheduler.drain()
                    command()
                    continue
                started = time.perf_counter()
                scheduler.step()
                self.busy_s += time.perf_counter() - started
            except Exception as error:
                logger.exception("engine step failed; aborting every request")
                scheduler.fail_all(f"engine error: {type(error).__name__}: {error}")

    def _submit(self, command: Callable[[], None] | _Arrival) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine is not running: call start() first")
        self._commands.put(command)

    async def _call(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` on the engine thread at a step boundary; await its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def command() -> None:
            try:
                result = action()
            except BaseException as error:
                _resolve_threadsafe(loop, future, error=error)
            else:
                _resolve_threadsafe(loop, future, result=result)

        self._submit(command)
        return await future

    # -- generation -------------------------------------------------------------

    async def generate(self, requests: list[Request]) -> list[Output]:
        """Run ``requests`` together (identical prompts share one prefill); await all outputs.

        Raises ValueError (before anything runs) as `check` does, and `MemoryReleased` while
        `memory_refusal` says why not. Cancelling the awaiting task aborts the requests."""
        self.check(requests)
        if self.memory_refusal:
            raise MemoryReleased(self.memory_refusal)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        seqs = []
        for request, future in zip(requests, futures, strict=True):
            on_tokens = request.on_tokens
            if on_tokens is not None:
                on_tokens = functools.partial(_call_threadsafe, loop, on_tokens)
            resolve = functools.partial(_resolve_output, loop, future)
            seqs.append(self._sequence(request, resolve, on_tokens))
        self._submit(_Arrival(seqs))
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for request in requests:
                self.abort(request.rid)
            raise

    def submit(self, requests: list[Request], on_output: Callable[[Output], None]) -> None:
        """`generate` for a caller with no event loop (`streamrl.engine.bridge`): returns at
        once; ``on_output`` (each request's `Output`) and every `Request.on_tokens` are called
        on the engine thread, so they must be quick and must not block. Raises as `generate`
        does, before anything runs; `abort` by rid."""
        self.check(requests)
        if self.memory_refusal:
            raise MemoryReleased(self.memory_refusal)
        self._submit(_Arrival([self._sequence(r, on_output, r.on_tokens) for r in requests]))

    def check(self, requests: list[Request]) -> None:
        """ValueError for an empty prompt, token ids outside the vocabulary, or a prompt
        that leaves no room under ``max_seq_len``."""
        check_requests(requests, self.model_info["vocab_size"], self.max_seq_len)

    def _sequence(
        self,
        request: Request,
        on_output: Callable[[Output], None],
        on_tokens: Callable[[list[int], list[float], list[str]], None] | None,
    ) -> Sequence:
        """The scheduler's sequence for ``request``; both callbacks run on the engine thread."""
        params = request.params

        def on_finish(seq: Sequence) -> None:
            on_output(
                Output(
                    rid=seq.rid,
                    output_ids=list(seq.output_ids),
                    logprobs=list(seq.logprobs),
                    versions=list(seq.versions),
                    finish_reason=dict(seq.finish_reason or {}),
                    prompt_tokens=len(seq.prompt_ids),
                    cached_tokens=seq.cached_tokens,
                    routed_experts=_routed_experts(seq),
                )
            )

        checker = None
        if params.stop:
            checker = StopStringChecker(params.stop, self._decode)
        on_token = None
        if on_tokens is not None:
            on_token = _StreamTap(on_tokens, request.stream_interval)
        return Sequence(
            rid=request.rid,
            prompt_ids=list(request.input_ids),
            params=params,
            seed=-1 if params.seed is None else params.seed & ((1 << 63) - 1),
            on_finish=on_finish,
            stop_checker=checker,
            return_routed_experts=request.return_routed_experts,
            on_token=on_token,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request (or all with None); they finish with their partial outputs."""
        self._submit(lambda: self.scheduler.abort(rid, "aborted by request"))

    async def pause(self, mode: str = "abort") -> None:
        """Stop stepping (see `Scheduler.pause` for the modes); returns at a step boundary."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        await self._call(lambda: self.scheduler.pause(mode))
        self.is_paused = True

    def resume(self) -> None:
        self.is_paused = False
        self._submit(self.scheduler.resume)

    async def update_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: str
    ) -> float:
        """Copy HF-named full tensors (or merge LoRA adapter pairs: `runner.adapters`) into the
        live weights at a step boundary, then set ``version``; returns `load_planned`'s pause.

        Every name and shape is checked first: ValueError and nothing copied if one is wrong."""
        pause_s, _ = await self.load_planned(self.runner.plan_weights(list(tensors)), version)
        return pause_s

    async def load_planned(self, plan: list, version: str) -> tuple[float, float]:
        """Apply a plan of `runner.plan_weights` (checked already, maybe long before) at one
        step boundary and set ``version``. Returns the seconds the engine thread spent on it
        (how long generation stood still for the update) and the seconds the update waited
        for that step boundary (the step in flight, and the one it had launched behind it)."""
        submitted = time.perf_counter()

        def load() -> tuple[float, float]:
            if "weights" in self.occupation.released:
                raise MemoryReleased("the engine's weights are released: resume them first")
            started = time.perf_counter()
            self.runner.load_weights(plan)
            self.scheduler.weight_version = version
            self.weights_are_stale = False
            return time.perf_counter() - started, started - submitted

        return await self._call(load)

    async def release_memory(self, tags: tuple[str, ...]) -> int:
        """Free the memory regions `tags` (`runner.occupation`) at a step boundary; returns
        the bytes freed. `MemoryBusy` while a sequence runs or waits (pause with mode `abort`
        first), as SGLang refuses a release with requests in flight."""

        def release() -> int:
            scheduler = self.scheduler
            if scheduler.running or scheduler.waiting:
                raise MemoryBusy(
                    f"{len(scheduler.running)} requests running and {len(scheduler.waiting)} "
                    f"waiting: release memory only when idle (pause_generation with mode "
                    f"'abort' first)"
                )
            return self.occupation.release(tags)

        return await self._call(release)

    async def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Re-allocate the released regions `tags` at a step boundary; resumed weights are
        zeros, and generation is refused until an update loads weights. ValueError for a
        region that is not released."""

        def resume() -> None:
            self.occupation.resume(tags)
            if "weights" in tags:
                self.weights_are_stale = True

        await self._call(resume)

    def flush_cache(self) -> bool:
        """True when idle (there is no prefix cache to drop); False while requests run."""
        return self.num_running == 0 and self.num_waiting == 0


_NO_COMMAND = object()


class MemoryReleased(RuntimeError):
    """Generation or a weight load while the memory it needs is released."""


class MemoryBusy(RuntimeError):
    """A memory release while sequences run or wait."""


@dataclass(frozen=True)
class _Arrival:
    """New sequences for the waiting queue (a command that needs no step boundary)."""

    seqs: list[Sequence]


class _StreamTap:
    """A streamed request's tokens on the engine thread, handed on only at the tokens the
    interval rule marks (`Request.on_tokens`): for `generate`, one cross-thread wake-up of
    the HTTP thread per event it sends, not one per token."""

    def __init__(self, deliver: Callable, interval: int):
        self.deliver = deliver
        self.interval = interval
        self.num_tokens = 0
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[str] = []

    def __call__(self, token: int, logprob: float, version: str) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.num_tokens += 1
        if self.interval == 1 or self.num_tokens % self.interval == 1:
            batch = self.ids, self.logprobs, self.versions
            self.ids, self.logprobs, self.versions = [], [], []
            self.deliver(*batch)


def _call_threadsafe(loop: asyncio.AbstractEventLoop, function: Callable, *args) -> None:
    # RuntimeError: the caller's loop is closed, so nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(function, *args)


def _resolve_output(loop: asyncio.AbstractEventLoop, future, output: Output) -> None:
    _resolve_threadsafe(loop, future, result=output)


def _resolve_threadsafe(loop, future, *, result=None, error: BaseException | None = None) -> None:
    def resolve() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    _call_threadsafe(loop, resolve)


def check_requests(requests: list[Request], vocab_size: int, max_seq_len: int) -> None:
    """`EngineCore.check`'s rules, for anything that knows the engine's vocabulary size and
    ``max_seq_len`` (the HTTP process of a split engine checks before sending)."""
    for request in requests:
        if not request.input_ids:
            raise ValueError(f"request {request.rid!r} has an empty prompt")
        # An out-of-range id would trip a device-side assert, fatal to a CUDA context.
        if min(request.input_ids) < 0 or max(request.input_ids) >= vocab_size:
            raise ValueError(f"request {request.rid!r} has token ids outside [0, {vocab_size})")
        if len(request.input_ids) >= max_seq_len:
            raise ValueError(
                f"request {request.rid!r}: prompt of {len(request.input_ids)} tokens leaves no room "
                f"under max_seq_len {max_seq_len}"
            )


def _eos_token_ids(tokenizer, config) -> set[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _routed_experts(seq: Sequence) -> Any:
    """The finished sequence's routed experts, one row per token the model was fed (all
    but the last): None when it did not ask for them or the runner records none."""
    if not seq.return_routed_experts or not seq.routed_experts:
        return None
    import numpy as np

    return np.stack(seq.routed_experts[: seq.num_tokens - 1]).astype(np.int32)
