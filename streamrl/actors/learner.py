"""The learner loop: the always-running consumer of a step source.

    for each step:   groups = await source.take(B, version)    # waits only when the buffer is short
                     metrics = train_step(groups)               # in a worker thread
                     version += 1
                     await publisher.publish(version)           # snapshot; broadcast runs behind
                                                                # (every weights.update_interval
                                                                # versions, and the last one)
                     record metrics; checkpoint every train.save_interval steps
                                                                # (copied; written behind:
                                                                # streamrl.actors.checkpoints)

The loop sees the step source (`streamrl.queues.source.StepSource`: a step's batch, its
counters, the stall report, a checkpoint's cut), the publisher, the backend and the
metrics writer; a step's record is assembled in `streamrl.actors.step_metrics`.

What unblocks the wait, with the live stream (`Intake`): the rollout delivering groups,
which it may start only with admission credits; credits come back as the buffer drains
(`take`) and as the publisher lands new versions on the engines (the publisher's
`on_published` is the intake's). While the wait lasts past `train.stall_warning_s`, the
terminal says why (`streamrl.actors.stall`).

Colocated mode (`cluster.colocate`, sync only) wraps the step in a memory handoff
(`streamrl.actors.colocate`): the engines release their memory before the step, the
learner offloads after it, and every version is pushed to the resumed engines and waited
for before they generate again; a checkpoint is copied right after the step, while the
learner still holds its state.

The debug modes of `train.mode` change the loop's parts, not its shape: `rollout_only`
has no backend and no publisher (each step's groups are written by the `RolloutWriter`,
and `advance` tells admission a step passed so generation goes on at the same pace, while
the policy stays version 0); `train_only` has no publisher and its step source is the
saved files (`streamrl.queues.rollout_files.ReplayIntake`). `train.save_rollouts` adds
the writer to the other modes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from streamrl import checkpoint, logs
from streamrl.actors.auto_staleness import AutoStaleness, Observation
from streamrl.actors.checkpoints import BackgroundCheckpoints
from streamrl.actors.colocate import MemoryHandoff
from streamrl.actors.stall import StallWatch, describe_stall, stall_record, wait_watched
from streamrl.actors.step_metrics import StepTimes, publish_metrics, step_record
from streamrl.backends.base import LearnerBackend
from streamrl.backends.step import train_step
from streamrl.config import RunConfig
from streamrl.metrics import MetricsWriter
from streamrl.publish.publisher import PublishRecord, WeightPublisher
from streamrl.queues.accounting import AccountingError, DataPosition, position_after
from streamrl.queues.protocol import Report
from streamrl.queues.rollout_files import RolloutWriter
from streamrl.queues.source import StepSource
from streamrl.types import Group, make_encoder

log = logging.getLogger(__name__)

CUT_TIMEOUT_S = 120.0
"""A checkpoint waits this long for the rollout's groups in flight (it holds generation
for the cut alone), else is written without them."""


class LearnerLoop:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        backend: LearnerBackend | None,
        source: StepSource,
        publisher: WeightPublisher | None,
        metrics: MetricsWriter,
        run_dir: Path,
        state: checkpoint.TrainState,
        pad_id: int,
        writer: RolloutWriter | None = None,
        advance: Callable[[int], Awaitable[None]] | None = None,
        set_staleness: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """`backend` None: nothing is trained (`rollout_only`); `publisher` None: no engines
        take weights (`rollout_only`, `train_only`); `writer`: each step's groups are saved;
        `advance(step)`: called after each untrained step (`rollout_only`: the intake's
        `on_published`, so a step's groups may start); `set_staleness(bound)`: where the
        bound of `buffer.max_staleness = "auto"` goes (the intake's `set_max_staleness`)."""
        self.cfg = cfg
        self.backend = backend
        self.source = source
        self.publisher = publisher
        self.metrics = metrics
        self.run_dir = run_dir
        self.state = state
        self.pad_id = pad_id
        self.writer = writer
        self.advance = advance
        self.version = state.version
        self.published_version = state.version
        """The newest version handed to the publisher; the engines start on the run's (or
        the checkpoint's) own."""
        self.start_position = DataPosition(next_seq=state.next_seq, skip=list(state.skip))
        stall_s = cfg.train.stall_warning_s
        self.stall = StallWatch(stall_s) if stall_s else None
        """Times the wait for each batch (None: `train.stall_warning_s = 0`, no report)."""
        self._trained_tokens = 0
        self._staging_reserved = False
        """Whether this process's checkpoint staging buffers are reserved or allocated."""
        self.checkpoints = BackgroundCheckpoints(
            run_dir, keep=cfg.train.keep_checkpoints, metrics=metrics
        )
        """The checkpoint write in flight (`streamrl.actors.checkpoints`)."""
        self.set_staleness = set_staleness
        self.staleness = (
            AutoStaleness.for_run(cfg, start=state.staleness_bound) if set_staleness else None
        )
        """The auto bound's controller (None: the bound is fixed)."""
        self.handoff = None
        """Colocated mode's memory handoff around each step (`streamrl.actors.colocate`)."""
        if cfg.cluster.colocate and backend is not None and publisher is not None:
            self.handoff = MemoryHandoff(backend, publisher.members, offload=cfg.learner.offload)
        self.last_checkpoint_step: int | None = None
        """The step of the newest checkpoint started (None: none yet)."""

    def record_eval_reports(self) -> None:
        """Write the evaluation results that arrived since the last call to the metrics."""
        for report in self.source.pop_eval_reports():
            self._record_eval(report)

    def _record_eval(self, report: Report) -> None:
        payload = dict(report.payload)
        name = payload.pop("dataset")
        version = int(payload.pop("version"))
        record: dict[str, Any] = {
            "kind": "eval",
            "dataset": name,
            "step": self.state.step,
            "version": version,
            "time": self.metrics.elapsed_s,
        }
        record.update({f"eval/{name}/{key}": value for key, value in payload.items()})
        self.metrics.write(record, step=version)
        log.info("eval %s at version %d: reward %.3f", name, version, payload["reward_mean"])

    # ---- the loop --------------------------------------------------------

    async def run(self) -> checkpoint.TrainState:
        batch_size = self.cfg.rollout.batch_size
        if self.handoff is not None:
            await self.handoff.start()
        while self.state.step < self.cfg.train.steps:
            wait_started = time.perf_counter()
            groups = await self._take_reserving(batch_size)
            groups.sort(key=lambda group: group.prompt_seq)  # rows in one order, run after run
            idle_s = time.perf_counter() - wait_started
            if self.writer is not None:
                await anyio.to_thread.run_sync(self.writer.write, self.state.step + 1, groups)
            step_started = time.perf_counter()
            trained_version = self.version
            if self.backend is None:  # rollout_only: the policy stays where it is
                train_metrics = {"train/trained_tokens": 0.0}
                if self.advance is not None:
                    await self.advance(self.state.step + 1)  # a step's credits
            else:
                if self.handoff is not None:
                    await self.handoff.to_learner()
                train_metrics = await anyio.to_thread.run_sync(self._train, groups)
                self.version += 1
            train_s = time.perf_counter() - step_started
            self.state.step += 1
            self.state.version = self.version
            self.state.samples_trained += sum(len(g.samples) for g in groups)
            publish = None
            if self.handoff is not None:
                if self._is_checkpoint_due():  # copied while the learner holds its state
                    await self.start_checkpoint()
                publish = await self._publish_colocated()
            elif self.publisher is not None and self._is_push_due():
                publish = await self._publish()
            self._trained_tokens += int(train_metrics["train/trained_tokens"])
            times = StepTimes(
                step=self.state.step,
                version=self.version,
                trained_version=trained_version,
                idle_s=idle_s,
                train_s=train_s,
                elapsed_s=self.metrics.elapsed_s,
                samples_trained=self.state.samples_trained,
                trained_tokens=self._trained_tokens,
            )
            stats = self.source.stats()
            record = step_record(groups, times, stats, train_metrics)
            record.update(publish_metrics(publish, self.publisher))
            if self.handoff is not None:
                record.update(self.handoff.metrics)
            record["step_time_s"] = time.perf_counter() - wait_started
            record.update(await self._tune_staleness(idle_s, record))
            self.metrics.write(record, step=self.state.step)
            if stats.accounting_problems:
                raise AccountingError(
                    f"step {self.state.step}: the group accounting does not add up "
                    f"({record['accounting/started']} started, {record['accounting/trained']} "
                    f"trained, {record['accounting/filtered']} filtered, "
                    f"{record['accounting/evicted']} evicted, {record['accounting/buffered']} "
                    f"buffered, {record['accounting/in_flight']} in flight): "
                    + "; ".join(stats.accounting_problems)
                )
            self.metrics.print_step(record, self.cfg.train.steps)
            self.record_eval_reports()
            self.checkpoints.collect()
            if self.handoff is None and self._is_checkpoint_due():
                await self.start_checkpoint()
            await self._reserve_checkpoint_staging()
        await self.checkpoints.wait()
        if self.publisher is not None:
            if self.published_version != self.version:  # the engines end on the last version
                await self._publish()
            await self.publisher.wait_idle()
        return self.state

    async def _tune_staleness(self, idle_s: float, record: dict[str, Any]) -> dict[str, float]:
        """The auto bound's decision on this step (`streamrl.actors.auto_staleness`), applied;
        with a fixed bound, only the bound."""
        if self.staleness is None:
            return {"staleness/bound": float(self.cfg.effective_max_staleness)}
        decision = self.staleness.observe(
            Observation(
                idle_s=idle_s,
                step_s=record["step_time_s"],
                mismatch_kl=record.get("train/mismatch_kl"),
                importance_ess=record.get("train/importance_ess"),
            )
        )
        if decision.change:
            await self.set_staleness(decision.bound)
        self.state.staleness_bound = decision.bound
        return decision.metrics()

    def _is_checkpoint_due(self) -> bool:
        """Every `train.save_interval` steps; in colocated mode also the last step unless
        `train.save_final` is off (after it the learner's state is on the host, where `save`
        cannot copy it from)."""
        if self.backend is None:
            return False
        train = self.cfg.train
        interval = train.save_interval
        is_last = self.handoff is not None and train.save_final and self.state.step == train.steps
        return bool(interval and self.state.step % interval == 0) or is_last

    async def _publish_colocated(self) -> PublishRecord:
        """Colocated mode: every version goes to the engines once they have their memory
        back, and the step waits until they hold it (`MemoryHandoff.to_engines`)."""
        records = []

        async def publish() -> None:
            records.append(await self._publish())
            await self.publisher.wait_idle()

        await self.handoff.to_engines(publish)
        return records[0]

    def _is_push_due(self) -> bool:
        """Whether this version goes to the engines now: every `weights.update_interval`
        versions (multiples of it, so a resumed run pushes the versions the uninterrupted
        one would have)."""
        return self.version % self.cfg.weights.update_interval == 0

    async def _publish(self) -> PublishRecord:
        record = await self.publisher.publish(self.version)
        self.published_version = self.version
        return record

    async def _take_reserving(self, num_groups: int) -> list[Group]:
        """`_take`, with the checkpoint staging's reserved buffers allocated meanwhile, a
        quarter of a second at a time, until the batch is there
        (`_reserve_checkpoint_staging`)."""
        pool = self._staging_pool()
        if pool is None or not pool.pending:
            return await self._take(num_groups)
        batch_taken = anyio.Event()

        async def allocate() -> None:
            while pool.pending and not batch_taken.is_set():
                await anyio.to_thread.run_sync(pool.allocate_pending, 0.25)

        async with anyio.create_task_group() as tg:
            tg.start_soon(allocate)
            try:
                return await self._take(num_groups)
            finally:
                batch_taken.set()

    async def _take(self, num_groups: int) -> list[Group]:
        """The next step's batch; while the wait lasts past `train.stall_warning_s`, the
        terminal says why, again every as many seconds (`streamrl.actors.stall`)."""
        if self.stall is None:
            return await self.source.take(num_groups, self.version)
        return await wait_watched(
            lambda: self.source.take(num_groups, self.version),
            self.stall,
            lambda waited_s: self._warn(waited_s, num_groups),
        )

    def _warn(self, waited_s: float, num_groups: int) -> None:
        report = self.source.progress(num_groups)
        text = describe_stall(report, waited_s=waited_s, step=self.state.step + 1)
        log.warning("%s", text, extra=logs.PACED)  # each report is new: not folded
        record = stall_record(
            report, waited_s=waited_s, step=self.state.step, elapsed_s=self.metrics.elapsed_s
        )
        self.metrics.write(record, step=self.state.step)

    def _train(self, groups: list[Group]) -> dict[str, float]:
        """One step, in a worker thread (which must be bound to the learner's GPU first)."""
        if self.backend.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.backend.device)
        return train_step(self.backend, groups, self.cfg, pad_id=self.pad_id)

    async def save(self) -> Path:
        """A checkpoint now, written before it returns (a run's last): see `start_checkpoint`."""
        path = await self.start_checkpoint()
        await self.checkpoints.wait()
        return path

    async def start_checkpoint(self) -> Path:
        """Start a checkpoint of the model, the optimizer and the run's asynchronous state:
        the intake at a cut with the rollout (buffered groups, every prompt's fate, the groups
        in flight with their tokens) and this process's random states. The learner waits for
        the previous write, the cut and the copy of its state; the write runs in the
        background (`streamrl.actors.checkpoints`). Returns the directory it will have."""
        started = time.perf_counter()
        self._staging_reserved = True  # this copy allocates what a reservation would
        wait_previous_s = await self.checkpoints.wait()
        if warning := _describe_checkpoint_wait(
            self.state.step, wait_previous_s, self.cfg.train.save_interval
        ):
            log.warning("%s", warning)
        cut = await self.source.cut(self.state.step, timeout_s=CUT_TIMEOUT_S)
        position = position_after(self.source.done_seqs, since=self.start_position)
        self.state.next_seq, self.state.skip = position.next_seq, list(position.skip)
        state = dataclasses.replace(self.state, skip=list(self.state.skip))
        files = {
            checkpoint.ASYNC_STATE_FILE: make_encoder().encode(cut),
            checkpoint.RNG_FILE: checkpoint.rng_state(),
        }
        partial = checkpoint.begin(self.run_dir, state.step)
        staging_started = time.perf_counter()
        write_model = await anyio.to_thread.run_sync(self._stage_checkpoint, partial)
        staging_s = time.perf_counter() - staging_started
        reused_bytes, allocated_bytes = self._staging_bytes()
        record = {
            "kind": "checkpoint",
            "step": state.step,
            "version": state.version,
            "time": self.metrics.elapsed_s,
            "checkpoint/snapshot_s": cut.cut_s,  # the cut's time, under its first name
            "checkpoint/rollout_pause_s": cut.rollout_pause_s,
            "checkpoint/rollout_aborts": cut.rollout_aborts,
            "checkpoint/wait_previous_s": wait_previous_s,
            "checkpoint/staging_s": staging_s,
            "checkpoint/staging_reused_bytes": reused_bytes,
            "checkpoint/staging_allocated_bytes": allocated_bytes,
            "checkpoint/stall_s": time.perf_counter() - started,
            "checkpoint/async_state_bytes": len(files[checkpoint.ASYNC_STATE_FILE]),
            "checkpoint/complete": cut.is_complete,
            "checkpoint/buffered_groups": len(cut.buffered),
            "checkpoint/in_flight_groups": len(cut.in_flight),
            "checkpoint/in_flight_samples": sum(len(g.samples) for g in cut.in_flight),
            "checkpoint/in_flight_tokens": sum(
                len(s.output_ids) for g in cut.in_flight for s in g.samples
            ),
        }
        self.checkpoints.start(state, partial, write_model, files, record)
        self.last_checkpoint_step = state.step
        log.info(
            "checkpoint of step %d started: %d groups buffered, %d in flight (cut %.2f s, "
            "copy %.2f s%s)",
            state.step,
            len(cut.buffered),
            len(cut.in_flight),
            cut.cut_s,
            staging_s,
            _describe_buffers(reused_bytes, allocated_bytes),
        )
        return checkpoint.checkpoint_dir(self.run_dir) / f"step_{state.step:06d}"

    def _stage_checkpoint(self, partial: Path, staging: str = "") -> Callable[[], None]:
        """The backend's copy of its state, in a worker thread (bound to the learner's GPU)."""
        if self.backend.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.backend.device)
        return self.backend.stage_checkpoint(
            partial, staging=staging or self.cfg.train.checkpoint_staging
        )

    async def _reserve_checkpoint_staging(self) -> None:
        """After this process's first step (a resumed run's too), with checkpoints every
        `train.save_interval` steps staged in host memory (pinned, from a GPU): reserve their
        buffers in the backend's staging pool, to be allocated while the learner waits for
        its batches (`_take_reserving`) instead of at the first checkpoint
        (`streamrl.backends.staging`, `reserve`). Ranks > 0 of a Megatron learner allocate
        theirs at their first checkpoint."""
        train = self.cfg.train
        if (
            self._staging_reserved
            or self.backend is None
            or self.handoff is not None  # colocated: the state moves between host and GPU
            or train.save_interval < 2  # (1: the first checkpoint is taken at once)
            or train.checkpoint_staging != "host"
        ):
            return
        self._staging_reserved = True
        path = checkpoint.checkpoint_dir(self.run_dir) / "reserve"  # written by nobody
        await anyio.to_thread.run_sync(self._stage_checkpoint, path, "reserve")

    def _staging_pool(self):
        """Rank 0's checkpoint staging pool (`streamrl.backends.staging.StagingPool`; None for
        a backend without one)."""
        inner = getattr(self.backend, "backend", self.backend)  # rank 0's under a `Leader`
        return getattr(inner, "staging_pool", None)

    def _staging_bytes(self) -> tuple[int, int]:
        """Bytes of host buffers this rank's last checkpoint copy reused and allocated
        (`streamrl.backends.staging.StagingPool`; 0, 0 for a backend without one)."""
        pool = self._staging_pool()
        if pool is None:
            return 0, 0
        reuse = pool.reuse()
        return reuse.reused_bytes, reuse.allocated_bytes


CHECKPOINT_WAIT_WARNING_S = 1.0
"""A checkpoint that waits longer than this for the previous one's write says so."""


def _describe_checkpoint_wait(step: int, waited_s: float, interval: int) -> str | None:
    """The log's warning for a checkpoint that waited for the previous one's write (None
    when it hardly did): the learner stood still meanwhile."""
    if waited_s <= CHECKPOINT_WAIT_WARNING_S:
        return None
    return (
        f"the checkpoint of step {step} waited {waited_s:.1f} s for the previous checkpoint's "
        f"write, with the learner standing still: the writes take longer than "
        f"train.save_interval = {interval} steps; raise it, or write to faster storage "
        f"(checkpoint/wait_previous_s, checkpoint/write_s)"
    )


def _describe_buffers(reused_bytes: int, allocated_bytes: int) -> str:
    """The log's words for a copy's host buffers ("" when it had none)."""
    amounts = [
        f"{verb} {num_bytes / 1e9:.2f} GB"
        for verb, num_bytes in (("reused", reused_bytes), ("allocated", allocated_bytes))
        if num_bytes
    ]
    return f", {' and '.join(amounts)} of staging buffers" if amounts else ""
