"""Samples -> micro-batches under a token budget, and back.

Two layouts (`learner.pack_sequences`; `MicroBatch` describes both):

- right-padded (`pad_micro_batches`): a micro-batch holds rows of prompt + response
  tokens, one sample per row; its padded size (rows x longest row) stays within
  `token_budget`. Rows are sorted by length so padding stays small, but a spread of
  lengths still computes some: 5% of the tokens of 32 samples of 256..8,192 tokens, 9% of
  16 (bench/cpu/packing.py), and a micro-batch fills less of its budget.
- packed (`packed_micro_batches`): a micro-batch is one row holding samples back to back
  (first-fit decreasing into bins of `token_budget` tokens), exactly as wide as its
  samples, with each sample's positions restarting at 0: no padding.

Either way a sample longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from streamrl.backends.base import MicroBatch
from streamrl.types import Sample

log = logging.getLogger(__name__)


def make_micro_batches(
    samples: list[Sample],
    indices: list[int],
    *,
    token_budget: int,
    pad_id: int,
    packed: bool,
) -> list[MicroBatch]:
    """Micro-batches over `samples[i] for i in indices`, packed or right-padded (the module
    docstring)."""
    if packed:
        return packed_micro_batches(samples, indices, token_budget=token_budget, pad_id=pad_id)
    return pad_micro_batches(samples, indices, token_budget=token_budget, pad_id=pad_id)


def pad_micro_batches(
    samples: list[Sample],
    indices: list[int],
    *,
    token_budget: int,
    pad_id: int,
) -> list[MicroBatch]:
    """Right-padded micro-batches over `samples[i] for i in indices` (mini-batch totals
    filled in)."""
    order = sorted(indices, key=lambda i: -_length(samples[i]))
    bins: list[list[int]] = []
    longest = 0
    for index in order:
        length = _length(samples[index])
        if bins and (len(bins[-1]) + 1) * max(longest, length) <= token_budget:
            bins[-1].append(index)
            longest = max(longest, length)
        else:
            if length > token_budget:
                log.warning("a %d-token sequence exceeds learner.micro_batch_tokens", length)
            bins.append([index])
            longest = length
    return _with_totals([_build(samples, rows, pad_id) for rows in bins], samples, indices)


pack_micro_batches = pad_micro_batches
"""The right-padded layout's first name (kept for callers that build padded rows)."""


def packed_micro_batches(
    samples: list[Sample],
    indices: list[int],
    *,
    token_budget: int,
    pad_id: int,
) -> list[MicroBatch]:
    """One-row micro-batches holding `samples[i] for i in indices` back to back: first-fit
    decreasing into bins of `token_budget` tokens (mini-batch totals filled in)."""
    order = sorted(indices, key=lambda i: -_length(samples[i]))
    bins: list[list[int]] = []
    free: list[int] = []
    for index in order:
        length = _length(samples[index])
        fits = next((b for b, room in enumerate(free) if room >= length), None)
        if fits is None:
            if length > token_budget:
                log.warning("a %d-token sequence exceeds learner.micro_batch_tokens", length)
            bins.append([index])
            free.append(token_budget - length)
        else:
            bins[fits].append(index)
            free[fits] -= length
    micro_batches = [_build_packed(samples, rows, pad_id) for rows in bins]
    return _with_totals(micro_batches, samples, indices)


def _with_totals(
    micro_batches: list[MicroBatch], samples: list[Sample], indices: list[int]
) -> list[MicroBatch]:
    num_tokens = float(sum(samples[i].num_trained_tokens for i in indices))
    for micro_batch in micro_batches:
        micro_batch.num_tokens_in_mini_batch = max(num_tokens, 1.0)
        micro_batch.num_sequences_in_mini_batch = len(indices)
    return micro_batches


def token_counts(micro_batches: list[MicroBatch]) -> tuple[int, int]:
    """(real tokens, computed tokens) of micro-batches: computed = rows x row width, so
    real / computed is the share of the forward's tokens that are not padding."""
    real = sum(int(mb.attention_mask.sum()) for mb in micro_batches)
    return real, sum(mb.input_ids.numel() for mb in micro_batches)


