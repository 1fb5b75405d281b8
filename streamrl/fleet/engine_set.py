"""`EngineSet`: every engine of a run, as the rollout side sees them.

Generation goes through the router (or round-robin over engines without one);
control calls (pause, continue, abort, weight updates) go to every engine
directly and concurrently, because the router answers 404 to them;
`session(key)` pins a multi-turn episode to one engine (rendezvous hashing,
skipping engines marked down). `each_engine` is the one way streamrl calls every engine
at once (the set's control calls, `EngineSet.each`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from streamrl.fleet.client import DEFAULT_GROUP_NAME, EngineClient, EngineError, engine_gpu_counts
from streamrl.fleet.limits import RequestLimits, context_length_of
from streamrl.fleet.results import GenerateResult
from streamrl.weights.layout import weight_group_layout

T = TypeVar("T")


class EngineSetError(EngineError):
    """Some engines of an `EngineSet` failed a call sent to all; `errors` maps URL -> error."""

    def __init__(self, endpoint: str, errors: dict[str, EngineError], num_engines: int) -> None:
        self.errors = errors
        summary = "; ".join(str(error) for error in errors.values())
        super().__init__(
            ",".join(errors), endpoint, None, f"{len(errors)} of {num_engines} engines: {summary}"
        )


async def each_engine(
    engines: Sequence[EngineClient],
    call: Callable[[EngineClient], Awaitable[T]],
    *,
    what: str = "call",
) -> list[T]:
    """`call(engine)` on every engine at once; the results in engine order, once all have
    answered. An engine's `EngineError` does not cancel the others' calls: every engine that
    failed is named in one `EngineSetError`, raised after all finished."""
    results: list[Any] = [None] * len(engines)
    errors: dict[str, EngineError] = {}

    async def one(index: int, engine: EngineClient) -> None:
        try:
            results[index] = await call(engine)
        except EngineError as exc:
            errors[engine.url] = exc

    async with anyio.create_task_group() as group:
        for index, engine in enumerate(engines):
            group.start_soon(one, index, engine)
    if errors:
        raise EngineSetError(what, errors, len(engines))
    return results


def _affinity(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class EngineSet:
    """All engines of a run; `router_url` (optional) serves `/generate`."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        router_url: str | None = None,
        timeout_s: float = 600.0,
        limits: RequestLimits | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("an EngineSet needs at least one engine URL")
        self.engines = [EngineClient(url, timeout_s=timeout_s) for url in engine_urls]
        self.router = EngineClient(router_url, timeout_s=timeout_s) if router_url else None
        self.set_limits(limits)
        self._down: set[str] = set()
        self._round_robin = itertools.count()

    def _clients(self) -> list[EngineClient]:
        """Every engine's client, and the router's when there is one."""
        return [*self.engines, *([self.router] if self.router else [])]

    async def __aenter__(self) -> EngineSet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self._clients():
            await client.aclose()

    def set_limits(self, limits: RequestLimits | None) -> None:
        """Check every `/generate` of every client against `limits` before sending."""
        self.limits = limits
        for client in self._clients():
            client.limits = limits

    def route_to_adapters(self, version: Callable[[], int]) -> None:
        """Every `/generate` names the LoRA adapter of `version()` (SGLang with a LoRA run:
        `streamrl.publish.adapter_files`), and its tokens carry that version."""
        for client in self._clients():
            client.adapter_version = version

    async def read_limits(self, *, vocab_size: int, model_max: int) -> RequestLimits:
        """The limits of these engines: `vocab_size` (the model's embedding rows) and the
        smallest context length any engine reports (`model_max` where none does)."""
        infos = [await engine.server_info() for engine in self.engines]
        context = min(context_length_of(info, model_max) for info in infos)
        return RequestLimits(vocab_size=vocab_size, context_length=context)

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def mark_down(self, url: str) -> None:
        """Skip this engine for sessions and round-robin until `mark_up`."""
        self._down.add(url.rstrip("/"))

    def mark_up(self, url: str) -> None:
        """Use this engine again."""
        self._down.discard(url.rstrip("/"))

    def _up(self) -> list[EngineClient]:
        up = [engine for engine in self.engines if engine.url not in self._down]
        if not up:
            raise EngineError(",".join(self.urls), "", None, "every engine is marked down")
        return up

    def session(self, key: str) -> EngineClient:
        """The engine for `key`: the same one on every call while it is up (its KV prefix
        stays warm across turns); only keys of an engine marked down move."""
        return max(self._up(), key=lambda engine: _affinity(key, engine.url))

    def generator(self) -> EngineClient:
        """Where a stateless `/generate` goes: the router, else the next engine (round-robin)."""
        if self.router is not None:
            return self.router
        up = self._up()
        return up[next(self._round_robin) % len(up)]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """One sample through `generator()` (router or round-robin)."""
        return await self.generator().generate(
            input_ids, sampling_params, rid=rid, return_logprob=return_logprob
        )

    async def each(
        self, call: Callable[[EngineClient], Awaitable[T]], *, what: str = "call"
    ) -> list[T]:
        """`each_engine` over this set's engines."""
        return await each_engine(self.engines, call, what=what)

    async def pause(self, mode: str = "abort") -> None:
        await self.each(lambda engine: engine.pause(mode), what="pause")

    async def continue_generation(self) -> None:
        await self.each(lambda engine: engine.continue_generation(), what="continue_generation")

    async def abort_all(self) -> None:
        await self.each(lambda engine: engine.abort(abort_all=True), what="abort_all")

    async def flush_cache(self) -> list[bool]:
        return await self.each(lambda engine: engine.flush_cache(), what="flush_cache")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Every engine frees `tags` (None: all; `EngineClient.release_memory_occupation`)."""
        await self.each(
            lambda engine: engine.release_memory_occupation(tags), what="release_memory"
        )

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Every engine takes `tags` back (None: all)."""
        await self.each(lambda engine: engine.resume_memory_occupation(tags), what="resume_memory")

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """Each engine joins with one rank per GPU, from 1 + the GPUs of the engines before
        it (`streamrl.weights.layout`, GPU counts from each `/server_info`); the trainer must
        join as rank 0 concurrently (`weight_sync.init_weight_update_group`)."""
        layout = weight_group_layout(await engine_gpu_counts(self.engines))
        await self.each(
            lambda engine: engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=layout.rank_offsets[self.engines.index(engine)],
                world_size=layout.world_size,
                group_name=group_name,
                backend=backend,
            ),
            what="init_weights_update_group",
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        weight_version: str | int | None,
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Every engine receives the same broadcasts; the trainer broadcasts concurrently."""
        await self.each(
            lambda engine: engine.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=group_name,
                weight_version=weight_version,
                flush_cache=flush_cache,
                abort_all_requests=abort_all_requests,
                load_format=load_format,
            ),
            what="update_weights_from_distributed",
        )

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        await self.each(
            lambda engine: engine.destroy_weights_update_group(group_name),
            what="destroy_weights_update_group",
        )
