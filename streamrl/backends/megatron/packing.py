"""Packed rows on megatron-core without Transformer Engine: a document mask for core attention
and RoPE positions that restart at each sample.

A packed micro-batch (`MicroBatch.position_ids`, `streamrl.backends.batching`) holds several
samples back to back in one row. Two things keep each sample as it would be alone in a
right-padded row:

- attention: a token sees the earlier tokens of its own sample only. The schedule hands the
  core attention the row's document ids ([B, S] int32, `document_ids`) in the place of the
  attention mask (Megatron passes that argument through every layer untouched, pipeline
  stages and activation recompute included). `SdpaAttention` then runs
  `document_attention`: causal attention inside each sample
  (`streamrl.backends.documents.attend_within_samples`: one variable-length flash-attention
  call on CUDA, SDPA per sample elsewhere), so a row costs the sum of its samples' squares,
  not the row's square. Megatron's unfused attention (`learner.megatron.attention =
  "local"`) takes the mask made dense (`masked_positions`).
- RoPE: Megatron's rotary embedding covers positions 0..S-1 of the row; a forward hook on
  every rotary module (`install`; the model's, and each MLA attention's own) picks each
  token's row of it by the sample's own position (`PackedPositions.positions`, set before
  each forward). RoPE is relative, so the scores would be the same in exact arithmetic
  without it, but float32 angles at a row offset of thousands are not the angles at 0.

Limits: MLA computes its rotary inside the attention layer, so under full activation
recompute with pipeline stages (a micro-batch's recompute runs after later forwards) its
positions would be another micro-batch's; `check_supported` refuses that layout.
"""

from __future__ import annotations

from typing import Any

import torch

from streamrl.backends.documents import attend_within_samples, sample_spans


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int32: the index of each token's sample in its row (a new one wherever the
    position is 0)."""
    return (position_ids == 0).cumsum(dim=1, dtype=torch.int32)


def padded_positions(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """`position_ids` right-padded to `length` columns (sequence parallelism's multiple of TP):
    the padding is one more sample, positions 0.."""
    pad = length - position_ids.shape[1]
    if pad <= 0:
        return position_ids
    tail = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat([position_ids, tail.expand(position_ids.shape[0], pad)], dim=1)


def dense_mask(documents: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True where query i may attend key j: j <= i in the same sample."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]


def masked_positions(documents: torch.Tensor) -> torch.Tensor:
    """The dense mask the other way round (True = masked), as Megatron's unfused attention
    takes it."""
    return ~dense_mask(documents)


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    documents: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention inside each sample: query [B, heads, S, d], key/value [B, groups, S, d]
    (GQA: query head j reads group j // (heads / groups)), documents [B, S] -> [B, heads, S, d]
    (the module docstring)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    spans = sample_spans(starts, key=documents)
    return attend_within_samples(query, key, value, spans, scale=scale)


class PackedPositions:
    """The positions RoPE uses for the next forward of one model stage: [S, B] long in
    Megatron's token order, or None (right-padded rows: position = column)."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None

    def rope_hook(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """A rotary module's output [S, 1, 1, d] (or (it, mscale)) -> [S, B, 1, d] rows picked
        by each token's own position."""
        if self.positions is None:
            return output
        if isinstance(output, tuple):
            return (self._pick(output[0]), *output[1:])
        return self._pick(output)

    def _pick(self, emb: torch.Tensor) -> torch.Tensor:
        positions = self.positions
        if emb.shape[0] < positions.shape[0]:
            raise RuntimeError(
                f"rotary embedding of {emb.shape[0]} positions for a {positions.shape[0]}-token row"
            )
        return emb[:, 0, 0][positions].unsqueeze(2)


def install(model: torch.nn.Module) -> PackedPositions:
    """Hook every rotary module of one model stage to `model.packed_positions`."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary_types: tuple[type, ...] = (RotaryEmbedding,)
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            YarnRotaryEmbedding,
        )

        rotary_types += (YarnRotaryEmbedding,)
    except ImportError:  # pragma: no cover - every megatron-core that streamrl runs has it
        pass
    holder = PackedPositions()
    for module in model.modules():
        if isinstance(module, rotary_types):
            module.register_forward_hook(holder.rope_hook)
    model.packed_positions = holder
    return holder


def positions_of(model: torch.nn.Module) -> PackedPositions | None:
    """The PackedPositions of a (possibly DDP-wrapped) model stage."""
    return getattr(getattr(model, "module", model), "packed_positions", None)


def check_supported(shape: Any, *, gradient_checkpointing: bool, pp_size: int) -> None:
    """Refuse the one layout whose packed positions would be wrong (the module docstring)."""
    if shape.mla is not None and gradient_checkpointing and pp_size > 1:
        raise ValueError(
            "learner.pack_sequences with a multi-head latent attention model, "
            "learner.gradient_checkpointing and learner.megatron.pipeline_parallel_size > 1: "
            "a recompute would take a later micro-batch's RoPE positions; turn one of them off"
        )
