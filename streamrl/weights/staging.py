"""Staging: the learner's weights packed into flat buckets, ready for the wire.

A bucket is one flat uint8 buffer holding consecutive tensors back to back
(`FlatLayout`); the staging buffers are allocated once and reused by every
version, so a snapshot costs one copy per tensor and no allocation. Rank 0's
publisher stages stage 0's layers here, and each pipeline stage's publisher
rank stages its own (`streamrl.weights.stages`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from streamrl.weights.group import FlatLayout, dtype_name


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
class Staging:
    """Flat staging buffers, allocated once and reused by every version's snapshot."""

    bucket_bytes: int
    device: str
    last_parts: dict[str, float] = field(default_factory=dict)
    """Where the last `pack` went on a GPU: `wait_s`, the work queued on the device before it
    (the learner's step, still running), and `copy_s`, the snapshot itself (producing the
    tensors, e.g. a cast to the compute dtype, and packing them)."""
    _buffers: list[torch.Tensor] = field(default_factory=list)

    def pack(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[Bucket]:
        """Copy consecutive tensors into buckets of at most `bucket_bytes` (a larger one alone).

        The buckets view the buffers: the next `pack` overwrites them."""
        buckets: list[Bucket] = []
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        on_gpu = torch.device(self.device).type == "cuda"
        started = time.perf_counter()
        if on_gpu:
            torch.cuda.synchronize(self.device)
        waited = time.perf_counter()
        with torch.no_grad():
            for name, tensor in weights:
                nbytes = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + nbytes > self.bucket_bytes:
                    buckets.append(self._pack(len(buckets), pending))
                    pending, pending_bytes = [], 0
                pending.append((name, tensor))
                pending_bytes += nbytes
            if pending:
                buckets.append(self._pack(len(buckets), pending))
        if on_gpu:
            torch.cuda.synchronize(self.device)  # the stall is the copy's real cost
            self.last_parts = {
                "wait_s": waited - started,
                "copy_s": time.perf_counter() - waited,
            }
        return buckets

    def _pack(self, index: int, named: list[tuple[str, torch.Tensor]]) -> Bucket:
        layout = FlatLayout([(tuple(t.shape), t.dtype) for _, t in named])
        if index == len(self._buffers) or self._buffers[index].numel() < layout.num_bytes:
            buffer = torch.empty(
                max(layout.num_bytes, self.bucket_bytes), dtype=torch.uint8, device=self.device
            )
            self._buffers[index : index + 1] = [buffer]
        flat = self._buffers[index][: layout.num_bytes]
        layout.pack([tensor for _, tensor in named], flat)
        return Bucket([name for name, _ in named], layout, flat)
