"""Attention batches: how one forward of the compact model reads and writes the KV cache.

A batch object is handed to `CompactModel.forward`; per layer it stores the
new keys/values at their flat cache rows (``slot * max_seq_len + position``)
and attends. Prefill attends among the packed new tokens (every sequence
starts at position 0); decode attends to each lane's cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.engine.runner.attention import decode_attention, prefill_attention
from streamrl.engine.runner.kv_cache import KVCache


@dataclass
class PrefillBatch:
    cache: KVCache
    rows: torch.Tensor  # int64 [tokens]: flat cache row of each new token
    cu_seqlens: torch.Tensor  # int32 [sequences + 1]
    seq_lens: list[int]
    use_flash: bool

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.layer(layer)
        KVCache.write(keys, self.rows, k)
        KVCache.write(values, self.rows, v)
        return prefill_attention(q, k, v, self.cu_seqlens, self.seq_lens, self.use_flash)


@dataclass
class DecodeBatch:
    """Lane ``i`` is slot ``i``; ``lengths`` count keys including this step's token."""

    cache: KVCache
    rows: torch.Tensor  # int64 [lanes]; padded lanes point at the scratch slot
    lengths: torch.Tensor  # int32 [lanes], >= 1
    max_len: int  # bound on lengths (static inside a CUDA graph)
    use_flash: bool

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.layer(layer)
        KVCache.write(keys, self.rows, k)
        KVCache.write(values, self.rows, v)
        return decode_attention(q, keys, values, self.lengths, self.max_len, self.use_flash)
