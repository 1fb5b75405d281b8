"""The embedded engine's HTTP server: SGLang's native protocol in front of `EngineCore`.

    aiohttp app ─ /generate, pause, continue, abort ─► generate_endpoints.GenerateEndpoints
                ─ weight routes ───────────────────► weight_endpoints.WeightEndpoints
                ─ release, resume memory ──────────► memory_endpoints.MemoryEndpoints
                ─ health, info, load, flush ───────► this module

The request and response bodies are `streamrl.engine.protocol`'s; docs/engine.md
lists the subset and where the embedded engine differs from SGLang.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import uuid

import msgspec
from aiohttp import web

from streamrl.engine.core import EngineCore, Request, SamplingParams
from streamrl.engine.generate_endpoints import GenerateEndpoints
from streamrl.engine.memory_endpoints import MemoryEndpoints
from streamrl.engine.options import EngineOptions
from streamrl.engine.protocol import (
    BadRequest,
    error_response,
    json_response,
)
from streamrl.engine.weight_endpoints import WeightEndpoints
from streamrl.memory_use import host_peak_bytes, torch_peaks
from streamrl.weights.digest import build_kernel

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


def freeze_loaded_objects() -> None:
    """Move every object alive now (torch's, transformers', the model's: the process's
    lifetime) out of the garbage collector's reach. Otherwise each full collection walks them
    all while holding the GIL, stalling the engine thread between steps: 75-155 ms for the
    224k objects of a tiny CPU engine (195 ms for the 507k after one `torch.compile`), seen
    once every round or two of 256 requests, whose per-request objects trigger it."""
    gc.collect()
    gc.freeze()


class EngineServer:
    """The aiohttp application around one `EngineCore` (built by `load`)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.model_path = options.model
        """Where the weights came from (`/update_weights_from_disk` changes it)."""
        self.core: EngineCore | None = None
        self.is_ready = False
        self.is_closing = False
        self.generation = GenerateEndpoints(lambda: self.core)
        self.bridge = None
        """The `CoreBridge` to the HTTP processes of a split engine (set once loaded)."""
        self.weights = WeightEndpoints(
            lambda: self.core,
            abort_all=lambda: self.generation.abort(None),
            on_loaded_from_disk=self._loaded_from_disk,
        )
        self.memory = MemoryEndpoints(lambda: self.core)
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------
    async def load(self) -> None:
        """Build and start the core in a worker thread; /health turns 200 after."""
        self.core = await asyncio.to_thread(EngineCore, self.options)
        self.core.start()
        # Before serving: the first update's digest check would build it beside generation.
        await asyncio.to_thread(build_kernel, self.core.device)
        freeze_loaded_objects()
        self.is_ready = True

    async def close(self) -> None:
        """Refuse new work; calls held by a pause and requests in the core end as aborts."""
        self.is_closing = True
        self.generation.close()
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
            *self.generation.routes(),
            ("/flush_cache", self.flush_cache),
            *self.weights.routes(),
        ]
        for path, handler in get:
            app.router.add_get(path, handler)
        for path, handler in post:
            app.router.add_post(path, handler)
        # SGLang answers both verbs on these.
        for path, handler in self.memory.routes():
            app.router.add_route("*", path, handler)
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
        if self.core.is_paused or self.core.memory_refusal:  # paused or handed over: healthy
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
        num_gated = self.generation.num_gated
        return {
            "dp_rank": 0,
            "num_reqs": self.core.num_running + self.core.num_waiting + num_gated,
            "num_running_reqs": self.core.num_running,
            "num_waiting_reqs": self.core.num_waiting,
            "num_paused_reqs": num_gated,
            "num_finished_reqs": self.generation.num_finished_reqs
            + (self.bridge.num_finished if self.bridge is not None else 0),
            "is_receiving_weights": self.weights.is_receiving,
            "is_paused": self.core.is_paused,
            # streamrl additions: the memory handoff (memory_endpoints.py).
            "memory_released": sorted(self.core.occupation.released),
            "resident_bytes": self.core.occupation.resident_bytes(),
            "weight_version": self.core.weight_version,
            # streamrl additions (not in SGLang): the engine's busy clock for benchmarks.
            "busy_s": self.core.busy_s,
            "uptime_s": self.core.uptime_s,
            "generated_tokens": self.core.scheduler.stats["generated_tokens"],
            "decode_steps": self.core.scheduler.stats["decode_steps"],
            "prefills": self.core.scheduler.stats["prefills"],
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
                "pid": os.getpid(),
                "internal_states": [self._load()],
                "memory": {
                    **torch_peaks(self.core.device),
                    "host_peak_bytes": host_peak_bytes(os.getpid()),
                },
            }
        )
        return json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        return json_response([self._load()])

    # ---- control ---------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.core.flush_cache():
            return web.Response(status=200, text="Cache flushed.")
        return web.Response(status=400, text="Cache not flushed: requests are running.")