def _length(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def _build(samples: list[Sample], rows: list[int], pad_id: int) -> MicroBatch:
    width = max(_length(samples[i]) for i in rows)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(rows), width), dtype=np.int64)
    loss_mask = np.zeros((len(rows), width), dtype=np.float32)
    behaviour = np.zeros((len(rows), width), dtype=np.float32)
    for row, index in enumerate(rows):
        sample = samples[index]
        prompt, length = len(sample.prompt_ids), _length(sample)
        input_ids[row, :prompt] = sample.prompt_ids
        input_ids[row, prompt:length] = sample.response_ids
        attention[row, :length] = 1
        loss_mask[row, prompt:length] = sample.loss_mask
        behaviour[row, prompt:length] = np.where(sample.loss_mask > 0, sample.logprobs, 0.0)
    placements = [(row, 0) for row in range(len(rows))]
    routed = _routed_experts(samples, rows, placements, (len(rows), width))
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        sample_indices=list(rows),
        extras={} if routed is None else {"routed_experts": routed},
    )


def _build_packed(samples: list[Sample], indices: list[int], pad_id: int) -> MicroBatch:
    """One row: `indices`' samples back to back."""
    width = sum(_length(samples[i]) for i in indices)
    input_ids = np.full((1, width), pad_id, dtype=np.int64)
    attention = np.zeros((1, width), dtype=np.int64)
    loss_mask = np.zeros((1, width), dtype=np.float32)
    behaviour = np.zeros((1, width), dtype=np.float32)
    positions = np.zeros((1, width), dtype=np.int64)
    columns = []
    start = 0
    for index in indices:
        sample = samples[index]
        prompt, length = len(sample.prompt_ids), _length(sample)
        response = slice(start + prompt, start + length)
        input_ids[0, start : start + prompt] = sample.prompt_ids
        input_ids[0, response] = sample.response_ids
        attention[0, start : start + length] = 1
        loss_mask[0, response] = sample.loss_mask
        behaviour[0, response] = np.where(sample.loss_mask > 0, sample.logprobs, 0.0)
        positions[0, start : start + length] = np.arange(length)
        columns.append(start)
        start += length
    placements = [(0, column) for column in columns]
    routed = _routed_experts(samples, indices, placements, (1, width))
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        sample_indices=list(indices),
        extras={} if routed is None else {"routed_experts": routed},
        position_ids=torch.from_numpy(positions),
        sample_rows=[0] * len(indices),
        sample_columns=columns,
    )


def _routed_experts(
    samples: list[Sample],
    indices: list[int],
    placements: list[tuple[int, int]],
    size: tuple[int, int],
) -> torch.Tensor | None:
    """`extras["routed_experts"]`: int16 [B, T, layers * top_k], row (b, t) the experts the
    engine routed token t of row b to, -1 where unknown (no report, padding, a sample's last
    token). None when no sample of the micro-batch carries routed experts."""
    reported = [samples[i].routed_experts for i in indices]
    columns = {r.shape[1] for r in reported if r is not None}
    if not columns:
        return None
    if len(columns) > 1:
        raise ValueError(f"samples report routed experts of different widths {sorted(columns)}")
    table = np.full((*size, columns.pop()), -1, dtype=np.int16)
    for (row, start), routed in zip(placements, reported, strict=True):
        if routed is not None:
            table[row, start : start + len(routed)] = routed
    return torch.from_numpy(table)


def response_slices(samples: list[Sample], micro_batch: MicroBatch) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sample's response tokens in the micro-batch layout, in the
    order of `micro_batch.sample_indices`."""
    slices = []
    for index, (row, column) in zip(
        micro_batch.sample_indices, micro_batch.placements(), strict=True
    ):
        start = column + len(samples[index].prompt_ids)
        slices.append((row, start, start + len(samples[index].response_ids)))
    return slices


def scatter_responses(
    samples: list[Sample], micro_batch: MicroBatch, per_sample: torch.Tensor
) -> torch.Tensor:
    """[N, R] response-aligned values -> [B, T] in the micro-batch layout (0 elsewhere)."""
    out = torch.zeros(micro_batch.input_ids.shape, dtype=per_sample.dtype)
    for index, (row, start, end) in zip(
        micro_batch.sample_indices, response_slices(samples, micro_batch), strict=True
    ):
        out[row, start:end] = per_sample[index, : end - start]
    return out


def gather_responses(
    samples: list[Sample], micro_batches: list[MicroBatch], values: list[torch.Tensor]
) -> torch.Tensor:
    """[B, T] per micro-batch -> [N, R] response-aligned (R = longest response), 0-padded."""
    width = max((len(s.response_ids) for s in samples), default=0)
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for micro_batch, value in zip(micro_batches, values, strict=True):
        value = value.detach().float().cpu()
        for index, (row, start, end) in zip(
            micro_batch.sample_indices, response_slices(samples, micro_batch), strict=True
        ):
            out[index, : end - start] = value[row, start:end]
    return out
