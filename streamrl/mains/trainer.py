"""The trainer process (`streamrl run`, learner rank 0): the actors side by side, and the
processes it starts.

    trainer process (one anyio task group)             processes it starts (via a Spawner)
      Intake            receiver + admission + buffer ◄──ZeroMQ── rollout (`streamrl _rollout`)
      LearnerLoop       take ─► train_step ─► publish          │ /generate
      WeightPublisher   snapshot ─► pause/broadcast/continue ──┼──► engines (`streamrl engine
      EngineSupervisor  health checks, restarts, router         │    serve` or SGLang), router
                                                               └── learner ranks 1..N-1
                                                                   (`streamrl _learner`,
                                                                   streamrl.mains.ranks)

`Trainer.run()` prepares the run directory (or resumes from its newest
checkpoint: `streamrl.mains.run_dir`), starts the learner ranks and the engines while the
learner loads its model, binds the intake, starts the rollout process (kept alive by
`streamrl.mains.rollout_keeper`), trains to `train.steps`, then stops in order: final
checkpoint, engines settled on the final version, rollout, learner ranks. It returns the summary (also written to
`summary.json`). Where the processes run is the spawner's business
(`streamrl.process.LocalSpawner`, or `streamrl.launch.ray.spawner.RaySpawner`).

`train.mode = "rollout_only"` starts the engines and the rollout process but no learner
model and no weight publisher (the loop writes each step's groups); `"train_only"`
starts neither engines nor rollout (`_run_replay`: the learner trains on saved groups).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio

from streamrl import checkpoint
from streamrl.config import RunConfig
from streamrl.mains.errors import RolloutFatal, RunError
from streamrl.mains.follower import LearnerSpec
from streamrl.mains.follower import write_spec as write_learner_spec
from streamrl.mains.rollout import known_limits, resolved_tokenizer, spawn_rollout
from streamrl.mains.rollout_keeper import RolloutKeeper
from streamrl.mains.run_dir import initial_model, load_user_code, metrics_writer, prepare_run_dir
from streamrl.metrics import MetricsWriter
from streamrl.process import (
    LocalSpawner,
    ProcessHandle,
    Spawner,
    no_full_collections,
    stop_all,
)
from streamrl.queues.intake import IntakeState

log = logging.getLogger(__name__)


class Trainer:
    """One run's trainer process: its actors, and the processes it starts through `spawner`."""

    def __init__(self, cfg: RunConfig, *, resume: bool, spawner: Spawner | None = None) -> None:
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.train.output_dir)
        self.spawner: Spawner = spawner or LocalSpawner()
        self.children: list[ProcessHandle] = []
        self.supervisor = None
        self.early_rollout: ProcessHandle | None = None
        """The first rollout process, started with the engines, until RolloutKeeper adopts it."""
        self.tokenizer = None
        """The rollout's tokenizer (`resolved_tokenizer`), loaded when it starts; the torch
        learner takes it where it is the model's own (no `model.tokenizer`)."""
        self.tokenizer_class = ""
        """Its class name, passed to the rollout process."""
        self.ranks = None
        self.leader = None
        self.filters = []
        """(name, filter) pairs of buffer.filters, imported by `prepare`."""
        self._prepared: tuple[checkpoint.TrainState, str, Path | None] | None = None
        self.async_state: IntakeState | None = None
        self._is_stopped = False
        """The checkpoint's asynchronous state when resuming (buffer, fates, groups in flight)."""
        self.memory_watch = None
        self.memory: dict[str, Any] | None = None
        """Each process's measured peak memory (`summary.json` `memory`), once training ends."""
        self._engine_memory: dict[str, dict] = {}
        """What the engines report of their own allocators, read before they stop."""

    def stop(self) -> None:
        """Stop every process this trainer started (idempotent; also after a failure)."""
        if self._is_stopped:  # a second call would reach processes of a closed spawner
            return
        # All at once: after Ctrl-C or SIGTERM the run must be gone within one stop's timeout.
        stops = [child.stop for child in self.children]
        if self.ranks is not None:
            stops.append(self.ranks.stop)
        if self.supervisor is not None:
            stops.append(self.supervisor.stop)
        try:
            stop_all(stops)
        finally:
            self._is_stopped = True
            self.spawner.close()

    async def run(self) -> dict[str, Any]:
        """Train to `train.steps`; returns the summary (see the module docstring). A learner
        rank that dies stops the run with RankLost (its node, the checkpoint to resume)."""
        from streamrl.mains.ranks import rank_lost_error

        try:
            return await self._run()
        except Exception as exc:
            lost = await rank_lost_error(self.ranks, self.run_dir, exc)
            if lost is not None:
                raise lost from exc
            raise

    async def _run(self) -> dict[str, Any]:
        state, model_path, resume_from = self.prepare()
        if self.cfg.train.mode == "train_only":
            from streamrl.mains.replay import run_replay
            from streamrl.queues.rollout_files import ReplayIntake

            intake = ReplayIntake(Path(self.cfg.train.load_rollouts), start_step=state.step)
            try:
                intake.check(self.cfg.train.steps)
            except ValueError as exc:
                raise RunError(str(exc)) from None
            return await run_replay(self, intake, state, model_path, resume_from)
        with no_full_collections():  # start-up: what it builds lives as long as the run
            # First the processes that take longest to start: they load while this one
            # imports torch and builds its learner.
            self._spawn_engines_and_rollout(model_path, state.version)
            from streamrl.backends.build import learner_devices

            device, dtype = learner_devices(self.cfg)
            self.memory_watch = self._watch_memory()
            is_training = self.cfg.train.mode != "rollout_only"
            if is_training:
                self.start_learner_ranks(model_path, device)
            backend = await self._build_backend_while_engines_load(
                device, dtype, build_learner=is_training
            )
        if resume_from is not None:
            await anyio.to_thread.run_sync(backend.load, resume_from)
        metrics = self.metrics_writer()
        try:
            intake, publisher, loop = self._actors(backend, device, state, metrics)
            rollout = self._rollout_keeper(intake, loop, model_path)
            rollout.start()
            started = time.monotonic()
            try:
                engine_versions = await self._train(intake, publisher, loop, rollout)
            except BaseException as exc:  # what was generated and measured until then stays
                try:
                    self._record_memory(metrics, device, loop.state.step)
                finally:
                    error = stop_reason(exc)
                    self._write_summary(intake, loop, rollout, started, {}, error=error)
                raise
            self._record_memory(metrics, device, loop.state.step)
        finally:
            metrics.close()
            self.memory_watch.stop()
        return self._write_summary(intake, loop, rollout, started, engine_versions)

    def _write_summary(
        self,
        intake,
        loop,
        rollout: RolloutKeeper,
        started: float,
        engine_versions: dict[str, int | None],
        error: str = "",
    ) -> dict[str, Any]:
        """summary.json and accounting.json; `error` is why the run stopped early."""
        summary = {
            "steps": loop.state.step,
            "version": loop.version,
            "wall_s": time.monotonic() - started,
            **intake.summary(),
            "engine_restarts": self.supervisor.restart_counts(),
            "rollout_restarts": rollout.num_restarts,
            "engine_versions": engine_versions,
        }
        if self.memory is not None:
            summary["memory"] = self.memory
        summary["accounting_problems"] = intake.accounting_problems()
        if error:
            summary["error"] = error
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (self.run_dir / "accounting.json").write_text(json.dumps(intake.accounting_runs()) + "\n")
        return summary

    # ---- the run directory ---------------------------------------------------

    def prepare(self) -> tuple[checkpoint.TrainState, str, Path | None]:
        """Check and fill the run directory, once: (state, the model every process loads, the
        checkpoint to restore or None). RunError when `--resume` finds nothing to resume, or
        a new run finds checkpoints."""
        if self._prepared is None:
            self.filters = load_user_code(self.cfg)
            start = prepare_run_dir(self.cfg, self.run_dir, resume=self.resume)
            self.async_state = start.async_state
            self._prepared = (start.state, start.model_path, start.resume_from)
        return self._prepared

    def metrics_writer(self) -> MetricsWriter:
        """The run's metrics writer (`run_dir/metrics.jsonl` and what `logging` adds)."""
        return metrics_writer(self.cfg, self.run_dir)

    # ---- starting ------------------------------------------------------------

    def build_learner(self, device, dtype):
        """This rank's learner backend, built from what `prepare` decided (a resume then
        restores the checkpoint into it with `backend.load`)."""
        from streamrl.backends.build import build_backend

        _, model_path, _ = self.prepare()
        return build_backend(
            self.cfg,
            model_path,
            device,
            dtype,
            reference_path=self.reference_path,
            tokenizer=None if self.cfg.model.tokenizer else self.tokenizer,
        )

    @property
    def reference_path(self) -> str:
        """The KL reference: the run's initial model, on every start and every resume (a
        resume loads the policy from its checkpoint, never the reference)."""
        return initial_model(self.cfg, self.run_dir)

    def start_learner_ranks(self, model_path: str, device) -> None:
        """Learner ranks 1..N-1 (megatron with learner.num_gpus > 1), through the spawner:
        children here, or Ray actors on their nodes; this process is rank 0
        (`streamrl.mains.ranks`)."""
        if self.cfg.learner.backend != "megatron":
            return
        from streamrl.mains.ranks import start_learner_ranks

        write_learner_spec(
            self.run_dir, LearnerSpec(model_path=model_path, reference_path=self.reference_path)
        )
        self.ranks = start_learner_ranks(self.cfg, self.run_dir, self.spawner, device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    def _spawn_engines_and_rollout(self, model_path: str, version: int) -> None:
        """Start the engines, and the rollout process, which loads its tokenizer and then
        waits for its spec (`RolloutKeeper.start`). From the main thread: children die with
        the thread that spawned them."""
        from streamrl.fleet.commands import engine_argv_factory
        from streamrl.fleet.supervisor import EngineSupervisor

        self.supervisor = EngineSupervisor(
            self.cfg,
            run_dir=self.run_dir,
            engine_argv=engine_argv_factory(
                self.cfg, model_path, version, lora_adapter=self._start_adapter()
            ),
            spawner=self.spawner,
        )
        self.supervisor.spawn()
        self.tokenizer = resolved_tokenizer(self.cfg, model_path)
        if self.tokenizer is not None:
            self.tokenizer_class = type(self.tokenizer).__name__
        self.early_rollout = spawn_rollout(
            self.spawner, self.run_dir, tokenizer=model_path, log_level=self.cfg.logging.level,
            tokenizer_class=self.tokenizer_class,
        )  # fmt: skip
        self.children.append(self.early_rollout)

    async def _build_backend_while_engines_load(self, device, dtype, *, build_learner: bool):
        """The learner, built in a thread while the main thread waits for the engines (and
        starts the router); None without `build_learner` (rollout_only)."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            backend_future = pool.submit(
                self.build_learner if build_learner else lambda *args: None, device, dtype
            )
            self.supervisor.wait_serving()
            backend = await anyio.to_thread.run_sync(backend_future.result)
        return self.lead(backend)

    def _start_adapter(self) -> str:
        """The peft adapter engines load at start: a resumed LoRA run's checkpoint (whose
        version they are tagged with), else none."""
        _, _, resume_from = self.prepare()
        if not self.cfg.learner.lora.is_enabled or resume_from is None:
            return ""
        return str(resume_from)

    def lead(self, backend):
        """With learner ranks > 0, rank 0's calls go through a Leader that they follow."""
        if self.ranks is not None:
            from streamrl.backends.ranks import Leader

            backend = self.leader = Leader(backend)
        return backend

    def _actors(self, backend, device, state: checkpoint.TrainState, metrics: MetricsWriter):
        """The intake, the weight publisher and the learner loop of this run, connected: the
        publisher reports new versions to the intake; the loop sees the intake and publisher."""
        from streamrl.actors.auto_staleness import start_bound
        from streamrl.queues.intake import Intake

        cfg = self.cfg
        intake = Intake(
            f"tcp://{self.spawner.reachable(cfg.buffer.host)}:{cfg.buffer.port}",
            batch_size=cfg.rollout.batch_size,
            max_staleness=start_bound(cfg, state.staleness_bound),
            capacity=cfg.buffer_capacity,
            filters=self.filters,
            start_version=state.version,
            staleness_rule=cfg.buffer.staleness_rule,
            max_episode_staleness=cfg.buffer.max_episode_staleness,
            groups_per_step=cfg.groups_started_per_step,
        )
        if self.async_state is not None:
            intake.restore(self.async_state)
        publisher = None
        if backend is not None:
            from streamrl.publish.factory import weight_publisher

            publisher = weight_publisher(
                cfg,
                weights=backend.hf_weights,
                members=self.supervisor.live_clients,
                on_published=intake.on_published,
                device=device,
                master_address=self.spawner.reachable(cfg.weights.master_address),
                adapter_directory=self.run_dir / "adapters",
                base_model=self.reference_path,
                leader=self.leader,
            )
        advance = intake.on_published if backend is None else None  # rollout_only
        loop = self.learner_loop(
            backend,
            intake,
            publisher,
            state,
            metrics,
            advance=advance,
            set_staleness=intake.set_max_staleness if cfg.buffer.is_auto else None,
        )
        return intake, publisher, loop

    def _rollout_keeper(self, intake, loop, model_path: str) -> RolloutKeeper:
        """The keeper of the rollout process; it adopts the one started with the engines."""
        saved = self.async_state
        keeper = RolloutKeeper(
            self.cfg,
            run_dir=self.run_dir,
            spawner=self.spawner,
            engines=self.supervisor,
            intake=intake,
            loop=loop,
            model_path=model_path,
            children=self.children,
            saved_in_flight=list(saved.in_flight) if saved is not None else [],
            waiting=self.early_rollout,
            tokenizer_class=self.tokenizer_class,
            limits=known_limits(model_path),
        )
        self.early_rollout = None
        return keeper

    def learner_loop(
        self, backend, source, publisher, state, metrics, *, advance=None, set_staleness=None
    ):
        """The run's learner loop on a step source: the live intake, or the saved rollouts
        of `train_only` (`streamrl.mains.replay`)."""
        from streamrl.actors.learner import LearnerLoop
        from streamrl.backends.build import pad_token_id

        return LearnerLoop(
            self.cfg,
            backend=backend,
            source=source,
            publisher=publisher,
            metrics=metrics,
            run_dir=self.run_dir,
            state=state,
            pad_id=pad_token_id(backend),
            writer=self.rollout_writer(),
            advance=advance,
            set_staleness=set_staleness,
        )

    def rollout_writer(self):
        """The writer of each step's groups (rollout_only, or train.save_rollouts), or None."""
        if self.cfg.train.mode != "rollout_only" and not self.cfg.train.save_rollouts:
            return None
        from streamrl.queues.rollout_files import RolloutWriter

        return RolloutWriter(self.run_dir)

    # ---- measured memory -------------------------------------------------------

    def _watch_memory(self):
        """Sample this process (learner rank 0) and the engines it started for their peak
        GPU and host memory until training ends (`streamrl.memory_use`)."""
        import os

        from streamrl.memory_use import MemoryWatch

        def processes() -> dict[str, int]:
            return {"learner rank 0": os.getpid(), **self.supervisor.pids()}

        return MemoryWatch(
            processes,
            interval_s=self.cfg.logging.memory_interval_s,
            without_children=frozenset({"learner rank 0"}),  # its children are the others
        ).start()

    def _record_memory(self, metrics: MetricsWriter, device, step: int) -> None:
        """The run's measured peaks: `summary.json` `memory` and one `kind = "memory"`
        record in metrics.jsonl (`memory/<process>/<figure>`, bytes; a figure the machine
        cannot measure is absent, never zero)."""
        from streamrl.memory_use import measured_peak, torch_peaks

        self.memory_watch.stop()
        memory = self.memory_watch.to_dict()
        processes = memory["processes"]
        if "learner rank 0" in processes and self.cfg.train.mode != "rollout_only":
            processes["learner rank 0"].update(torch_peaks(device))
        for name, report in self._engine_memory.items():
            processes.setdefault(name, {}).update(report)
        record: dict[str, Any] = {"kind": "memory", "step": step}
        for name, figures in processes.items():
            figures["measured_peak_bytes"], figures["measured_as"] = measured_peak(figures)
            for figure, value in figures.items():
                if isinstance(value, int) and figure != "pid":
                    record[f"memory/{name.replace(' ', '_')}/{figure}"] = value
        self.memory = memory
        metrics.write(record, step=step)

    # ---- training --------------------------------------------------------------

    async def _train(
        self, intake, publisher, loop, rollout: RolloutKeeper
    ) -> dict[str, int | None]:
        """Run the learner loop to `train.steps` with everything around it; stop in order:
        final checkpoint, engines settled on the final version, rollout, learner ranks."""
        from streamrl.fleet.supervisor import InitialWeights

        cfg, supervisor = self.cfg, self.supervisor
        async with anyio.create_task_group() as tg:
            await tg.start(intake.run)
            if publisher is not None:
                await tg.start(publisher.run)
            if not cfg.engine.urls:
                tg.start_soon(supervisor.monitor, publisher or InitialWeights())
            watch = anyio.CancelScope()
            tg.start_soon(rollout.keep_alive, watch)
            if self.ranks is not None:
                from streamrl.mains.ranks import watch_ranks

                tg.start_soon(watch_ranks, self.ranks, self.run_dir)
            await loop.run()
            is_saved = cfg.train.save_interval and loop.state.step % cfg.train.save_interval == 0
            is_saved = is_saved or loop.last_checkpoint_step == loop.state.step  # (colocated)
            if loop.backend is not None and not is_saved and cfg.train.save_final:
                await loop.save()
            watch.cancel()
            with anyio.fail_after(cfg.engine.startup_timeout_s):
                await supervisor.wait_settled()  # an engine mid-restart gets the final weights
            if publisher is not None:
                await _final_resync(publisher, supervisor)
            engine_versions = await supervisor.versions()
            self._engine_memory = await supervisor.memory_reports()
            await intake.stop("training finished")
            await rollout.wait_exit(timeout_s=30.0)
            loop.record_eval_reports()
            tg.cancel_scope.cancel()
        if self.leader is not None:
            self.leader.close()
            await anyio.to_thread.run_sync(self.ranks.wait, 120.0)
        return engine_versions


def stop_reason(exc: BaseException) -> str:
    """summary.json's `error` for a run that stopped before `train.steps`: a rollout's fatal
    error as it was sent, an interrupt (Ctrl-C, SIGTERM, a timeout's kill) as such, else
    the exception."""
    interrupts = (KeyboardInterrupt, anyio.get_cancelled_exc_class())
    if isinstance(exc, BaseExceptionGroup):
        fatal, _ = exc.split(RolloutFatal)
        if fatal is not None:
            leaf = fatal
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return str(leaf)
        _, others = exc.split(interrupts)
        if others is None:  # an interrupt that reached the run inside a task group
            return INTERRUPTED
    if isinstance(exc, RolloutFatal):
        return str(exc)
    if isinstance(exc, interrupts):
        return INTERRUPTED
    return f"{type(exc).__name__}: {exc}"


INTERRUPTED = "interrupted (Ctrl-C, SIGTERM or a timeout) before train.steps"


async def _final_resync(publisher, supervisor) -> None:
    """Engines that came back during the last step hold the version of the snapshot they
    were synced from; bring every engine to the final one."""
    versions = await supervisor.versions()
    if len(set(versions.values())) > 1:
        await publisher.resync()
