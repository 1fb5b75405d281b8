"""Colocated mode (`cluster.colocate`): engines and learner take turns with one GPU's memory.

One step of the learner loop, with the memory each side holds:

    take the batch                  engines: everything    learner: what learner.offload keeps
    to_learner:  pause (abort)      every engine idles; calls that arrive wait at its gate
                 release            engines free weights, KV cache, CUDA graphs   release_s
                 reload             learner's optimizer (and parameters) back     reload_s
    train                           learner: everything
    (checkpoint: copied now, while the learner holds its state)
    to_engines:  offload optimizer  its state to pinned host memory, grads dropped  offload_s
                 resume             engines re-allocate (weights hold zeros)       resume_s
                 publish            the new version's weights, waited for
                 offload parameters with learner.offload = "all"                  offload_s
                 continue           the engines generate the next batch

So it is a synchronous schedule by nature (`train.mode = "sync"` is required): generation
waits for training and training for generation. The weights are pushed after every resume
because the engines' released weights are gone (SGLang's, and the embedded engine's);
the learner's parameters are still on the device for that push, then leave with "all".
The pause uses mode `abort` because SGLang refuses a release with requests in flight; an
aborted request comes back partial and the rollout worker resumes it after the continue.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio

from streamrl.backends.base import LearnerBackend
from streamrl.fleet.client import EngineClient
from streamrl.fleet.engine_set import each_engine


class MemoryHandoff:
    """The handoff around one colocated step (see the module docstring)."""

    def __init__(
        self,
        backend: LearnerBackend,
        engines: Callable[[], list[EngineClient]],
        *,
        offload: str,
    ) -> None:
        """`engines()`: the engines on the learner's GPUs (the fleet's live ones); `offload`:
        `learner.offload`."""
        self.backend = backend
        self.engines = engines
        self.offload = offload
        self.metrics: dict[str, float] = {}
        """The current step's `colocate/*` seconds (and bytes), reset by `to_learner`."""

    async def start(self) -> None:
        """Before the first generation: the learner keeps on the device only what
        `learner.offload` keeps while engines generate."""
        if self.offload != "none":
            await self._backend_call(self.backend.offload_to_host, "optimizer")
        if self.offload == "all":
            await self._backend_call(self.backend.offload_to_host, "parameters")

    async def to_learner(self) -> None:
        """The engines idle and give their memory back; the learner reloads its state."""
        self.metrics = {}
        engines = self.engines()
        started = time.perf_counter()
        await each_engine(engines, lambda e: e.pause("abort"), what="pause")
        await each_engine(engines, lambda e: e.release_memory_occupation(), what="release")
        self.metrics["colocate/release_s"] = time.perf_counter() - started
        reload_s = 0.0
        if self.offload != "none":
            reload_s = await self._backend_call(self.backend.reload_from_host)
        self.metrics["colocate/reload_s"] = reload_s

    async def to_engines(self, publish: Callable[[], Awaitable[object]]) -> None:
        """The learner offloads; the engines take their memory back, get the new weights
        (`publish()`, which returns once every engine holds them) and generate again."""
        offload_s = 0.0
        if self.offload != "none":
            offload_s += await self._backend_call(self.backend.offload_to_host, "optimizer")
        engines = self.engines()
        started = time.perf_counter()
        await each_engine(engines, lambda e: e.resume_memory_occupation(), what="resume")
        self.metrics["colocate/resume_s"] = time.perf_counter() - started
        try:
            started = time.perf_counter()
            await publish()
            self.metrics["colocate/publish_s"] = time.perf_counter() - started
            if self.offload == "all":
                offload_s += await self._backend_call(self.backend.offload_to_host, "parameters")
        finally:
            await each_engine(engines, lambda e: e.continue_generation(), what="continue")
        self.metrics["colocate/offload_s"] = offload_s
        inner = getattr(self.backend, "backend", self.backend)  # rank 0's under a `Leader`
        offloaded = getattr(inner, "host_offload", None)
        if offloaded is not None:
            self.metrics["colocate/offloaded_gb"] = offloaded.num_bytes / 1e9

    async def _backend_call(self, function: Callable, *args) -> float:
        """`function(*args)` in a worker thread bound to the learner's GPU."""
        device = self.backend.device

        def call():
            if device.type == "cuda":
                import torch

                torch.cuda.set_device(device)
            return function(*args)

        return await anyio.to_thread.run_sync(call)
