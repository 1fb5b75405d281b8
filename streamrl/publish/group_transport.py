"""Weights over weight-update groups (NCCL or gloo), one group per pipeline stage.

    prepare  the groups over exactly these engines (`streamrl.publish.update_groups`: kept,
             or rebuilt after an engine set change or a failed update); each bucket's digest
    send     per bucket: every engine's `/update_weights_from_distributed` in flight while
             the bucket is broadcast; stage 0's buckets from here, then each later stage's,
             broadcast by that stage's rank; only the very last call tags the new version

A bucket is one flat uint8 buffer (the staging buffers are allocated once and reused);
with `flattened = True` it travels as one broadcast (SGLang's
`load_format = "flattened_bucket"`), otherwise as one broadcast per tensor, which every
SGLang release accepts.

With pipeline parallelism (`stages`) no rank holds the whole model: staging a version
has every stage rank stage its own layers (`streamrl.weights.stages`), and every stage
has its own group over the same engines, hosted by the stage's publisher rank, which
broadcasts its buckets when told (`Send`). The engines' calls all come from here.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from streamrl.fleet.client import EngineClient, engine_gpu_counts
from streamrl.fleet.engine_set import each_engine
from streamrl.publish.transport import (
    Staged,
    WeightSource,
    WeightTransport,
    require_success,
)
from streamrl.publish.update_groups import UpdateGroup, UpdateGroups
from streamrl.publish.verify import Verifier, checked, digest_of
from streamrl.weights.group import FLATTENED_BUCKET, broadcast_flat, broadcast_tensors
from streamrl.weights.stages import BucketSpec, RemoteStages, Send, StagePlan
from streamrl.weights.staging import Bucket, Staging


@dataclass
class GroupTransport(WeightTransport):
    """Broadcasts over weight-update groups that the engines join (see the module docstring)."""

    members: Callable[[], list[EngineClient]]
    """The engines that should hold the newest weights (a failed update's groups are left
    on those of them still live)."""
    backend: str = "gloo"
    """The groups' torch.distributed backend: `nccl` or `gloo`."""
    master_address: str = "127.0.0.1"
    """Where stage 0's group meets: this process's address as the engines reach it."""
    flattened: bool = True
    """One broadcast per bucket (`load_format = "flattened_bucket"`), else one per tensor."""
    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    """Weight-group ranks (GPUs) of each engine; by default each engine's `/server_info` tp_size."""
    stages: RemoteStages | None = None
    """Pipeline stages 1..PP-1, which stage and broadcast their own layers; None without PP."""
    verifier: Verifier = field(default_factory=Verifier)
    _groups: UpdateGroups = field(init=False)
    _current: list[UpdateGroup] = field(default_factory=list)
    """The groups of the update in progress, one per stage."""
    _digests: list[str] = field(default_factory=list)
    """The digests of the update in progress's local buckets."""

    def __post_init__(self) -> None:
        self._groups = UpdateGroups(
            transport=self.backend,
            master_address=self.master_address,
            members=self.members,
            gpu_counts=self.gpu_counts,
            stages=self.stages,
        )

    def stage(self, version: int, weights: WeightSource, staging: Staging) -> Staged:
        """With stages, every stage rank stages its own layers at `version` too, and this
        process stages stage 0's (which the leader yields in place of `weights`)."""
        if self.stages is None:
            return super().stage(version, weights, staging)
        staged = Staged(version, staging.pack(self.stages.snapshot(version, staging.bucket_bytes)))
        staged.stages = self.stages.plans(version)
        return staged

    async def prepare(self, engines: list[EngineClient], staged: Staged) -> None:
        self._current = await self._groups.ensure(engines, 1 + len(staged.stages))
        self._digests = [await digest_of(bucket) for bucket in staged.buckets]

    async def send(self, engines: list[EngineClient], staged: Staged, *, flush_cache: bool) -> None:
        local, *remote = self._current
        for index, bucket in enumerate(staged.buckets):
            is_last = index == len(staged.buckets) - 1 and not staged.stages
            tag = staged.version if is_last else None  # the version flips after the last
            await self._send_bucket(engines, local, bucket, tag, self._digests[index], flush_cache)
        for plan, group in zip(staged.stages, remote, strict=True):
            is_last = plan is staged.stages[-1]
            await self._send_stage(engines, group, plan, is_last=is_last, flush_cache=flush_cache)

    def invalidate(self) -> None:
        self._groups.is_stale = True

    async def drop(self) -> None:
        await self._groups.drop()

    async def close(self) -> None:
        if self.stages is not None:
            self.stages.close()  # stage ranks destroy their groups when they stop
        await self._groups.close()

    @property
    def num_digest_mismatches(self) -> int:
        return self.verifier.num_mismatches

    async def _send_bucket(
        self,
        engines: list[EngineClient],
        group: UpdateGroup,
        bucket: Bucket | BucketSpec,
        weight_version: int | None,
        expected: str,
        flush_cache: bool,
        broadcast: Callable[[], Awaitable[object]] | None = None,
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
                flush_cache=flush_cache and weight_version is not None,
                load_format=FLATTENED_BUCKET if self.flattened else None,
                weights_digest=expected if await engine.accepts_digest() else None,
            )
            require_success(engine, result)

        def send() -> None:
            if self.flattened:
                broadcast_flat(group.handle, bucket.flat)
            else:
                broadcast_tensors(group.handle, bucket.layout.unpack(bucket.flat))

        async def updates(mismatched: set[str]) -> None:
            await each_engine(
                engines,
                lambda engine: checked(update, engine, mismatched),
                what="update_weights_from_distributed",
            )

        async def attempt(mismatched: set[str]) -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(updates, mismatched)
                if broadcast is None:
                    await anyio.to_thread.run_sync(send)
                else:
                    await broadcast()

        await self.verifier.until_verified(attempt, bucket)

    async def _send_stage(
        self,
        engines: list[EngineClient],
        group: UpdateGroup,
        plan: StagePlan,
        *,
        is_last: bool,
        flush_cache: bool,
    ) -> None:
        """A pipeline stage's buckets: the engines' update calls from here, the broadcasts from
        the stage's rank (one `Send` request per bucket)."""
        for index, spec in enumerate(plan.buckets):
            tag = plan.version if is_last and index == len(plan.buckets) - 1 else None
            request = Send(group.name, plan.version, index, is_flattened=self.flattened)
            broadcast = functools.partial(self.stages.request, group.stage, request)
            await self._send_bucket(engines, group, spec, tag, spec.digest, flush_cache, broadcast)
