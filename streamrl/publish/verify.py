"""Every bucket that travels as tensors is checked by the engines against its digest.

The digest (`streamrl.weights.digest`) of each staged bucket goes with its update call
(`weights_digest`, to engines that accept it); an engine whose received bytes differ
loads none of them and answers 400 `digest_mismatch`, and the bucket is sent again to
every engine, at most `MAX_RESENDS` times before the update fails.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from streamrl.fleet.client import EngineClient, EngineError
from streamrl.weights.digest import digest
from streamrl.weights.stages import BucketSpec
from streamrl.weights.staging import Bucket

log = logging.getLogger(__name__)

MAX_RESENDS = 2
"""Sends of one bucket after a digest mismatch before the update fails."""


class WeightsCorrupted(RuntimeError):
    """An engine kept receiving a bucket whose bytes did not match its digest."""


async def digest_of(bucket: Bucket) -> str:
    """One of this process's buckets, digested on the staging device (a few kernels per
    8 MiB); a stage rank's bucket comes with its digest (`BucketSpec.digest`)."""
    return await anyio.to_thread.run_sync(digest, [bucket.flat])


@dataclass
class Verifier:
    """Repeats one bucket's send until no engine refuses it, and counts the refusals."""

    num_mismatches: int = 0
    """Buckets an engine received corrupted (and refused), over the run."""

    async def until_verified(
        self, attempt: Callable[[set[str]], Awaitable[None]], bucket: Bucket | BucketSpec
    ) -> None:
        """Run `attempt` (one send of the bucket to the engines, which adds the URL of each
        engine that refused it) until none does, at most 1 + MAX_RESENDS times;
        `WeightsCorrupted` after that."""
        for _ in range(1 + MAX_RESENDS):
            mismatched: set[str] = set()
            await attempt(mismatched)
            if not mismatched:
                return
            self.num_mismatches += len(mismatched)
            log.error(
                "weights digest mismatch on %s (bucket of %d tensors, %s...): sending it again",
                ", ".join(sorted(mismatched)),
                len(bucket.names),
                bucket.names[0],
            )
        raise WeightsCorrupted(
            f"{sorted(mismatched)} received corrupted weights {1 + MAX_RESENDS} times in a row"
        )


async def checked(
    update: Callable[[EngineClient], Awaitable[None]], engine: EngineClient, mismatched: set[str]
) -> None:
    """`update(engine)`; an engine that refused the bytes (digest mismatch, nothing loaded)
    is added to `mismatched` instead of failing the update."""
    try:
        await update(engine)
    except EngineError as exc:
        if exc.status == 400 and "digest_mismatch" in exc.body:
            mismatched.add(engine.url)
            return
        raise
