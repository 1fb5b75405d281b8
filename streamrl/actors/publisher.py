"""The weight publisher: new versions from the learner to every engine, off the learner's path.

    learner step v done ─► publish(v): wait for the previous broadcast (stall), pack
                           the weights into flat staging buckets (stall), return
    background:            pause engines ─► per bucket: engines' update call in flight while
                           rank 0 broadcasts ─► last bucket tags weight_version v ─► continue
                           ─► on_published(v) (admission lets B more groups start)

A bucket is one flat uint8 buffer (the staging buffers are allocated once and
reused); with `flattened = True` it travels as one broadcast (SGLang's
`load_format = "flattened_bucket"`), otherwise as one broadcast per tensor,
which every SGLang release accepts. An engine on the learner's own device
(`transport = "ipc"`) joins no group: it maps each bucket by CUDA IPC handle
through `/update_weights_from_tensor` and copies it in (`streamrl.weights.ipc`).

The weight-update group is built the way SGLang builds it (see
`streamrl.weights.group`): the learner is rank 0 and each engine joins as
one rank per GPU, from 1 + (GPUs of the engines before it); see
`streamrl.weights.layout`. It is rebuilt whenever the set of engines changes (an engine restarted),
and a rebuilt group is brought to the current version at once (`resync`).

With LoRA the weights are the adapters (`streamrl.weights.adapters`): the same buckets,
tags and digests, and embedded engines merge them into the base weights they keep. SGLang
engines instead load each version's adapters from a peft directory (`adapter_push`,
`streamrl.fleet.adapters`), with no weight-update group.

With pipeline parallelism (`stages`) every stage has its own group over the
same engines: stage 0's is this process's, stage s's is hosted by stage s's
publisher rank, which snapshots and broadcasts its own layers when told
(`streamrl.weights.stages`). The engines' calls all come from here:
stage 0's buckets, then each other stage's, and only the very last bucket
tags the new version.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio
import torch

from streamrl.actors.update_groups import UpdateGroup, UpdateGroups
from streamrl.fleet.adapters import SGLangAdapterPush
from streamrl.fleet.client import EngineClient, EngineError, engine_gpu_counts
from streamrl.weights.digest import digest
from streamrl.weights.group import (
    FLATTENED_BUCKET,
    broadcast_flat,
    broadcast_tensors,
)
from streamrl.weights.ipc import serialize_named_tensors
from streamrl.weights.stages import BucketSpec, RemoteStages, Send, StagePlan
from streamrl.weights.staging import Bucket, Staging

log = logging.getLogger(__name__)

MAX_RESENDS = 2
"""Sends of one bucket after a digest mismatch before the update fails."""
IPC = "ipc"
"""`transport` for engines on the learner's own device: no group, weights by reference."""


@dataclass
class Snapshot:
    version: int
    buckets: list[Bucket]
    stages: list[StagePlan] = field(default_factory=list)
    """Pipeline stages 1..PP-1: their buckets stay staged on their own ranks."""

    @property
    def num_bytes(self) -> int:
        local = sum(bucket.layout.num_bytes for bucket in self.buckets)
        return local + sum(plan.num_bytes for plan in self.stages)


class WeightsCorrupted(RuntimeError):
    """An engine kept receiving a bucket whose bytes did not match its digest."""


@dataclass
class PublishRecord:
    """What one weight update cost."""

    version: int
    learner_stall_s: float = 0.0
    snapshot_s: float = 0.0
    engine_pause_s: float = 0.0
    broadcast_s: float = 0.0
    num_bytes: int = 0
    num_engines: int = 0
    ok: bool = True

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.broadcast_s / 1e9 if self.broadcast_s > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "weights/version": self.version,
            "weights/learner_stall_s": self.learner_stall_s,
            "weights/snapshot_s": self.snapshot_s,
            "weights/engine_pause_s": self.engine_pause_s,
            "weights/broadcast_s": self.broadcast_s,
            "weights/bytes": self.num_bytes,
            "weights/gb_per_s": self.gb_per_s,
            "weights/num_engines": self.num_engines,
            "weights/ok": self.ok,
        }


