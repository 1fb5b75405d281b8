"""Attention batches: how one forward of the compact model reads and writes the KV cache.

A batch object is handed to `CompactModel.forward`; per layer its `attend` is
given a ``rotate_and_store(keys, values, rows, queries)`` callable (the layer's
`kernels.rope_store` over its q/k/v projection), says where the new keys and
values go (flat cache rows ``slot * max_seq_len + position``) and in which
layout it wants the queries, then attends and returns ``[tokens, heads *
head_dim]``. Prefill attends among the packed new tokens (every sequence
starts at position 0); decode attends to each lane's cached prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from streamrl.engine.runner.attention import (
    decode_attention,
    grouped_decode_attention,
    prefill_attention,
)
from streamrl.engine.runner.kv_cache import KVCache

RotateAndStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class PrefillBatch:
    cache: KVCache
    rows: torch.Tensor  # int64 [tokens]: flat cache row of each new token
    cu_seqlens: torch.Tensor  # int32 [sequences + 1]
    seq_lens: list[int]
    use_flash: bool

    def attend(self, layer: int, rotate_and_store: RotateAndStore, heads: int) -> torch.Tensor:
        keys, values = self.cache.flat_layer(layer)
        tokens = self.rows.shape[0]
        kv_heads, head_dim = keys.shape[1:]
        q = keys.new_empty(tokens, heads, head_dim)
        rotate_and_store(keys, values, self.rows, q.view(tokens, kv_heads, -1, head_dim))
        # The new keys and values read back from the cache (one gather each: small
        # beside the prefill's matmuls).
        k, v = keys[self.rows], values[self.rows]
        out = prefill_attention(q, k, v, self.cu_seqlens, self.seq_lens, self.use_flash)
        return out.view(tokens, heads * head_dim)


@dataclass
class DecodeBatch:
    """Lane ``i`` is slot ``i``; ``lengths`` count keys including this step's token."""

    cache: KVCache
    rows: torch.Tensor  # int64 [lanes]; padded lanes point at the scratch slot
    lengths: torch.Tensor  # int32 [lanes], >= 1
    max_len: int  # bound on lengths (static inside a CUDA graph)
    use_flash: bool
    # FlashAttention's int32 offsets, made once per step rather than once per layer.
    lane_offsets: torch.Tensor = field(init=False)  # arange(lanes + 1)
    key_offsets: torch.Tensor = field(init=False)  # lane i's keys start at slot i
    query_offsets: torch.Tensor | None = field(init=False, default=None)  # lane i's queries

    def __post_init__(self):
        self.lane_offsets = torch.arange(
            self.rows.shape[0] + 1, device=self.rows.device, dtype=torch.int32
        )
        self.key_offsets = self.lane_offsets * self.cache.max_seq_len

    def attend(self, layer: int, rotate_and_store: RotateAndStore, heads: int) -> torch.Tensor:
        keys, values = self.cache.flat_layer(layer)
        lanes = self.rows.shape[0]
        kv_heads, head_dim = keys.shape[1:]
        groups = heads // kv_heads
        if self.use_flash:
            # Queries written grouped by KV head, the layout `grouped_decode_attention` reads.
            grouped = keys.new_empty(lanes, groups, kv_heads, head_dim)
            rotate_and_store(keys, values, self.rows, grouped.transpose(1, 2))
            if self.query_offsets is None:  # the same for every layer
                self.query_offsets = self.lane_offsets * groups
            out = grouped_decode_attention(
                grouped,
                *self.cache.layer(layer),
                self.lengths,
                self.query_offsets,
                self.key_offsets,
            )
            return out.transpose(1, 2).reshape(lanes, heads * head_dim)
        q = keys.new_empty(lanes, heads, head_dim)
        rotate_and_store(keys, values, self.rows, q.view(lanes, kv_heads, groups, head_dim))
        out = decode_attention(
            q, *self.cache.layer(layer), self.lengths, self.max_len, use_flash=False
        )
        return out.reshape(lanes, heads * head_dim)
