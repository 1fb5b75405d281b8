"""CUDA graphs of the decode step, one per (batch-size bucket, sampling variant).

A step over ``n`` running lanes replays the graph of the smallest bucket
``>= n``; lanes ``n..bucket-1`` are idle (they write the scratch slot only).
Graphs are captured largest first into one shared memory pool, so they reuse
each other's intermediate memory: only one replays at a time, and everything
read afterwards lives in static buffers outside the pool. Weights are updated
by in-place copies, so captured graphs stay valid across updates.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then steps of 16 to 128, of 32 to 512, of 64 beyond; capped at the maximum."""
    sizes = [1, 2, 4, 8]
    size = 16
    while size < max_batch_size:
        sizes.append(size)
        size += 16 if size < 128 else 32 if size < 512 else 64
    sizes = [s for s in sizes if s < max_batch_size]
    return (*sizes, max_batch_size)


def bucket_for(max_batch_size: int, lanes: int) -> int:
    """The smallest bucket that holds ``lanes``."""
    for size in batch_buckets(max_batch_size):
        if size >= lanes:
            return size
    raise ValueError(f"{lanes} lanes exceed the largest bucket {max_batch_size}")


class DecodeGraphs:
    """``body(lanes, use_filters)`` is the step; it must read/write only static buffers."""

    def __init__(
        self, body: Callable[[int, bool], None], max_batch_size: int, variants=(False, True)
    ):
        self.body = body
        self.buckets = batch_buckets(max_batch_size)
        self.variants = variants
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.failures: dict[tuple[int, bool], str] = {}
        self.capture_s = 0.0

    @torch.no_grad()
    def capture(self) -> None:
        """Warm each shape up eagerly on a side stream (compiles, cuBLAS handles), then capture.

        The plain variant must capture; a filtered variant that fails to capture is
        logged and left out (`replay` then returns False and the caller runs eagerly)."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for lanes in sorted(self.buckets, reverse=True):
            for use_filters in self.variants:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.body(lanes, use_filters)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        self.body(lanes, use_filters)
                except Exception as error:
                    if not use_filters:
                        raise
                    self.failures[(lanes, use_filters)] = repr(error)
                    logger.warning("no filtered decode graph for %d lanes: %r", lanes, error)
                    torch.cuda.synchronize()
                    continue
                self.graphs[(lanes, use_filters)] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        logger.info("captured %d decode graphs in %.1f s", len(self.graphs), self.capture_s)

    def replay(self, lanes: int, use_filters: bool) -> bool:
        """Replay the step for ``lanes`` running lanes; False when no graph exists for it."""
        graph = self.graphs.get((bucket_for(self.buckets[-1], lanes), use_filters))
        if graph is None:
            return False
        graph.replay()
        return True
