"""The engine fleet: start engines (and a router when there are several), watch them, heal them.

Each engine moves through

    starting ─► serving ─► down ─► starting ─► syncing ─► serving ...

A health check (`/health_generate` within `engine.health_timeout_s`, every
`engine.health_interval_s`; `/health` while the run holds the engine paused, since a paused
SGLang engine generates nothing) or a dead process moves a serving engine to
`down` (reason `exited` when its process is gone within a few seconds of a failed check,
`hung` otherwise): it leaves the router, its process is killed (a hung one too) and
started again on the same port, the weight publisher brings it to the current
version (`syncing`), and only then does it rejoin the router. Requests that
were in flight on it fail at the client, which retries them elsewhere with the
tokens it already has (see `streamrl.agents.api`).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio

from streamrl.config import RunConfig
from streamrl.events import append_event
from streamrl.fleet.client import EngineClient, EngineError
from streamrl.fleet.router import Router
from streamrl.process import (
    LocalSpawner,
    ProcessHandle,
    ServerArgv,
    Spawner,
    stop_all,
    wait_http_ready,
)

log = logging.getLogger(__name__)

EXIT_GRACE_S = 5.0
"""How long an engine that failed its health check may take to show its launcher that it
exited (`_exits`; at most `engine.health_timeout_s`) before it counts as hung."""


class EngineState(enum.StrEnum):
    STARTING = "starting"
    SYNCING = "syncing"
    SERVING = "serving"
    DOWN = "down"


class FleetError(RuntimeError):
    pass


@dataclass
class Engine:
    index: int
    url: str
    client: EngineClient
    argv: list[str] | None
    """How to (re)start it; None for an engine we attached to and cannot restart."""
    env: dict[str, str] = field(default_factory=dict)
    process: ProcessHandle | None = None
    state: EngineState = EngineState.STARTING
    num_restarts: int = 0


class WeightSink(Protocol):
    """What the fleet needs from the weight publisher."""

    def invalidate(self) -> None: ...
    async def resync(self) -> None: ...


class InitialWeights:
    """The weight sink of a run without a publisher (`rollout_only`): a restarted engine
    loads the initial model, which is the policy, so there is nothing to resync."""

    def invalidate(self) -> None:
        pass

    async def resync(self) -> None:
        pass


class EngineSupervisor:
    """The run's engines (started, or attached with `engine.urls`) and their router.

    `spawner` decides where engine processes run and which address and port each gets:
    children of this process (`LocalSpawner`, the default) or of Ray actors on their nodes
    (`streamrl.launch.ray.spawner.RaySpawner`); health checks and restarts are the same for both."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_dir: Path,
        engine_argv: ServerArgv | None,
        spawner: Spawner | None = None,
    ) -> None:
        self.cfg = cfg.engine
        self.spawner = spawner or LocalSpawner()
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.engines: list[Engine] = []
        self.router: Router | None = None
        self._healing = 0
        self._settled = anyio.Event()
        self._settled.set()
        self._router_url = cfg.engine.router_url
        self._shared: list[bool] | None = None
        """Per engine, whether an engine before it uses one of its GPUs (`shared_engine_gpus`)."""
        if cfg.engine.urls:
            for index, url in enumerate(cfg.engine.urls):
                url = url.rstrip("/")
                self.engines.append(Engine(index, url, EngineClient(url), None))
        else:
            self._shared = _shared_gpus(cfg)
            for index in range(cfg.engine.num_engines):
                host, port = self.spawner.address(f"engine-{index}", cfg.engine.host)
                argv, env = engine_argv(index, host, port)
                url = f"http://{host}:{port}"
                self.engines.append(Engine(index, url, EngineClient(url), argv, env))

    # ---------------------------------------------------------------- start / stop

    def start(self) -> None:
        """Start every engine (in parallel), wait until all serve, then the router if needed.

        Call from the main thread: children die with the thread that spawned them."""
        self.spawn()
        self.wait_serving()

    def spawn(self) -> None:
        """Start every engine process (from the main thread), without waiting for them; an
        SGLang engine on a GPU an earlier engine uses is started by `wait_serving` once that
        one serves (`_is_staggered`)."""
        for engine in self.engines:
            if not self._is_staggered(engine):
                self._spawn(engine)

    def wait_serving(self) -> None:
        """Wait until every spawned engine serves (starting the staggered ones in turn: from
        the main thread), then start the router if one is needed."""
        for engine in self.engines:
            if engine.process is None and engine.argv is not None:
                self._spawn(engine)
            wait_http_ready(
                engine.url, timeout_s=self.cfg.startup_timeout_s, process=engine.process
            )
            engine.state = EngineState.SERVING
        if not self._router_url and len(self.engines) > 1:
            self.router = Router.start(
                self.urls,
                log_path=self.log_dir / "router.log",
                host=self.spawner.reachable(self.cfg.host),
                policy=self.cfg.router_policy,
                timeout_s=self.cfg.startup_timeout_s,
            )
            self._router_url = self.router.url
        self._write_state()
        log.info(
            "engines serving: %s%s",
            ", ".join(self.urls),
            f" behind router {self._router_url}" if self._router_url else "",
        )

    def _write_state(self) -> None:
        """`run_dir/engines.json`: every engine's URL, pid, state and restarts (for people and tests)."""
        rows = [
            {
                "index": e.index,
                "url": e.url,
                "pid": e.process.pid if e.process is not None else None,
                "state": str(e.state),
                "restarts": e.num_restarts,
                **(e.process.placement if e.process is not None else {}),
            }
            for e in self.engines
        ]
        state = {"launcher": self.spawner.name, "engines": rows, "router": self._router_url}
        (self.run_dir / "engines.json").write_text(json.dumps(state, indent=2) + "\n")

    def _event(self, engine: Engine, event: str, **details) -> None:
        """Append to `run_dir/events.jsonl` (down, restarted, synced) and refresh engines.json."""
        append_event(self.run_dir, {"engine": engine.url, "event": event, **details})
        self._write_state()

    async def versions(self) -> dict[str, int | None]:
        """Each engine's weight version as it reports it (None when it does not answer)."""
        result: dict[str, int | None] = {}
        for engine in self.engines:
            try:
                result[engine.url] = await engine.client.weight_version()
            except EngineError:
                result[engine.url] = None
        return result

    def pids(self) -> dict[str, int]:
        """`engine <i>` -> the pid of its process now, for engines started here (the local
        launcher; a Ray actor's child is on another node's pid namespace)."""
        if self.spawner.name != "local":
            return {}
        return {f"engine {e.index}": e.process.pid for e in self.engines if e.process is not None}

    async def memory_reports(self) -> dict[str, dict]:
        """`engine <i>` -> the allocator peaks an engine reports of itself (the embedded
        engine's `/server_info` `memory`; SGLang reports none: nvidia-smi measures it)."""
        reports: dict[str, dict] = {}
        for engine in self.engines:
            try:
                info = await engine.client.server_info()
            except EngineError:
                continue
            if isinstance(info.get("memory"), dict):
                reports[f"engine {engine.index}"] = info["memory"]
        return reports

    def stop(self) -> None:
        """Stop the router and every engine, all at once (`stop_all`)."""
        stops = [self.router.stop] if self.router is not None else []
        stops += [engine.process.stop for engine in self.engines if engine.process is not None]
        stop_all(stops)

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    @property
    def router_url(self) -> str:
        return self._router_url

    def live_clients(self) -> list[EngineClient]:
        """Engines that must receive weight updates (serving, or being brought up to date)."""
        return [
            e.client for e in self.engines if e.state in (EngineState.SERVING, EngineState.SYNCING)
        ]

    def _is_staggered(self, engine: Engine) -> bool:
        """Whether `engine` waits for the engines before it: SGLang sizes its KV pool as
        `mem_fraction_static` of the memory free when it starts, less its weights, so two
        SGLang servers starting together on one GPU would each count the other's memory as
        free (and the second to allocate would fail). Local launcher only: Ray gives every
        engine GPUs of its own."""
        if self.cfg.backend != "sglang" or self.spawner.name != "local" or self._shared is None:
            return False
        return self._shared[engine.index]

    def _spawn(self, engine: Engine) -> None:
        if engine.argv is None:
            return
        engine.process = self.spawner.spawn(
            f"engine-{engine.index}",
            engine.argv,
            env=engine.env,
            log_path=self.log_dir / f"engine-{engine.index}.log",
        )

    # ---------------------------------------------------------------- health

    async def monitor(self, publisher: WeightSink) -> None:
        """Check every engine forever; heal the ones that fail (see the module docstring)."""
        while True:
            await anyio.sleep(self.cfg.health_interval_s)
            for engine in self.engines:
                if engine.state is not EngineState.SERVING:
                    continue
                reason = await self._is_healthy(engine)
                if reason is not None:
                    await self._heal(engine, publisher, reason)

    async def _is_healthy(self, engine: Engine) -> str | None:
        """None when healthy, else why not (`exited` or `hung`)."""
        if engine.process is not None and not engine.process.is_alive():
            log.error("engine %s exited with code %s", engine.url, engine.process.poll())
            return "exited"
        try:
            with anyio.fail_after(self.cfg.health_timeout_s):
                if engine.client.paused:  # held on purpose (an update, colocated training):
                    await engine.client.health()  # its server answers, generation waits
                else:
                    await engine.client.health_generate(timeout_s=self.cfg.health_timeout_s)
            return None
        except (TimeoutError, EngineError) as exc:
            log.error("engine %s failed its health check: %s", engine.url, exc or "timeout")
            return "exited" if await self._exits(engine) else "hung"

    async def _exits(self, engine: Engine) -> bool:
        """Whether the process of an engine that failed its health check turns out to have
        exited within EXIT_GRACE_S: a killed engine refuses connections at once, but its
        launcher may see the exit a moment later (a Ray actor's answer, on a loaded machine)."""
        if engine.process is None:
            return False
        with anyio.move_on_after(min(EXIT_GRACE_S, self.cfg.health_timeout_s)):
            while engine.process.is_alive():
                await anyio.sleep(0.1)
            return True
        return False

    async def wait_settled(self) -> None:
        """Return once no engine is being restarted or re-synced (at the end of a run, so
        the engines it leaves behind all serve the final version)."""
        while self._healing:
            await self._settled.wait()

    async def _heal(self, engine: Engine, publisher: WeightSink, reason: str) -> None:
        self._healing += 1
        if self._settled.is_set():
            self._settled = anyio.Event()
        try:
            await self._restart(engine, publisher, reason)
        finally:
            self._healing -= 1
            if not self._healing:
                self._settled.set()

    async def _restart(self, engine: Engine, publisher: WeightSink, reason: str) -> None:
        engine.state = EngineState.DOWN
        self._event(engine, "down", reason=reason)
        if engine.argv is None:
            raise FleetError(
                f"engine {engine.url} failed and was attached, not started: cannot restart it"
            )
        if engine.num_restarts >= self.cfg.max_restarts:
            raise FleetError(
                f"engine {engine.url} failed again after {engine.num_restarts} restarts "
                f"(engine.max_restarts); last lines of its log:\n{engine.process.log_tail()}"
            )
        if self.router is not None:
            await anyio.to_thread.run_sync(self.router.remove_worker, engine.url)
        engine.process.kill()
        publisher.invalidate()  # the weight-update group lost a member: rebuild it
        engine.num_restarts += 1
        log.warning("restarting engine %s (restart %d)", engine.url, engine.num_restarts)
        engine.state = EngineState.STARTING
        self._spawn(engine)
        await anyio.to_thread.run_sync(
            lambda: wait_http_ready(
                engine.url, timeout_s=self.cfg.startup_timeout_s, process=engine.process
            )
        )
        engine.state = EngineState.SYNCING
        self._event(engine, "restarted", pid=engine.process.pid)
        await publisher.resync()
        engine.state = EngineState.SERVING
        if self.router is not None:
            await anyio.to_thread.run_sync(self.router.add_worker, engine.url)
        self._event(engine, "serving", version=await engine.client.weight_version())
        log.warning("engine %s is back at the current weight version", engine.url)

    def restart_counts(self) -> dict[str, int]:
        return {engine.url: engine.num_restarts for engine in self.engines}


def _shared_gpus(cfg: RunConfig) -> list[bool] | None:
    """`shared_engine_gpus` of the run's engine placement (None when it does not place)."""
    from streamrl.placement import engine_gpu_ids, shared_engine_gpus

    engine = cfg.engine
    try:
        placement = engine_gpu_ids(engine.num_engines, engine.tp_size, cfg.cluster.engine_gpus)
    except ValueError:
        return None
    return shared_engine_gpus(placement)
