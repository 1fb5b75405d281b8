"""The preallocated per-slot KV cache.

Shape per tensor: ``[layers, slots + 1, max_seq_len, kv_heads, head_dim]``.
Slot ``s`` row ``p`` holds the key/value of position ``p`` of the sequence in
slot ``s``. The extra last slot is scratch: padded decode lanes write there, so
a padded lane never touches a real sequence. Rows past a sequence's length
hold stale but finite values (the cache starts zeroed), which masked
attention ignores.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (num_layers, num_slots + 1, max_seq_len, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.scratch_slot = num_slots

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def scratch_row(self) -> int:
        """Flat row index (slot * max_seq_len + position) where padded lanes write."""
        return self.scratch_slot * self.max_seq_len

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of one layer: [slots + 1, max_seq_len, kv_heads, head_dim]."""
        return self.keys[index], self.values[index]

    def flat_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of one layer as ``[(slots + 1) * max_seq_len, kv_heads, head_dim]``:
        row ``slot * max_seq_len + position``."""
        return tuple(cache[index].flatten(0, 1) for cache in (self.keys, self.values))

    def move_slots(self, sources: list[int], targets: list[int], num_rows: int) -> None:
        """Copy the first ``num_rows`` positions of each source slot into its target slot.

        Precondition: sources and targets are disjoint (no copy reads a slot another writes)."""
        if not sources:
            return
        device = self.keys.device
        source_index = torch.tensor(sources, device=device)
        target_index = torch.tensor(targets, device=device)
        for cache in (self.keys, self.values):
            cache[:, target_index, :num_rows] = cache[:, source_index, :num_rows]

    def copy_slot(self, source: int, target: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` positions of ``source`` into ``target`` (all layers)."""
        if source == target or num_rows <= 0:
            return
        self.keys[:, target, :num_rows].copy_(self.keys[:, source, :num_rows])
        self.values[:, target, :num_rows].copy_(self.values[:, source, :num_rows])
