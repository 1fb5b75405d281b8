"""Samples -> right-padded micro-batches under a token budget, and back.

A micro-batch holds rows of prompt + response tokens; its padded size
(rows x longest row) stays within `token_budget` unless one sequence alone is
longer. Rows are sorted by length so padding stays small.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from streamrl.backends.base import MicroBatch
from streamrl.types import Sample

log = logging.getLogger(__name__)


def pack_micro_batches(
    samples: list[Sample],
    indices: list[int],
    *,
    token_budget: int,
    pad_id: int,
) -> list[MicroBatch]:
    """Micro-batches over `samples[i] for i in indices` (mini-batch totals filled in)."""
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
    num_tokens = float(sum(samples[i].num_trained_tokens for i in indices))
    micro_batches = [_build(samples, rows, pad_id) for rows in bins]
    for micro_batch in micro_batches:
        micro_batch.num_tokens_in_mini_batch = max(num_tokens, 1.0)
        micro_batch.num_sequences_in_mini_batch = len(indices)
    return micro_batches


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
    routed = _routed_experts(samples, rows, width)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        sample_indices=list(rows),
        extras={} if routed is None else {"routed_experts": routed},
    )


def _routed_experts(samples: list[Sample], rows: list[int], width: int) -> torch.Tensor | None:
    """`extras["routed_experts"]`: int16 [B, T, layers * top_k], row (b, t) the experts the
    engine routed token t of row b to, -1 where unknown (no report, padding, a row's last
    token). None when no sample of the micro-batch carries routed experts."""
    reported = [samples[i].routed_experts for i in rows]
    columns = {r.shape[1] for r in reported if r is not None}
    if not columns:
        return None
    if len(columns) > 1:
        raise ValueError(f"samples report routed experts of different widths {sorted(columns)}")
    table = np.full((len(rows), width, columns.pop()), -1, dtype=np.int16)
    for row, routed in enumerate(reported):
        if routed is not None:
            table[row, : len(routed)] = routed
    return torch.from_numpy(table)


def response_slices(samples: list[Sample], micro_batch: MicroBatch) -> list[tuple[int, int, int]]:
    """(row, start, end) of each row's response tokens in the micro-batch layout."""
    slices = []
    for row, index in enumerate(micro_batch.sample_indices):
        start = len(samples[index].prompt_ids)
        slices.append((row, start, start + len(samples[index].response_ids)))
    return slices


def scatter_responses(
    samples: list[Sample], micro_batch: MicroBatch, per_sample: torch.Tensor
) -> torch.Tensor:
    """[N, R] response-aligned values -> [B, T] in the micro-batch layout (0 elsewhere)."""
    out = torch.zeros(micro_batch.input_ids.shape, dtype=per_sample.dtype)
    for row, start, end in response_slices(samples, micro_batch):
        out[row, start:end] = per_sample[micro_batch.sample_indices[row], : end - start]
    return out


def gather_responses(
    samples: list[Sample], micro_batches: list[MicroBatch], values: list[torch.Tensor]
) -> torch.Tensor:
    """[B, T] per micro-batch -> [N, R] response-aligned (R = longest response), 0-padded."""
    width = max((len(s.response_ids) for s in samples), default=0)
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for micro_batch, value in zip(micro_batches, values, strict=True):
        value = value.detach().float().cpu()
        for row, start, end in response_slices(samples, micro_batch):
            out[micro_batch.sample_indices[row], : end - start] = value[row, start:end]
    return out
