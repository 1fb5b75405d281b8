"""The HTTP process of a split engine (`--http-process`; `streamrl.engine.bridge` says why).

    FrontServer (the public port)
      /generate, pause, continue, abort ─► GenerateEndpoints over bridge.RemoteCore ─► ZeroMQ
      /get_load ─────────────────────────► the engine's, with this process's gated requests
      every other route ─────────────────► proxied to the engine process's loopback port

The engine process is `streamrl engine serve` itself, with the same options on a loopback
port and `bridge_dir` (`streamrl.mains.engine.serve_split` starts it, so that it dies with
this process); `start` waits for it, and this process stops when it dies.

With `--http-processes N` this first HTTP process also starts N - 1 others (`sibling_options`:
the same options with their index, the engine's port and the bridge's directory). Each binds
its own pair of bridge sockets and, once attached to the engine, the public port too
(SO_REUSEPORT: the kernel deals incoming connections out between the N processes). /health
turns 200 once all N serve; any of them exiting stops the server, as the engine's exit does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from streamrl.engine.app import freeze_loaded_objects
from streamrl.engine.bridge import EngineGone, RemoteCore, addresses
from streamrl.engine.generate_endpoints import GenerateEndpoints
from streamrl.engine.options import EngineOptions
from streamrl.engine.protocol import BadRequest, error_response, json_response

logger = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT_S = 60.0


class FrontServer:
    """The aiohttp application of an HTTP process: the first one (index 0) with the engine
    process and the other HTTP processes behind it, or one of those others (index > 0,
    `options.bridge` the first one's bridge directory)."""

    def __init__(self, options: EngineOptions, engine_port: int) -> None:
        self.options = options
        self.index = options.front_index
        if self.index:
            self.bridge_dir = Path(options.bridge)
        else:
            self.bridge_dir = Path(tempfile.mkdtemp(prefix="streamrl-engine-"))
        """Where the bridge's sockets are (bound by each HTTP process before the engine
        process starts or, for the others, before it connects to them)."""
        self.remote = RemoteCore(*addresses(str(self.bridge_dir), self.index))
        self.generation = GenerateEndpoints(
            lambda: self.remote, is_shared=options.http_processes > 1
        )
        self.remote.on_gate = self.generation.hold
        self.remote.on_aborting = self.generation.abort_gated
        self.engine_port = engine_port
        self.engine_url = f"http://127.0.0.1:{engine_port}"
        self.engine: subprocess.Popen | None = None
        self.engine_exit = asyncio.Event()
        """Set when the engine process (or another HTTP process) has exited (`exit_code`
        then says how)."""
        self.exit_code: int | None = None
        self._engine_exited = asyncio.Event()
        self.siblings: list[subprocess.Popen] = []
        """The other HTTP processes (the first one's children)."""
        self.is_ready = False
        self.is_closing = False
        self._http: aiohttp.ClientSession | None = None
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------
    def engine_options(self) -> EngineOptions:
        """The engine process's options: this one's, on the loopback port, with the bridge."""
        return msgspec.structs.replace(
            self.options,
            host="127.0.0.1",
            port=self.engine_port,
            http_process="off",
            bridge=str(self.bridge_dir),
        )

    def sibling_options(self, index: int) -> EngineOptions:
        """The options of the other HTTP process ``index`` (1..N-1)."""
        return msgspec.structs.replace(
            self.options, front_index=index, engine_port=self.engine_port,
            bridge=str(self.bridge_dir),
        )  # fmt: skip

    async def start(
        self,
        engine: subprocess.Popen,
        start_timeout_s: float = 1800.0,
        start_sibling: Callable[[EngineOptions], subprocess.Popen] | None = None,
    ) -> None:
        """Wait for the engine process (started with `engine_options`) to serve, attach the
        bridge, then start the other HTTP processes (`start_sibling` with each one's
        `sibling_options`, on this event loop's thread) and wait for them; /health turns 200
        after. RuntimeError if any of them exits first."""
        self.engine = engine
        asyncio.get_running_loop().create_task(self._watch(engine, "the engine process"))
        await self.attach(start_timeout_s)
        for index in range(1, self.options.http_processes):
            if start_sibling is None:
                raise ValueError("several HTTP processes need start_sibling")
            sibling = start_sibling(self.sibling_options(index))
            self.siblings.append(sibling)
            asyncio.get_running_loop().create_task(self._watch(sibling, f"HTTP process {index}"))
        await self._wait_for_siblings(start_timeout_s)
        (self.bridge_dir / "serve").touch()  # the others bind the public port now
        self.is_ready = True

    async def _wait_for_siblings(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = [self.bridge_dir / f"attached-{i}" for i in range(1, len(self.siblings) + 1)]
        while waiting := [path for path in waiting if not path.exists()]:
            if self.engine_exit.is_set():
                raise RuntimeError(self._exit_message)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} HTTP processes did not start in time")
            await asyncio.sleep(0.02)

    async def attach(self, start_timeout_s: float = 1800.0) -> None:
        """Wait for the engine process to serve, then attach the bridge to it (the caller
        sets `is_ready`, which turns /health 200)."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        model_info = await self._wait_for_engine(start_timeout_s)
        from streamrl import models

        tokenizer = await asyncio.to_thread(
            models.load_tokenizer, model_info.get("tokenizer_path") or self.options.model
        )
        self.remote.attach(model_info, tokenizer)
        # torch's and transformers' objects (~220k) out of every full collection: a burst
        # of requests made several, 100 ms each with the GIL held (on the CI machine)
        freeze_loaded_objects()

    async def _wait_for_engine(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if self.engine_exit.is_set():
                raise RuntimeError(self._exit_message)
            try:
                async with self._http.get(f"{self.engine_url}/health") as response:
                    if response.status == 200:
                        async with self._http.get(f"{self.engine_url}/model_info") as info:
                            return await info.json()
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.2)
        raise TimeoutError(f"the engine process did not serve within {timeout_s:.0f} s")

    async def _watch(self, process: subprocess.Popen, name: str) -> None:
        """Wait for the engine process or another HTTP process to exit: on its own (not
        while closing) that fails the requests here and stops the server."""
        code = await asyncio.to_thread(process.wait)
        is_engine = process is self.engine
        if is_engine:
            self.exit_code = code
            self._engine_exited.set()
        if not self.is_closing:
            self._exit_message = f"{name} exited with code {code}"
            logger.error("%s", self._exit_message)
            self.remote.engine_gone(self._exit_message)
            self.engine_exit.set()
        elif is_engine:
            self.engine_exit.set()

    _exit_message = ""

    async def close(self) -> None:
        """Refuse new work, stop the engine process (requests in it end as aborts and are
        answered, whichever HTTP process holds them), then the other HTTP processes, then
        let go of the bridge."""
        self.is_closing = True
        self.generation.close()
        if self.engine is not None and self.engine.poll() is None:
            self.engine.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._engine_exited.wait(), ENGINE_STOP_TIMEOUT_S)
            except TimeoutError:
                logger.error(
                    "the engine process did not stop in %.0f s: killed", ENGINE_STOP_TIMEOUT_S
                )
                self.engine.kill()
                await self._engine_exited.wait()
            if self.exit_code != 0:
                logger.error("the engine process stopped with code %s", self.exit_code)
        await self._stop_siblings()
        self.remote.engine_gone("the engine is shutting down")
        await self.remote.close()
        if self._http is not None:
            await self._http.close()
        if not self.index:
            shutil.rmtree(self.bridge_dir, ignore_errors=True)

    async def _stop_siblings(self) -> None:
        for sibling in self.siblings:
            if sibling.poll() is None:
                sibling.send_signal(signal.SIGTERM)
        for index, sibling in enumerate(self.siblings, start=1):
            try:
                code = await asyncio.wait_for(asyncio.to_thread(sibling.wait), 30)
            except TimeoutError:
                logger.error("HTTP process %d did not stop in 30 s: killed", index)
                sibling.kill()
                code = await asyncio.to_thread(sibling.wait)
            if code != 0:
                logger.error("HTTP process %d stopped with code %s", index, code)

    # ---- routes ----------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._errors])
        for path, handler in self.generation.routes():
            app.router.add_post(path, handler)
        app.router.add_get("/get_load", self.get_load)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        if not self.is_ready and request.path not in ("/health", "/health_generate"):
            return error_response("the engine is still loading", 503)
        if not self.is_ready or self.engine_exit.is_set():
            return web.Response(status=503)  # (a health probe)
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(str(exc))
        except web.HTTPException:
            raise
        except EngineGone as exc:
            return error_response(str(exc), 503)
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(f"{type(exc).__name__}: {exc}", 500)

    async def proxy(self, request: web.Request) -> web.Response:
        """Any route but generation's: to the engine process, body and answer as they are."""
        body = await request.read()
        headers = {}
        if "Content-Type" in request.headers:
            headers["Content-Type"] = request.headers["Content-Type"]
        async with self._http.request(
            request.method, self.engine_url + request.path_qs, data=body or None, headers=headers
        ) as answer:
            payload = await answer.read()
            content_type = answer.headers.get("Content-Type")
        response = web.Response(status=answer.status, body=payload)
        if content_type:
            response.headers["Content-Type"] = content_type
        return response

    async def _engine_json(self, path: str) -> object:
        async with self._http.get(f"{self.engine_url}{path}") as answer:
            answer.raise_for_status()
            return await answer.json()

    def _with_gate(self, loads: list[dict]) -> list[dict]:
        """The engine's loads, with the calls this process holds at its pause gate (with
        several HTTP processes: this one's alone; their finished requests are the engine's
        count of outputs sent to any of them)."""
        gated = self.generation.num_gated
        for load in loads:
            load["num_reqs"] += gated
            load["num_paused_reqs"] = gated
            if self.options.http_processes == 1:
                load["num_finished_reqs"] = self.generation.num_finished_reqs
        return loads

    async def get_load(self, request: web.Request) -> web.Response:
        return json_response(self._with_gate(await self._engine_json("/get_load")))

    async def server_info(self, request: web.Request) -> web.Response:
        """The engine's, with this process's address, options and load."""
        info = await self._engine_json("/server_info")
        info.update(msgspec.structs.asdict(self.options))
        info["internal_states"] = self._with_gate(info.get("internal_states") or [])
        info["engine_process"] = {
            "pid": self.engine.pid if self.engine is not None else info.get("pid"),
            "url": self.engine_url,
        }
        info["front_process"] = {"pid": os.getpid(), "index": self.index}
        return json_response(info)
