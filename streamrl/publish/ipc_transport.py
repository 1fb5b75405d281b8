"""Weights by reference, for engines on the learner's own GPU (`weights.transport = "ipc"`).

    prepare  each engine's GPU count; each bucket's digest
    send     per bucket: every engine's `/update_weights_from_tensor` with the bucket's
             tensors as CUDA IPC handles (`streamrl.weights.ipc`), one payload entry per
             engine GPU; each engine maps them and copies them in; the last call tags the
             new version

No group is joined, and the staging buffers stay untouched until every engine answered.
One pipeline stage only: the engines share the learner's one GPU.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from streamrl.fleet.client import EngineClient, engine_gpu_counts
from streamrl.fleet.engine_set import each_engine
from streamrl.publish.transport import Staged, WeightTransport, require_success
from streamrl.publish.verify import Verifier, checked, digest_of
from streamrl.weights.ipc import serialize_named_tensors
from streamrl.weights.staging import Bucket


@dataclass
class IpcTransport(WeightTransport):
    """Hands the engines the staging buffers by CUDA IPC handle (see the module docstring)."""

    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    """GPUs of each engine (one payload entry each); by default its `/server_info` tp_size."""
    verifier: Verifier = field(default_factory=Verifier)
    _gpu_counts: list[int] = field(default_factory=list)
    _digests: list[str] = field(default_factory=list)

    async def prepare(self, engines: list[EngineClient], staged: Staged) -> None:
        self._gpu_counts = await self.gpu_counts(engines)
        self._digests = [await digest_of(bucket) for bucket in staged.buckets]

    async def send(self, engines: list[EngineClient], staged: Staged, *, flush_cache: bool) -> None:
        for index, bucket in enumerate(staged.buckets):
            tag = staged.version if index == len(staged.buckets) - 1 else None
            await self._hand_over(engines, bucket, tag, self._digests[index], flush_cache)

    @property
    def num_digest_mismatches(self) -> int:
        return self.verifier.num_mismatches

    async def _hand_over(
        self,
        engines: list[EngineClient],
        bucket: Bucket,
        weight_version: int | None,
        expected: str,
        flush_cache: bool,
    ) -> None:
        """Every engine maps the bucket from this process's memory and copies it in (one
        payload entry per engine GPU); the staging buffer stays untouched until they answer."""
        tensors = bucket.layout.unpack(bucket.flat)  # views (copies only where misaligned)
        payload = serialize_named_tensors(list(zip(bucket.names, tensors, strict=True)))

        num_gpus = {
            engine.url: count for engine, count in zip(engines, self._gpu_counts, strict=True)
        }

        async def update(engine: EngineClient) -> None:
            result = await engine.update_weights_from_tensor(
                [payload] * num_gpus[engine.url],
                weight_version=weight_version,
                flush_cache=flush_cache and weight_version is not None,
                weights_digest=expected if await engine.accepts_digest() else None,
            )
            require_success(engine, result)

        async def attempt(mismatched: set[str]) -> None:
            await each_engine(
                engines,
                lambda engine: checked(update, engine, mismatched),
                what="update_weights_from_tensor",
            )

        await self.verifier.until_verified(attempt, bucket)
