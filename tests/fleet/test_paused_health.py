"""An engine the run holds paused is not mistaken for a hung one.

SGLang's `/health_generate` generates one token, and a paused SGLang engine holds new
requests at its gate, so while paused the probe waits until the pause ends. On the H200 a
colocated 4B run paused its engine for 39 s (training plus the first offload to host memory)
and the fleet killed and restarted it as hung. The stand-in server below answers the way
SGLang 0.5.17 does (`/health` at once, `/health_generate` only while not paused); the fleet's
health check is the part under test."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from streamrl.config import config_from_dict
from streamrl.fleet.supervisor import EngineState, EngineSupervisor


class PausableServer:
    """The few SGLang endpoints the health check and a pause touch."""

    def __init__(self) -> None:
        self.paused = False
        self.resumed = anyio.Event()
        self.calls: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        return app

    async def health(self, request: web.Request) -> web.Response:
        self.calls.append("health")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        self.calls.append("health_generate")
        if self.paused:  # the probe's one token waits at the pause's gate
            await self.resumed.wait()
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        self.resumed = anyio.Event()
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self.resumed.set()
        return web.json_response({})


@asynccontextmanager
async def attached(server: PausableServer, port: int, run_dir: Path):
    """A fleet attached (`engine.urls`) to `server`, its one engine serving."""
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    cfg = config_from_dict(
        {
            "model": {"path": "/models/m"},
            "data": {"path": "prompts.jsonl"},
            # Long enough for a healthy answer on a loaded 2-core machine; the hung case
            # waits it out once.
            "engine": {"urls": [f"http://127.0.0.1:{port}"], "health_timeout_s": 2.0},
        }
    )
    supervisor = EngineSupervisor(cfg, run_dir=run_dir, engine_argv=None)
    (engine,) = supervisor.engines
    engine.state = EngineState.SERVING
    try:
        yield supervisor, engine
    finally:
        server.resumed.set()
        await engine.client.aclose()
        await runner.cleanup()


@pytest.mark.anyio
async def test_a_paused_engine_is_asked_whether_it_answers_not_whether_it_generates(
    free_port, tmp_path
):
    server = PausableServer()
    async with attached(server, free_port(), tmp_path) as (supervisor, engine):
        assert await supervisor._is_healthy(engine) is None
        assert server.calls == ["health_generate"]

        await engine.client.pause("abort")
        # Several health timeouts long: the probe must not wait for the pause to end.
        for _ in range(3):
            assert await supervisor._is_healthy(engine) is None
        assert server.calls[1:] == ["health"] * 3

        await engine.client.continue_generation()
        assert await supervisor._is_healthy(engine) is None
        assert server.calls[-1] == "health_generate"


@pytest.mark.anyio
async def test_an_engine_that_stops_generating_unpaused_is_still_found_hung(free_port, tmp_path):
    server = PausableServer()
    server.paused = True  # held behind the run's back: generation waits, the run holds nothing
    async with attached(server, free_port(), tmp_path) as (supervisor, engine):
        assert await supervisor._is_healthy(engine) == "hung"
