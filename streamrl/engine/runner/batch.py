"""Attention batches: how one forward of the compact model reads and writes the KV cache.

A batch object is handed to `CompactModel.forward`; per layer its `attend` is
given a ``rotate_and_store(keys, values, rows, queries)`` callable (the layer's
`kernels.rope_store` over its q/k/v projection), says where the new keys and
values go (flat cache rows ``slot * max_seq_len + position``), then attends
and returns ``[tokens, heads * head_dim]``. Prefill attends among the packed
new tokens (every sequence starts at position 0); decode attends to each
lane's cached prefix with the kernel the runner chose (`DECODE_KERNELS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamrl.engine.runner import split_decode
from streamrl.engine.runner.attention import decode_attention, prefill_attention
from streamrl.engine.runner.kv_cache import KVCache

RotateAndStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

DECODE_KERNELS = ("split", "flash", "sdpa")
"""split: `split_decode` (Triton); flash: FlashAttention-2's varlen kernel; sdpa: torch's
scaled_dot_product_attention over the padded cache (CPU, float32)."""


@dataclass
class PrefillBatch:
    cache: KVCache
    rows: torch.Tensor  # int64 [tokens]: flat cache row of each new token
    cu_seqlens: torch.Tensor  # int32 [sequences + 1]
    seq_lens: list[int]
    use_flash: bool

    def attend(self, layer: int, rotate_and_store: RotateAndStore, heads: int) -> torch.Tensor:
        keys, values = self.cache.flat_layer(layer)
        q = keys.new_empty(self.rows.shape[0], heads, keys.shape[2])
        rotate_and_store(keys, values, self.rows, q)
        # The new keys and values read back from the cache (one gather each: small
        # beside the prefill's matmuls).
        k, v = keys[self.rows], values[self.rows]
        out = prefill_attention(q, k, v, self.cu_seqlens, self.seq_lens, self.use_flash)
        return out.flatten(1)


@dataclass
class DecodeBatch:
    """Lane ``i`` is slot ``i``; ``lengths`` count keys including this step's token."""

    cache: KVCache
    rows: torch.Tensor  # int64 [lanes]; padded lanes point at the scratch slot
    lengths: torch.Tensor  # int32 [lanes], >= 1
    max_len: int  # bound on lengths (static inside a CUDA graph)
    kernel: str  # one of DECODE_KERNELS

    def attend(self, layer: int, rotate_and_store: RotateAndStore, heads: int) -> torch.Tensor:
        keys, values = self.cache.flat_layer(layer)
        q = keys.new_empty(self.rows.shape[0], heads, keys.shape[2])
        rotate_and_store(keys, values, self.rows, q)
        k_cache, v_cache = self.cache.layer(layer)
        if self.kernel == "split":
            out = split_decode.decode_attention(q, k_cache, v_cache, self.lengths)
        else:
            out = decode_attention(
                q, k_cache, v_cache, self.lengths, self.max_len, self.kernel == "flash"
            )
        return out.flatten(1)
