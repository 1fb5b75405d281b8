"""`streamrl run`: every component as a process on this machine, or placed by Ray.

    streamrl run (this process: learner rank 0, buffer, publisher, engine fleet)
      ├── engine-0 .. engine-N-1   `streamrl engine serve` (or SGLang servers)
      ├── sglang-router            when there are several engines
      ├── rollout                  `streamrl _component rollout` (prompts -> groups over ZeroMQ)
      └── learner ranks 1..        (megatron backend with several processes)

The run directory (`train.output_dir`) receives the resolved `config.toml`,
`metrics.jsonl`, TensorBoard events, `logs/` of every child, `checkpoints/`
and, at the end, `summary.json` with the group accounting. Every child dies
with this process (PDEATHSIG); Ctrl-C or a failing child stops them all.

With `cluster.launcher = "ray"` the engines and the rollout process run the
same command lines in Ray actors instead (`streamrl.launch.ray`, through the
`Spawner` seam); the learner ranks and the router stay here.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from streamrl import checkpoint
from streamrl.config import ConfigError, RunConfig, dump_toml, load_config, weight_backend
from streamrl.launch.process import (
    LocalSpawner,
    ProcessDied,
    ProcessHandle,
    Spawner,
    streamrl_argv,
)
from streamrl.metrics import MetricsWriter

log = logging.getLogger(__name__)


@dataclass
class _Parts:
    admission: Any
    buffer: Any
    receiver: Any
    publisher: Any
    loop: Any


class RunError(RuntimeError):
    """A run that cannot go on; the message says why and where to look."""


def run_command(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Both signals raise KeyboardInterrupt in the main thread. Left to asyncio, Ctrl-C would
    # cancel the main task instead, and a cancellation absorbed on its way out (a shielded
    # scope finishing cleanup) can end the run as if it had completed: exit 0, not 130.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        summary = anyio.run(run, cfg, args.resume)
    except KeyboardInterrupt:
        print("streamrl: interrupted; every process stopped", file=sys.stderr)
        return 130
    except (RunError, ProcessDied, TimeoutError, ConfigError) as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 1
    print(
        f"streamrl: done: {summary['steps']} steps, version {summary['version']}, "
        f"run dir {cfg.train.output_dir}",
        file=sys.stderr,
    )
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def run(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run training to `train.steps`; returns the summary (also written to summary.json)."""
    job = LocalJob(cfg, resume)
    try:
        return await job.main()
    finally:
        job.stop()


