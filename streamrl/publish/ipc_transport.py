"""Weights by reference, for engines on the learner's own GPU (`weights.transport = "ipc"`).

    prepare  each engine's GPU count; each bucket's digest; embedded engines are handed
             every bucket now, as a staged update: they map it, check its digest, names
             and shapes, and keep the planned copy while they generate on
             (each bucket as one flat tensor: one IPC handle to map, not one per tensor)
    send     embedded engines: `/load_staged_weights`, the copy at one step boundary with
             no pause around it (in `in_place` mode); other engines (SGLang), paused: per
             bucket `/update_weights_from_tensor` with the bucket's tensors as CUDA IPC
             handles (`streamrl.weights.ipc`), one payload entry per engine GPU; each maps
             them and copies them in; the last call tags the new version

No group is joined, and the staging buffers stay untouched until every engine answered.
One pipeline stage only: the engines share the learner's one GPU.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from streamrl.fleet.client import EngineClient, engine_gpu_counts
from streamrl.fleet.engine_set import each_engine
from streamrl.publish.transport import Staged, WeightTransport, require_success
from streamrl.publish.verify import Verifier, checked, digest_of
from streamrl.weights.group import FLATTENED_BUCKET
from streamrl.weights.ipc import serialize_named_tensors
from streamrl.weights.staging import Bucket


@dataclass
class IpcTransport(WeightTransport):
    """Hands the engines the staging buffers by CUDA IPC handle (see the module docstring)."""

    gpu_counts: Callable[[list[EngineClient]], Awaitable[list[int]]] = engine_gpu_counts
    """GPUs of each engine (one payload entry each); by default its `/server_info` tp_size."""
    verifier: Verifier = field(default_factory=Verifier)
    _gpu_counts: dict[str, int] = field(default_factory=dict)
    _digests: list[str] = field(default_factory=list)
    _staged: set[str] = field(default_factory=set)
    """URLs of the engines that hold the update in progress staged."""
    _stage: str = ""
    """The name the staged calls of the update in progress share."""
    _num_stages: int = 0
    _staging_s: float = 0.0
    _staging_parts: dict[str, float] = field(default_factory=dict)
    _prepare_parts: dict[str, float] = field(default_factory=dict)
    _engine_pauses: dict[str, float] = field(default_factory=dict)
    _send_parts: dict[str, float] = field(default_factory=dict)

    async def prepare(self, engines: list[EngineClient], staged: Staged) -> None:
        started = time.perf_counter()
        unknown = [engine for engine in engines if engine.url not in self._gpu_counts]
        if unknown:  # asked once per engine (`invalidate` and `drop` forget them)
            counts = await self.gpu_counts(unknown)
            self._gpu_counts |= {e.url: n for e, n in zip(unknown, counts, strict=True)}
        embedded = [engine for engine in engines if await engine.accepts_digest()]
        asked = time.perf_counter()
        self._digests = [await digest_of(bucket) for bucket in staged.buckets]
        self._num_stages += 1  # a resync of the same version stages afresh
        self._stage = f"v{staged.version}.{self._num_stages}"
        self._staging_parts = {}
        digested = time.perf_counter()
        self._prepare_parts = {"server_info_s": asked - started, "digest_s": digested - asked}
        started = digested
        for index, bucket in enumerate(staged.buckets):
            await self._hand_over(embedded, bucket, None, self._digests[index], False, stage=True)
        self._staging_s = time.perf_counter() - started
        self._staged = {engine.url for engine in embedded}

    def needs_pause(self, engine: EngineClient) -> bool:
        return engine.url not in self._staged

    @property
    def staging_s(self) -> float:
        return self._staging_s

    @property
    def staging_parts(self) -> dict[str, float]:
        """Where the staging's time went, summed over the buckets (the slowest engine's each):
        `serialize_s` (the handles, here), `request_s` (each call's round trip), and the
        engine's own `lock_s`, `map_s`, `digest_s` and `plan_s` (`engine_` before each);
        and, before the staging (not in `staging_s`), what `prepare` spent asking engines
        it did not know yet for their GPU count and kind (`server_info_s`) and digesting
        the buckets here (`digest_s`, which waits for the snapshot's copies)."""
        return self._prepare_parts | self._staging_parts

    def invalidate(self) -> None:
        self._gpu_counts = {}

    async def drop(self) -> None:
        self._gpu_counts = {}

    @property
    def engine_pauses(self) -> dict[str, float]:
        return self._engine_pauses

    @property
    def send_parts(self) -> dict[str, float]:
        """The slowest engine's each, for the staged loads: the `/load_staged_weights` round
        trip (`load_request_s`) and, inside it, the engine's wait for a step boundary
        (`engine_wait_s`) and the copy (`engine_pause_s`)."""
        return self._send_parts

    async def send(self, engines: list[EngineClient], staged: Staged, *, flush_cache: bool) -> None:
        self._engine_pauses, self._send_parts = {}, {}
        loading = [engine for engine in engines if engine.url in self._staged]
        others = [engine for engine in engines if engine.url not in self._staged]

        async def load(engine: EngineClient) -> None:
            started = time.perf_counter()
            result = await engine.load_staged_weights(
                self._stage, weight_version=staged.version, flush_cache=flush_cache
            )
            require_success(engine, result)
            self._engine_pauses[engine.url] = float(result.get("engine_pause_s", 0.0))
            seen = {
                "load_request_s": time.perf_counter() - started,
                "engine_wait_s": float(result.get("engine_wait_s", 0.0)),
                "engine_pause_s": self._engine_pauses[engine.url],
            }
            for key, seconds in seen.items():
                self._send_parts[key] = max(self._send_parts.get(key, 0.0), seconds)

        try:
            await each_engine(loading, load, what="load_staged_weights")
            for index, bucket in enumerate(staged.buckets):
                tag = staged.version if index == len(staged.buckets) - 1 else None
                await self._hand_over(others, bucket, tag, self._digests[index], flush_cache)
        finally:
            self._staged = set()

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
        *,
        stage: bool = False,
    ) -> None:
        """Every engine maps the bucket from this process's memory and copies it in, or with
        `stage` keeps it staged (one payload entry per engine GPU); the staging buffer stays
        untouched until they answer."""
        if not engines:
            return
        payloads: dict[bool, str] = {}
        parts: dict[str, float] = {}  # this bucket's: the slowest engine's each

        def payload(embedded: bool) -> str:
            """Embedded engines map the bucket as one flat tensor (one IPC handle and event,
            not one per tensor); SGLang takes it tensor by tensor."""
            if embedded not in payloads:
                started = time.perf_counter()
                if embedded:
                    named = [(FLATTENED_BUCKET, bucket.flat)]
                else:  # views (copies only where misaligned)
                    named = list(zip(bucket.names, bucket.layout.unpack(bucket.flat), strict=True))
                payloads[embedded] = serialize_named_tensors(named)
                parts["serialize_s"] = parts.get("serialize_s", 0.0) + time.perf_counter() - started
            return payloads[embedded]

        async def update(engine: EngineClient) -> None:
            embedded = await engine.accepts_digest()
            entry = payload(embedded)
            started = time.perf_counter()
            result = await engine.update_weights_from_tensor(
                [entry] * self._gpu_counts[engine.url],
                weight_version=weight_version,
                flush_cache=flush_cache and weight_version is not None,
                weights_digest=expected if embedded else None,
                stage=self._stage if stage else None,
                flattened=(bucket.names, bucket.dtypes, bucket.shapes) if embedded else None,
            )
            require_success(engine, result)
            if stage:
                seen = {"request_s": time.perf_counter() - started}
                seen |= {f"engine_{k}": float(v) for k, v in result.get("timings", {}).items()}
                for key, seconds in seen.items():
                    parts[key] = max(parts.get(key, 0.0), seconds)

        remaining = list(engines)

        async def attempt(mismatched: set[str]) -> None:
            """One send to every engine that has not taken the bucket yet."""
            nonlocal remaining
            await each_engine(
                remaining,
                lambda engine: checked(update, engine, mismatched),
                what="update_weights_from_tensor",
            )
            remaining = [engine for engine in remaining if engine.url in mismatched]

        await self.verifier.until_verified(attempt, bucket)
        if stage:
            for key, seconds in parts.items():
                self._staging_parts[key] = self._staging_parts.get(key, 0.0) + seconds
