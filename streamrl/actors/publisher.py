"""The weight publisher: new versions from the learner to every engine, off the learner's path.

    learner step v done ─► publish(v): wait for the previous broadcast (stall), pack
                           the weights into flat staging buckets (stall), return
    background:            pause engines ─► per bucket: engines' update call in flight while
                           rank 0 broadcasts ─► last bucket tags weight_version v ─► continue
                           ─► on_published(v) (admission lets B more groups start)

A bucket is one flat uint8 buffer (the staging buffers are allocated once and
reused); with `flattened = True` it travels as one broadcast (SGLang's
`load_format = "flattened_bucket"`), otherwise as one broadcast per tensor,
which every SGLang release accepts.

The weight-update group is built the way SGLang builds it (see
`streamrl.engine.weight_sync`): the learner is rank 0 and each engine joins as
one rank per GPU, from 1 + (GPUs of the engines before it); see
`streamrl.engine.layout`. It is rebuilt whenever the set of engines changes (an engine restarted),
and a rebuilt group is brought to the current version at once (`resync`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio
import torch

from streamrl.engine.client import EngineClient, EngineError
from streamrl.engine.layout import engine_gpu_counts, weight_group_layout
from streamrl.engine.weight_sync import (
    FLATTENED_BUCKET,
    FlatLayout,
    broadcast_flat,
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
)
from streamrl.launch.process import free_port

log = logging.getLogger(__name__)

DESTROY_TIMEOUT_S = 10.0
"""A member that does not confirm leaving the old group within this is left behind."""


@dataclass
class Bucket:
    """Tensors packed back to back into `flat` (a view of a reused staging buffer)."""

    names: list[str]
    layout: FlatLayout
    flat: torch.Tensor

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(dtype) for _, dtype in self.layout.specs]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(shape) for shape, _ in self.layout.specs]


@dataclass
class Snapshot:
    version: int
    buckets: list[Bucket]

    @property
    def num_bytes(self) -> int:
        return sum(bucket.layout.num_bytes for bucket in self.buckets)


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
        }


@dataclass
class _Group:
    name: str
    members: tuple[str, ...]
    handle: object


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
    group_backend: str = "gloo"
    staging_device: str = "cpu"
    master_address: str = "127.0.0.1"
    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    """Weight-group ranks (GPUs) of each engine; by default each engine's `/server_info` tp_size."""
    records: list[PublishRecord] = field(default_factory=list)
    _group: _Group | None = None
    _is_stale: bool = False
    _idle: anyio.Event = field(default_factory=anyio.Event)
    _busy: bool = False
    _latest: Snapshot | None = None
    _task_group: anyio.abc.TaskGroup | None = None
    _staging: list[torch.Tensor] = field(default_factory=list)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the task group that background broadcasts run in; cancel to stop."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._task_group = None
            if self._group is not None:
                await anyio.to_thread.run_sync(destroy_weight_update_group, self._group.handle)
                self._group = None

    async def publish(self, version: int) -> PublishRecord:
        """Snapshot the weights as `version` and start broadcasting; returns once the learner
        may change its weights again (the record is completed by the broadcast)."""
        started = time.perf_counter()
        while self._busy:
            await self._idle.wait()
        snapshot_started = time.perf_counter()
        snapshot = await anyio.to_thread.run_sync(self._snapshot, version)
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
        """An engine left: rebuild the group before the next broadcast."""
        self._is_stale = True

    async def wait_idle(self) -> None:
        while self._busy:
            await self._idle.wait()

    def _start(self, snapshot: Snapshot, record: PublishRecord) -> None:
        if self._task_group is None:
            raise RuntimeError("WeightPublisher.run() is not running")
        self._busy = True
        self._task_group.start_soon(self._broadcast, snapshot, record)

    def _snapshot(self, version: int) -> Snapshot:
        """Pack the weights into the staging buffers, a bucket at a time."""
        buckets: list[Bucket] = []
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        with torch.no_grad():
            for name, tensor in self.weights():
                nbytes = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + nbytes > self.bucket_bytes:
                    buckets.append(self._pack(len(buckets), pending))
                    pending, pending_bytes = [], 0
                pending.append((name, tensor))
                pending_bytes += nbytes
            if pending:
                buckets.append(self._pack(len(buckets), pending))
        if torch.device(self.staging_device).type == "cuda":
            torch.cuda.synchronize(self.staging_device)  # the stall is the copy's real cost
        snapshot = Snapshot(version, buckets)
        self._latest = snapshot
        return snapshot

    def _pack(self, index: int, named: list[tuple[str, torch.Tensor]]) -> Bucket:
        layout = FlatLayout([(tuple(t.shape), t.dtype) for _, t in named])
        if index == len(self._staging) or self._staging[index].numel() < layout.num_bytes:
            buffer = torch.empty(
                max(layout.num_bytes, self.bucket_bytes),
                dtype=torch.uint8,
                device=self.staging_device,
            )
            self._staging[index : index + 1] = [buffer]
        flat = self._staging[index][: layout.num_bytes]
        layout.pack([tensor for _, tensor in named], flat)
        return Bucket([name for name, _ in named], layout, flat)

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
                await self._drop_group()
            else:
                await self.on_published(snapshot.version)
        finally:
            self._busy = False
            self._idle.set()
            self._idle = anyio.Event()

    async def _send(self, snapshot: Snapshot, engines: list[EngineClient], record: PublishRecord):
        group = await self._ensure_group(engines)
        paused_at = time.perf_counter()
        await _each(engines, lambda e: e.pause(self.pause_mode))
        try:
            broadcast_started = time.perf_counter()
            for index, bucket in enumerate(snapshot.buckets):
                is_last = index == len(snapshot.buckets) - 1
                tag = snapshot.version if is_last else None  # the version flips after the last
                await self._send_bucket(engines, group, bucket, tag)
            record.broadcast_s = time.perf_counter() - broadcast_started
        finally:
            await _each(engines, lambda e: e.continue_generation())
            record.engine_pause_s = time.perf_counter() - paused_at

    async def _send_bucket(
        self, engines: list[EngineClient], group: _Group, bucket: Bucket, weight_version: int | None
    ) -> None:
        """Every engine's update call in flight while rank 0 broadcasts the bucket."""

        async def update(engine: EngineClient) -> None:
            result = await engine.update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=group.name,
                weight_version=weight_version,
                flush_cache=False,
                load_format=FLATTENED_BUCKET if self.flattened else None,
            )
            if not result.get("success", False):
                raise RuntimeError(f"{engine.url}: {result.get('message')}")

        def send() -> None:
            if self.flattened:
                broadcast_flat(group.handle, bucket.flat)
            else:
                broadcast_tensors(group.handle, bucket.layout.unpack(bucket.flat))

        async with anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(update, engine)
            await anyio.to_thread.run_sync(send)

    async def _ensure_group(self, engines: list[EngineClient]) -> _Group:
        members = tuple(engine.url for engine in engines)
        if self._group is not None and self._group.members == members and not self._is_stale:
            return self._group
        self._is_stale = False
        await self._drop_group()
        name = f"streamrl-{uuid.uuid4().hex[:8]}"
        port = free_port(self.master_address)
        layout = weight_group_layout(await self.gpu_counts(engines))
        handle = None

        async def host() -> None:
            nonlocal handle
            handle = await anyio.to_thread.run_sync(
                lambda: init_weight_update_group(
                    master_address=self.master_address,
                    master_port=port,
                    rank=0,
                    world_size=layout.world_size,
                    group_name=name,
                    backend=self.group_backend,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(host)
            for engine, rank_offset in zip(engines, layout.rank_offsets, strict=True):
                tg.start_soon(
                    lambda e=engine, r=rank_offset: e.init_weights_update_group(
                        master_address=self.master_address,
                        master_port=port,
                        rank_offset=r,
                        world_size=layout.world_size,
                        group_name=name,
                        backend=self.group_backend,
                    )
                )
        self._group = _Group(name, members, handle)
        log.info(
            "weight-update group %s: learner + %d engines (world size %d)",
            name,
            len(engines),
            layout.world_size,
        )
        return self._group

    async def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        for url in group.members:
            engine = next((e for e in self.members() if e.url == url), None)
            if engine is not None:
                try:
                    with anyio.fail_after(DESTROY_TIMEOUT_S):
                        await engine.destroy_weights_update_group(group.name)
                except (EngineError, TimeoutError) as exc:
                    log.info("could not destroy group on %s: %s", url, exc or "timeout")
        await anyio.to_thread.run_sync(destroy_weight_update_group, group.handle)


async def _each(engines: list[EngineClient], call) -> None:
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(call, engine)