class LocalJob:
    """One `streamrl run`: the parts in this process, and the processes it starts through
    `self.spawner` (here by default, in Ray actors with `cluster.launcher = "ray"`)."""

    def __init__(self, cfg: RunConfig, resume: bool) -> None:
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.train.output_dir)
        self.children: list[ProcessHandle] = []
        self.spawner: Spawner = LocalSpawner()
        self.fleet = None
        self.resume_from: Path | None = None
        self.ranks = None
        self.leader = None

    def stop(self) -> None:
        for child in self.children:
            child.stop()
        if self.ranks is not None:
            self.ranks.stop()
        if self.fleet is not None:
            self.fleet.stop()
        self.spawner.close()

    def _prepare_run_dir(self) -> tuple[checkpoint.TrainState, str]:
        latest = checkpoint.latest(self.run_dir)
        if self.resume and latest is None:
            raise RunError(f"--resume: no checkpoint under {self.run_dir}/checkpoints")
        if not self.resume and latest is not None:
            raise RunError(
                f"{self.run_dir} already holds checkpoints: pass --resume to continue, "
                f"or set train.output_dir to a new directory"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_toml(self.cfg))
        if latest is None:
            return checkpoint.TrainState(), self._initial_model()
        state = checkpoint.read_state(latest)
        log.info("resuming from %s: step %d, version %d", latest, state.step, state.version)
        self.resume_from = latest
        return state, str(latest)

    def _initial_model(self) -> str:
        """The model every process loads; a `random:` model is written once so all agree."""
        path = self.cfg.model.path
        if not path.startswith("random:"):
            return path
        from streamrl.engine.models import save_random_model

        target = self.run_dir / "initial_model"
        if not (target / "config.json").exists():
            save_random_model(path.removeprefix("random:"), target, seed=self.cfg.model.seed)
        return str(target)

    async def main(self) -> dict[str, Any]:
        from streamrl.launch.builders import learner_devices

        cfg = self.cfg
        if cfg.engine.backend == "sglang":
            from streamrl.engine.sglang import check_sglang_backend

            check_sglang_backend(cfg)  # before anything starts
        if cfg.cluster.launcher == "ray":
            from streamrl.launch.ray import RaySpawner, require_ray

            require_ray()  # before anything starts
        state, model_path = self._prepare_run_dir()
        if cfg.cluster.launcher == "ray":
            self.spawner = RaySpawner.start(cfg, self.run_dir)
        device, dtype = learner_devices(cfg)
        self._start_learner_ranks(model_path, device)
        backend = await self._start_engines_and_backend(model_path, device, dtype, state.version)
        metrics = MetricsWriter(
            self.run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress
        )
        try:
            parts = self._wire(backend, device, state, metrics)
            rollout = self._start_rollout(parts.receiver.bind(), model_path, state)
            started = time.monotonic()
            engine_versions = await self._train(parts, rollout)
        finally:
            metrics.close()
        summary = _summary(cfg, parts, self.fleet, time.monotonic() - started)
        summary["engine_versions"] = engine_versions
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    async def _start_engines_and_backend(self, model_path: str, device, dtype, version: int):
        """Engines (and router) start while the learner loads its model in a thread."""
        from streamrl.actors.fleet import EngineFleet
        from streamrl.launch.builders import build_backend, engine_argv_factory

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            backend_future = pool.submit(build_backend, self.cfg, model_path, device, dtype)
            self.fleet = EngineFleet(
                self.cfg,
                run_dir=self.run_dir,
                engine_argv=engine_argv_factory(self.cfg, model_path, version),
                spawner=self.spawner,
            )
            self.fleet.start()  # in the main thread: children die with the thread that forks
            backend = await anyio.to_thread.run_sync(backend_future.result)
        if self.ranks is not None:
            from streamrl.learners.distributed import Leader

            backend = self.leader = Leader(backend)
        if self.resume_from is not None:
            await anyio.to_thread.run_sync(backend.load, self.resume_from)
        return backend

    def _wire(self, backend, device, state, metrics) -> _Parts:
        """Buffer, admission credits, the stream receiver, the publisher and the learner loop,
        connected: groups arrive -> buffer; discards and new versions -> admission -> credits."""
        from streamrl.actors.learner import LearnerLoop
        from streamrl.actors.publisher import WeightPublisher
        from streamrl.launch.builders import pad_token_id
        from streamrl.queues.admission import Admission
        from streamrl.queues.buffer import Buffer
        from streamrl.queues.transport import StreamReceiver

        cfg = self.cfg
        admission = Admission(
            batch_size=cfg.rollout.batch_size,
            max_staleness=cfg.effective_max_staleness,
            capacity=cfg.buffer_capacity,
            start_version=state.version,
            num_buffered=lambda: len(buffer),
        )

        def on_discard(group, reason: str) -> None:
            admission.discarded()
            loop.on_discard(group, reason)

        def on_group(group) -> None:
            loop.on_group(group)
            buffer.put(group)

        async def on_published(version: int) -> None:
            admission.set_version(version)
            await receiver.grant()

        buffer = Buffer(
            capacity=cfg.buffer_capacity,
            max_staleness=cfg.effective_max_staleness,
            filters=["generation_failed", *cfg.buffer.filters],
            on_discard=on_discard,
        )
        receiver = StreamReceiver(
            f"tcp://{self.spawner.reachable(cfg.buffer.host)}:{cfg.buffer.port}",
            credits=admission,
            on_group=on_group,
            on_report=lambda report: loop.on_report(report),
        )
        group_backend = weight_backend(cfg, device.type)
        publisher = WeightPublisher(
            weights=backend.hf_weights,
            members=self.fleet.live_clients,
            on_published=on_published,
            bucket_bytes=cfg.weights.bucket_bytes,
            flattened=cfg.weights.flattened_buckets,
            pause_mode=cfg.weights.pause_mode,
            group_backend=group_backend,
            master_address=self.spawner.reachable(cfg.weights.master_address),
            staging_device=str(device) if group_backend in ("nccl", "ipc") else "cpu",
            stages=self._remote_stages(group_backend),
        )
        loop = LearnerLoop(
            cfg,
            backend=backend,
            buffer=buffer,
            receiver=receiver,
            publisher=publisher,
            metrics=metrics,
            run_dir=self.run_dir,
            state=state,
            pad_id=pad_token_id(backend),
        )
        return _Parts(admission, buffer, receiver, publisher, loop)

    def _remote_stages(self, group_backend: str):
        """Pipeline stages 1..PP-1 publish from their own ranks (None without PP)."""
        if self.leader is None or not self.leader.stage_publisher_ranks:
            return None
        from streamrl.actors.stage_publish import RemoteStages

        return RemoteStages(self.leader, staging="cuda" if group_backend == "nccl" else "cpu")

    async def _train(self, parts: _Parts, rollout: ProcessHandle) -> dict[str, int | None]:
        """Run the learner loop to `train.steps` with everything around it; stop in order:
        final checkpoint, engines settled on the final version, rollout, learner ranks."""
        cfg, fleet = self.cfg, self.fleet
        async with anyio.create_task_group() as tg:
            await tg.start(parts.receiver.run)
            await tg.start(parts.publisher.run)
            if not cfg.engine.urls:
                tg.start_soon(fleet.monitor, parts.publisher)
            watch = anyio.CancelScope()
            tg.start_soon(_watch, rollout, watch)
            await parts.loop.run()
            if not cfg.train.save_interval or parts.loop.state.step % cfg.train.save_interval:
                await parts.loop.save()
            watch.cancel()
            with anyio.fail_after(cfg.engine.startup_timeout_s):
                await fleet.wait_settled()  # an engine mid-restart gets the final weights
            await self._final_resync(parts.publisher, fleet)
            engine_versions = await fleet.versions()
            await parts.receiver.stop("training finished")
            await _wait_exit(rollout, timeout_s=30.0)
            tg.cancel_scope.cancel()
        if self.leader is not None:
            self.leader.close()
            await anyio.to_thread.run_sync(self.ranks.wait, 120.0)
        return engine_versions

    def _start_learner_ranks(self, model_path: str, device) -> None:
        """Learner ranks 1..N-1 (megatron with learner.num_gpus > 1); this process is rank 0."""
        world_size = self.cfg.learner.num_gpus
        if self.cfg.learner.backend != "megatron":
            return
        from streamrl.learners.megatron.launch import init_distributed, start_ranks

        (self.run_dir / "learner.json").write_text(json.dumps({"model_path": model_path}) + "\n")
        env = {}
        if self.cfg.cluster.learner_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.cfg.cluster.learner_gpus))
        if world_size > 1:
            self.ranks = start_ranks(
                streamrl_argv(
                    "--log-level",
                    self.cfg.logging.level,
                    "_component",
                    "learner",
                    "--run-dir",
                    str(self.run_dir),
                ),
                world_size=world_size,
                ranks=range(1, world_size),
                log_dir=self.run_dir / "logs",
                env=env,
            )
            port = self.ranks.master_port
        else:
            from streamrl.launch.process import free_port

            port = free_port()
        init_distributed(rank=0, world_size=world_size, master_port=port, device=device.type)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    @staticmethod
    async def _final_resync(publisher, fleet) -> None:
        """Engines that came back during the last step hold the version of the snapshot
        they were synced from; bring every engine to the final one."""
        versions = await fleet.versions()
        if len(set(versions.values())) > 1:
            await publisher.resync()

    def _start_rollout(self, address: str, model_path: str, state) -> ProcessHandle:
        spec = {
            "buffer_address": address,
            "engine_urls": self.fleet.urls,
            "router_url": self.fleet.router_url,
            "model_path": model_path,
            "position": {"next_seq": state.next_seq, "skip": list(state.skip)},
            "start_version": state.version,
        }
        (self.run_dir / "rollout.json").write_text(json.dumps(spec, indent=2) + "\n")
        child = self.spawner.spawn(
            "rollout",
            streamrl_argv(
                "--log-level",
                self.cfg.logging.level,
                "_component",
                "rollout",
                "--run-dir",
                str(self.run_dir),
            ),
            log_path=self.run_dir / "logs" / "rollout.log",
        )
        self.children.append(child)
        return child


