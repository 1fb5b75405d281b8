"""The weight transport: one way of bringing a staged version to the engines.

The publisher (`streamrl.publish.publisher`) runs the same loop whatever the way; a
transport fills in its steps, one version at a time (the publisher never overlaps two):

    stage(v)          pack the weights into staging buckets (a worker thread; the learner waits)
    prepare           before the pause: groups joined, engine GPUs counted, digests taken,
                      files written, buckets staged (the engines keep generating)
    pause every engine that `needs_pause` (`pause_mode`; in `abort` mode, every engine)
    send              inside the pause: every bucket; the very last call tags version v
    continue every paused engine
    settle            after the pause: what the engines no longer need (old adapters)

Every engine is called at once through `streamrl.fleet.engine_set.each_engine`: one
engine's failure does not cut the others' calls short (each pauses, continues, loads as
it answers), and every engine that failed is named. `invalidate` (an engine restarted)
and `drop` (an update failed) make the next update start afresh; `close` ends the transport when the run stops. One implementation per
way, chosen from the config by `streamrl.publish.factory`:

    GroupTransport        weight-update groups (NCCL or gloo), one per pipeline stage
    IpcTransport          CUDA IPC handles, for engines on the learner's own GPU
    AdapterFileTransport  LoRA adapters as peft directories that SGLang engines load
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from streamrl.fleet.client import EngineClient
from streamrl.weights.stages import StagePlan
from streamrl.weights.staging import Bucket, Staging

WeightSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""The learner's current weights under Hugging Face names (full tensors)."""


@dataclass
class Staged:
    """One version, packed for the wire."""

    version: int
    buckets: list[Bucket]
    """This process's buckets: views of the reused staging buffers."""
    stages: list[StagePlan] = field(default_factory=list)
    """Pipeline stages 1..PP-1: their buckets stay staged on their own ranks."""

    @property
    def num_bytes(self) -> int:
        local = sum(bucket.layout.num_bytes for bucket in self.buckets)
        return local + sum(plan.num_bytes for plan in self.stages)


class WeightTransport(Protocol):
    """One way of sending a staged version to the engines (see the module docstring).

    Implementations subclass it: `prepare` and `send` are theirs to write; the other
    steps do nothing unless they override them."""

    def stage(self, version: int, weights: WeightSource, staging: Staging) -> Staged:
        """`version` packed into `staging` (runs in a worker thread while the learner waits)."""
        return Staged(version, staging.pack(weights()))

    async def prepare(self, engines: list[EngineClient], staged: Staged) -> None:
        """What `send` needs, done before the engines pause."""
        ...

    async def send(self, engines: list[EngineClient], staged: Staged, *, flush_cache: bool) -> None:
        """Every bucket to every (paused) engine; the last call tags `staged.version` and,
        with `flush_cache`, asks the engines to flush their prefix caches."""
        ...

    def needs_pause(self, engine: EngineClient) -> bool:
        """Whether `send` needs `engine` paused around it (in `in_place` mode): not an engine
        that loads a staged update at one step boundary by itself."""
        return True

    @property
    def staging_s(self) -> float:
        """Seconds the last `prepare` spent handing the bytes over (staged updates)."""
        return 0.0

    @property
    def staging_parts(self) -> dict[str, float]:
        """Where `staging_s` went, and what preparing it spent before, by part (seconds;
        empty where not measured)."""
        return {}

    @property
    def send_parts(self) -> dict[str, float]:
        """Where the last `send` went, by part (seconds; empty where not measured)."""
        return {}

    @property
    def engine_pauses(self) -> dict[str, float]:
        """Per engine URL, how long the last `send` stood its generation still, as the engine
        measured it (staged updates; an engine paused around `send` is not in it)."""
        return {}

    async def settle(self, engines: list[EngineClient], staged: Staged) -> None:
        """After the engines continued: release what they no longer need."""

    def invalidate(self) -> None:
        """The set of engines changed: the next update must not reuse what this one built."""

    async def drop(self) -> None:
        """An update failed: let go of what it used, so the next one starts afresh."""

    async def close(self) -> None:
        """The run stops (called while the publisher is cancelled: shield what must finish)."""

    @property
    def num_digest_mismatches(self) -> int:
        """Buckets an engine received corrupted (and refused), over the run."""
        return 0


def require_success(engine: EngineClient, result: dict) -> None:
    """An engine's weight-update answer: RuntimeError unless it reports success."""
    if not result.get("success", False):
        raise RuntimeError(f"{engine.url}: {result.get('message')}")
