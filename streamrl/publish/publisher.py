"""The weight publisher: new versions from the learner to every engine, off the learner's path.

    learner step v done ─► publish(v): wait for the previous update (stall), stage the
                           weights into flat staging buckets (stall), return
    background:            prepare (maybe staging the update on the engines) ─► pause
                           the engines that need it ─► send (the last call tags
                           weight_version v) ─► continue them ─► settle
                           ─► on_published(v) (admission lets B more groups start)

How the buckets reach the engines is the transport's (`streamrl.publish.transport`:
weight-update groups, CUDA IPC handles, or adapter files); the publisher owns the order,
the pause, the records and the resync. An update that fails (an engine died mid-update)
is recorded and dropped; the fleet restarts the engine, `invalidate`s the transport and
asks for a `resync`, which sends the newest staged version again at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from streamrl.config.sections import EMPTYING_PAUSES
from streamrl.fleet.client import EngineClient, EngineError
from streamrl.fleet.engine_set import each_engine
from streamrl.publish.transport import Staged, WeightSource, WeightTransport
from streamrl.weights.digest import build_kernel
from streamrl.weights.staging import Staging

log = logging.getLogger(__name__)


@dataclass
class PublishRecord:
    """What one weight update cost."""

    version: int
    learner_stall_s: float = 0.0
    snapshot_s: float = 0.0
    engine_pause_s: float = 0.0
    """The longest any engine stood still: from pause_generation to continue_generation's
    answer for an engine paused around the send; what the engine measured for one that
    loaded a staged update at a step boundary by itself."""
    staging_s: float = 0.0
    """Handing the bytes over before any pause (staged updates: mapped, digest checked)."""
    broadcast_s: float = 0.0
    staging_parts: dict[str, float] = field(default_factory=dict)
    """Where `staging_s` went, and what the transport's preparation spent before it
    (`WeightTransport.staging_parts`)."""
    send_parts: dict[str, float] = field(default_factory=dict)
    """Where `broadcast_s` went (`WeightTransport.send_parts`)."""
    snapshot_parts: dict[str, float] = field(default_factory=dict)
    """Where `snapshot_s` went on a GPU (`Staging.last_parts`)."""
    num_bytes: int = 0
    num_engines: int = 0
    ok: bool = True

    @property
    def gb_per_s(self) -> float:
        """Bytes over the time they travelled: staged, then sent."""
        seconds = self.staging_s + self.broadcast_s
        return self.num_bytes / seconds / 1e9 if seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "weights/version": self.version,
            "weights/learner_stall_s": self.learner_stall_s,
            "weights/snapshot_s": self.snapshot_s,
            "weights/engine_pause_s": self.engine_pause_s,
            "weights/staging_s": self.staging_s,
            "weights/broadcast_s": self.broadcast_s,
            "weights/bytes": self.num_bytes,
            "weights/gb_per_s": self.gb_per_s,
            "weights/num_engines": self.num_engines,
            "weights/ok": self.ok,
            **{f"weights/staging/{part}": s for part, s in self.staging_parts.items()},
            **{f"weights/send/{part}": s for part, s in self.send_parts.items()},
            **{f"weights/snapshot/{part}": s for part, s in self.snapshot_parts.items()},
        }


@dataclass
class WeightPublisher:
    """Stages each version and runs its update in the background (see the module docstring)."""

    weights: WeightSource
    """The learner's current weights under Hugging Face names (full tensors)."""
    members: Callable[[], list[EngineClient]]
    """Engines that should hold the newest weights (the fleet's live engines)."""
    on_published: Callable[[int], Awaitable[None]]
    transport: WeightTransport
    """How the staged buckets reach the engines (`streamrl.publish.factory` picks it)."""
    pause_mode: str
    """How the engines pause for an update: `weights.pause_mode` resolved (`RunConfig.pause_mode`;
    no default here, the run's is the config's)."""
    bucket_bytes: int = 512 * 1024 * 1024
    staging_device: str = "cpu"
    records: list[PublishRecord] = field(default_factory=list)
    _idle: anyio.Event = field(default_factory=anyio.Event)
    _busy: bool = False
    _latest: Staged | None = None
    _task_group: anyio.abc.TaskGroup | None = None
    _staging: Staging = field(init=False)

    def __post_init__(self) -> None:
        self._staging = Staging(self.bucket_bytes, self.staging_device)

    @property
    def num_digest_mismatches(self) -> int:
        """Buckets an engine received corrupted (and refused), over the run."""
        return self.transport.num_digest_mismatches

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the task group that background updates run in; cancel to stop. The digest's
        GPU kernel is built meanwhile, while the learner waits for its first batch."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                tg.start_soon(anyio.to_thread.run_sync, build_kernel, self.staging_device)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._task_group = None
            await self.transport.close()

    async def publish(self, version: int) -> PublishRecord:
        """Stage the weights as `version` and start the update; returns once the learner
        may change its weights again (the record is completed by the update)."""
        started = time.perf_counter()
        while self._busy:
            await self._idle.wait()
        # Busy from here: a resync must not send the previous version while its staging
        # buffers (here and on stage ranks) are being overwritten by this one.
        self._busy = True
        stage_started = time.perf_counter()
        try:
            staged = await anyio.to_thread.run_sync(self._stage, version)
        except BaseException:
            self._set_idle()
            raise
        record = PublishRecord(
            version=version,
            snapshot_s=time.perf_counter() - stage_started,
            num_bytes=staged.num_bytes,
            snapshot_parts=dict(self._staging.last_parts),
        )
        record.learner_stall_s = time.perf_counter() - started
        self._start(staged, record)
        return record

    async def resync(self) -> None:
        """Re-send the newest staged version (after the engine set changed) and wait for it."""
        while self._busy:
            await self._idle.wait()
        if self._latest is not None and self._task_group is not None:
            self._start(self._latest, PublishRecord(version=self._latest.version))
            while self._busy:
                await self._idle.wait()

    def invalidate(self) -> None:
        """An engine left: the transport rebuilds what it keeps before the next update."""
        self.transport.invalidate()

    async def wait_idle(self) -> None:
        while self._busy:
            await self._idle.wait()

    def _start(self, staged: Staged, record: PublishRecord) -> None:
        if self._task_group is None:
            raise RuntimeError("WeightPublisher.run() is not running")
        self._busy = True
        self._task_group.start_soon(self._update, staged, record)

    def _stage(self, version: int) -> Staged:
        staged = self.transport.stage(version, self.weights, self._staging)
        self._latest = staged
        return staged

    async def _update(self, staged: Staged, record: PublishRecord) -> None:
        failed = False
        try:
            engines = self.members()
            record.num_engines = len(engines)
            if engines:
                await self._send(staged, engines, record)
        except* (EngineError, RuntimeError, OSError) as errors:
            # An engine died mid-update; the fleet restarts it and asks for a resync.
            failed = True
            log.error(
                "weight update to version %d failed: %s",
                staged.version,
                "; ".join(str(e) for e in errors.exceptions),
            )
        try:
            record.ok = not failed
            self.records.append(record)
            if failed:
                await self.transport.drop()
            else:
                await self.on_published(staged.version)
        finally:
            self._set_idle()

    def _set_idle(self) -> None:
        self._busy = False
        self._idle.set()
        self._idle = anyio.Event()

    @property
    def flushes_cache(self) -> bool:
        """Whether the update call that tags the new version asks the engines to flush their
        prefix caches: only in `abort` and `retract_abort` modes, where the engines hold no
        request then (SGLang
        asserts that a flush it was asked for succeeds, and it cannot while requests are
        held; a cache left unflushed would serve new requests prefixes computed with the
        old weights)."""
        return self.pause_mode in EMPTYING_PAUSES

    async def _send(self, staged: Staged, engines: list[EngineClient], record: PublishRecord):
        await self.transport.prepare(engines, staged)  # the engines do not wait for it
        record.staging_s = self.transport.staging_s
        record.staging_parts = dict(self.transport.staging_parts)
        paused = [
            e
            for e in engines
            if self.pause_mode in EMPTYING_PAUSES or self.transport.needs_pause(e)
        ]
        paused_at = time.perf_counter()
        try:
            await each_engine(paused, lambda e: e.pause(self.pause_mode), what="pause")
            send_started = time.perf_counter()
            await self.transport.send(engines, staged, flush_cache=self.flushes_cache)
            record.broadcast_s = time.perf_counter() - send_started
            record.send_parts = dict(self.transport.send_parts)
        finally:
            # Whatever failed (a pause, a send, one engine's continue), every paused engine is
            # asked to continue: the live ones generate on while the fleet restarts a dead one.
            await each_engine(paused, lambda e: e.continue_generation(), what="continue_generation")
            window = time.perf_counter() - paused_at if paused else 0.0
            record.engine_pause_s = max([window, *self.transport.engine_pauses.values()])
        await self.transport.settle(engines, staged)