async def _watch(child: ProcessHandle, scope: anyio.CancelScope) -> None:
    """Fail the run if `child` exits before `scope` is cancelled (it was told to stop)."""
    with scope:
        code = await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    if scope.cancel_called:
        return
    raise RunError(
        f"the {child.name} process exited with code {code} during training; "
        f"last lines of {child.log_path}:\n{child.log_tail()}"
    )


async def _wait_exit(child: ProcessHandle, *, timeout_s: float) -> None:
    with anyio.move_on_after(timeout_s):
        await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)


def _summary(cfg, parts: _Parts, fleet, wall_s: float) -> dict[str, Any]:
    loop, buffer, receiver, admission = parts.loop, parts.buffer, parts.receiver, parts.admission
    stats = buffer.stats
    rollout = loop._rollout
    started = int(rollout.get("groups_started", admission.num_granted))
    received = receiver.stats.num_groups
    buffered = len(buffer)
    accounted = stats.num_handed_out + stats.num_filtered + stats.num_evicted
    return {
        "steps": loop.state.step,
        "version": loop.version,
        "wall_s": wall_s,
        "groups_started": started,
        "groups_received": received,
        "groups_trained": stats.num_handed_out,
        "groups_filtered": stats.num_filtered,
        "groups_evicted": stats.num_evicted,
        "groups_buffered_at_stop": buffered,
        "groups_in_flight_at_stop": started - received,
        "groups_duplicate": receiver.stats.num_duplicates,
        "bad_frames": receiver.stats.num_bad_frames,
        "accounting_ok": received == accounted + buffered and started >= received,
        "engine_restarts": fleet.restart_counts(),
        "buffer": stats.as_dict(),
        "rollout": rollout,
    }