@dataclass
class WeightPublisher:
    """Owns the weight-update group and the background broadcast (see the module docstring)."""

    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    """The learner's current weights under Hugging Face names (full tensors)."""
    members: Callable[[], list[EngineClient]]
    """Engines that should hold the newest weights (the fleet's live engines)."""
    on_published: Callable[[int], Awaitable[None]]
    bucket_bytes: int = 512 * 1024 * 1024
    flattened: bool = True
    """One broadcast per bucket (`load_format = "flattened_bucket"`), else one per tensor."""
    pause_mode: str = "in_place"
    transport: str = "gloo"
    """`weights.transport` resolved: `nccl` or `gloo` (a weight-update group), or `ipc`."""
    staging_device: str = "cpu"
    master_address: str = "127.0.0.1"
    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    """Weight-group ranks (GPUs) of each engine; by default each engine's `/server_info` tp_size."""
    stages: RemoteStages | None = None
    """Pipeline stages 1..PP-1, which publish their own layers; None without PP."""
    adapter_push: SGLangAdapterPush | None = None
    """LoRA on SGLang engines: the snapshot (adapters only) goes out as a peft directory
    that each engine loads (`streamrl.fleet.adapters`), not over a group; None otherwise."""
    records: list[PublishRecord] = field(default_factory=list)
    num_digest_mismatches: int = 0
    """Buckets an engine received corrupted (and refused), over the run."""
    _groups: UpdateGroups = field(init=False)
    _idle: anyio.Event = field(default_factory=anyio.Event)
    _busy: bool = False
    _latest: Snapshot | None = None
    _task_group: anyio.abc.TaskGroup | None = None
    _staging: Staging = field(init=False)

    def __post_init__(self) -> None:
        self._staging = Staging(self.bucket_bytes, self.staging_device)
        self._groups = UpdateGroups(
            transport=self.transport,
            master_address=self.master_address,
            members=self.members,
            gpu_counts=self.gpu_counts,
            stages=self.stages,
        )

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the task group that background broadcasts run in; cancel to stop."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._task_group = None
            if self.stages is not None:
                self.stages.close()  # stage ranks destroy their groups when they stop
            await self._groups.close()

    async def publish(self, version: int) -> PublishRecord:
        """Snapshot the weights as `version` and start broadcasting; returns once the learner
        may change its weights again (the record is completed by the broadcast)."""
        started = time.perf_counter()
        while self._busy:
            await self._idle.wait()
        # Busy from here: a resync must not send the previous snapshot while its staging
        # buffers (here and on stage ranks) are being overwritten by this one.
        self._busy = True
        snapshot_started = time.perf_counter()
        try:
            snapshot = await anyio.to_thread.run_sync(self._snapshot, version)
        except BaseException:
            self._set_idle()
            raise
        record = PublishRecord(
            version=version,
            snapshot_s=time.perf_counter() - snapshot_started,
            num_bytes=snapshot.num_bytes,
        )
        record.learner_stall_s = time.perf_counter() - started
        self._start(snapshot, record)
        return record

    async def resync(self) -> None:
        """Re-send the newest snapshot (after the engine set changed) and wait for it."""
        while self._busy:
            await self._idle.wait()
        if self._latest is not None and self._task_group is not None:
            self._start(self._latest, PublishRecord(version=self._latest.version))
            while self._busy:
                await self._idle.wait()

    def invalidate(self) -> None:
        """An engine left: rebuild the groups before the next broadcast."""
        self._groups.is_stale = True

    async def wait_idle(self) -> None:
        while self._busy:
            await self._idle.wait()

    def _start(self, snapshot: Snapshot, record: PublishRecord) -> None:
        if self._task_group is None:
            raise RuntimeError("WeightPublisher.run() is not running")
        self._busy = True
        self._task_group.start_soon(self._broadcast, snapshot, record)

    def _snapshot(self, version: int) -> Snapshot:
        """Pack the weights into the staging buffers (and, with stages, have every stage rank
        stage its own layers at this version too)."""
        if self.stages is None:
            weights = self.weights()
        else:
            weights = self.stages.snapshot(version, self.bucket_bytes)
        snapshot = Snapshot(version, self._staging.pack(weights))
        if self.stages is not None:
            snapshot.stages = self.stages.plans(version)
        self._latest = snapshot
        return snapshot

    async def _broadcast(self, snapshot: Snapshot, record: PublishRecord) -> None:
        failed = False
        try:
            engines = self.members()
            record.num_engines = len(engines)
            if engines:
                await self._send(snapshot, engines, record)
        except* (EngineError, RuntimeError, OSError) as errors:
            # An engine died mid-update; the fleet restarts it and asks for a resync.
            failed = True
            log.error(
                "weight update to version %d failed: %s",
                snapshot.version,
                "; ".join(str(e) for e in errors.exceptions),
            )
        try:
            record.ok = not failed
            self.records.append(record)
            if failed:
                await self._groups.drop()
            else:
                await self.on_published(snapshot.version)
        finally:
            self._set_idle()

    def _set_idle(self) -> None:
        self._busy = False
        self._idle.set()
        self._idle = anyio.Event()

    def _flushes(self, weight_version: int | None) -> bool:
        """Whether an update call asks the engine to flush its prefix cache: on the call that
        tags the new version, and only in `abort` mode, where the engines hold no request
        (SGLang asserts that a flush it was asked for succeeds, and it cannot while
        requests are held; a cache left unflushed would serve new requests prefixes
        computed with the old weights)."""
        return weight_version is not None and self.pause_mode == "abort"

    @property
    def by_reference(self) -> bool:
        """Engines on this process's device map the staging buffers (`weights.transport = "ipc"`)
        instead of joining a group."""
        return self.transport == IPC

    async def _send(self, snapshot: Snapshot, engines: list[EngineClient], record: PublishRecord):
        if self.adapter_push is not None:
            await self._push_adapter_files(snapshot, engines, record)
            return
        if self.by_reference and snapshot.stages:
            raise RuntimeError("weights by reference (ipc) cannot carry pipeline stages")
        groups, gpu_counts = [], []
        if self.by_reference:
            gpu_counts = await self.gpu_counts(engines)
        else:
            groups = await self._groups.ensure(engines, 1 + len(snapshot.stages))
        # Digested before the pause, so the engines do not wait for it.
        digests = [await self._digest_of(bucket) for bucket in snapshot.buckets]
        paused_at = time.perf_counter()
        await _each(engines, lambda e: e.pause(self.pause_mode))
        try:
            broadcast_started = time.perf_counter()
            for index, bucket in enumerate(snapshot.buckets):
                is_last = index == len(snapshot.buckets) - 1 and not snapshot.stages
                tag = snapshot.version if is_last else None  # the version flips after the last
                if self.by_reference:
                    await self._hand_over(engines, gpu_counts, bucket, tag, digests[index])
                else:
                    await self._send_bucket(engines, groups[0], bucket, tag, digests[index])
            for plan, group in zip(snapshot.stages, groups[1:], strict=True):
                await self._send_stage(engines, group, plan, is_last=plan is snapshot.stages[-1])
            record.broadcast_s = time.perf_counter() - broadcast_started
        finally:
            await _each(engines, lambda e: e.continue_generation())
            record.engine_pause_s = time.perf_counter() - paused_at

    async def _push_adapter_files(
        self, snapshot: Snapshot, engines: list[EngineClient], record: PublishRecord
    ) -> None:
        """The snapshot's adapters written as `version`'s peft directory, then loaded by
        every engine inside one pause (`SGLangAdapterPush.push`, which tags the version)."""
        if snapshot.stages:
            raise RuntimeError("adapters as files come from one pipeline stage only")
        tensors = [
            pair
            for bucket in snapshot.buckets
            for pair in zip(bucket.names, bucket.layout.unpack(bucket.flat), strict=True)
        ]
        path = await anyio.to_thread.run_sync(self.adapter_push.write, snapshot.version, tensors)
        started = time.perf_counter()
        await self.adapter_push.push(engines, snapshot.version, path)
        record.broadcast_s = record.engine_pause_s = time.perf_counter() - started

    async def _send_bucket(
        self,
        engines: list[EngineClient],
        group: UpdateGroup,
        bucket: Bucket | BucketSpec,
        weight_version: int | None,
        expected: str,
        broadcast: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Every engine's update call in flight while the bucket is broadcast: by this process
        (a stage 0 `Bucket`), or by `broadcast` (a stage rank's bucket, as its `BucketSpec`).
        Sent again while an engine finds the bytes it received off `expected`, the digest."""

        async def update(engine: EngineClient) -> None:
            result = await engine.update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=group.name,
                weight_version=weight_version,
                flush_cache=self._flushes(weight_version),
                load_format=FLATTENED_BUCKET if self.flattened else None,
                weights_digest=expected if await engine.accepts_digest() else None,
            )
            if not result.get("success", False):
                raise RuntimeError(f"{engine.url}: {result.get('message')}")

        def send() -> None:
            if self.flattened:
                broadcast_flat(group.handle, bucket.flat)
            else:
                broadcast_tensors(group.handle, bucket.layout.unpack(bucket.flat))

        async def attempt(mismatched: set[str]) -> None:
            async with anyio.create_task_group() as tg:
                for engine in engines:
                    tg.start_soon(_checked, update, engine, mismatched)
                if broadcast is None:
                    await anyio.to_thread.run_sync(send)
                else:
                    await broadcast()

        await self._until_verified(attempt, bucket)

    async def _hand_over(
        self,
        engines: list[EngineClient],
        gpu_counts: list[int],
        bucket: Bucket,
        weight_version: int | None,
        expected: str,
    ) -> None:
        """Every engine maps the bucket from this process's memory and copies it in (one
        payload entry per engine GPU); the staging buffer stays untouched until they answer."""
        tensors = bucket.layout.unpack(bucket.flat)  # views (copies only where misaligned)
        payload = serialize_named_tensors(list(zip(bucket.names, tensors, strict=True)))

        async def update(engine: EngineClient, num_gpus: int) -> None:
            result = await engine.update_weights_from_tensor(
                [payload] * num_gpus,
                weight_version=weight_version,
                flush_cache=self._flushes(weight_version),
                weights_digest=expected if await engine.accepts_digest() else None,
            )
            if not result.get("success", False):
                raise RuntimeError(f"{engine.url}: {result.get('message')}")

        async def attempt(mismatched: set[str]) -> None:
            async with anyio.create_task_group() as tg:
                for engine, num_gpus in zip(engines, gpu_counts, strict=True):
                    tg.start_soon(
                        _checked, functools.partial(update, num_gpus=num_gpus), engine, mismatched
                    )

        await self._until_verified(attempt, bucket)

    async def _digest_of(self, bucket: Bucket) -> str:
        """One of this process's buckets, digested on the staging device (a few kernels per
        8 MiB); a stage rank's bucket comes with its digest (`BucketSpec.digest`)."""
        return await anyio.to_thread.run_sync(digest, [bucket.flat])

    async def _until_verified(self, attempt, bucket: Bucket | BucketSpec) -> None:
        """Run `attempt` (one send of the bucket to the engines) until no engine reports a
        digest mismatch, at most 1 + MAX_RESENDS times; `WeightsCorrupted` after that."""
        for _ in range(1 + MAX_RESENDS):
            mismatched: set[str] = set()
            await attempt(mismatched)
            if not mismatched:
                return
            self.num_digest_mismatches += len(mismatched)
            log.error(
                "weights digest mismatch on %s (bucket of %d tensors, %s...): sending it again",
                ", ".join(sorted(mismatched)),
                len(bucket.names),
                bucket.names[0],
            )
        raise WeightsCorrupted(
            f"{sorted(mismatched)} received corrupted weights {1 + MAX_RESENDS} times in a row"
        )

    async def _send_stage(
        self, engines: list[EngineClient], group: UpdateGroup, plan: StagePlan, *, is_last: bool
    ) -> None:
        """A pipeline stage's buckets: the engines' update calls from here, the broadcasts from
        the stage's rank (one `Send` request per bucket)."""
        for index, spec in enumerate(plan.buckets):
            tag = plan.version if is_last and index == len(plan.buckets) - 1 else None
            request = Send(group.name, plan.version, index, is_flattened=self.flattened)
            broadcast = functools.partial(self.stages.request, group.stage, request)
            await self._send_bucket(engines, group, spec, tag, spec.digest, broadcast)


async def _checked(update, engine: EngineClient, mismatched: set[str]) -> None:
    """`update(engine)`; an engine that refused the bytes (digest mismatch, nothing loaded)
    is added to `mismatched` instead of failing the update."""
    try:
        await update(engine)
    except EngineError as exc:
        if exc.status == 400 and "digest_mismatch" in exc.body:
            mismatched.add(engine.url)
            return
        raise


async def _each(engines: list[EngineClient], call) -> None:
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(call, engine)
