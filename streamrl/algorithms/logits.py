"""Log-probabilities and entropies from logits, in fp32 chunks (never a full fp32 copy of
[B, T, V] at once)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

_CHUNK_ELEMENTS = 1 << 24
"""Logit elements (B * positions * V) converted to fp32 at once by the logits helpers (64 MiB)."""


def logprobs_from_logits(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits[:, t-1] / temperature)[input_ids[:, t]] at position t; [B, T] float32.

    Position 0 (no predictor) is 0. Temperature 0 is treated as 1: greedy
    decoding has no tempered distribution, and engines report its logprobs on
    the raw one. Works in fp32 on chunks of positions (logsumexp + gather), so
    no fp32 log-softmax copy of the whole [B, T, V] is made; under autograd the
    fp32 chunks kept for backward add up to one fp32 copy of the logits.
    """
    _check_logits(logits, input_ids)
    pieces = [logits.new_zeros(logits.shape[0], min(logits.shape[1], 1), dtype=torch.float32)]
    for start, end, scaled in _fp32_chunks(logits, temperature):
        targets = input_ids[:, start + 1 : end + 1].unsqueeze(-1)
        picked = scaled.gather(-1, targets).squeeze(-1)
        pieces.append(picked - torch.logsumexp(scaled, dim=-1))
    return torch.cat(pieces, dim=1)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits[:, t-1] / temperature) at position t; [B, T] float32.

    Position 0 is 0; temperature 0 is treated as 1 (as in `logprobs_from_logits`);
    computed in fp32 chunks as H = -sum_v p_v log p_v with log p = z - logsumexp(z)
    (not logsumexp(z) - sum p z, which cancels badly for peaked distributions).
    """
    _check_logits(logits, None)
    pieces = [logits.new_zeros(logits.shape[0], min(logits.shape[1], 1), dtype=torch.float32)]
    for _, _, scaled in _fp32_chunks(logits, temperature):
        log_probs = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
        pieces.append(-(torch.exp(log_probs) * log_probs).sum(-1))
    return torch.cat(pieces, dim=1)


def logprobs_of_rows(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits[i] / temperature)[targets[i]] for flat rows; [N] float32.

    For a learner that ran its output head only on the positions it trains
    (logits [N, V], one row per predicted token). Same temperature rule and
    fp32 chunking as `logprobs_from_logits`."""
    pieces = [
        chunk.gather(-1, targets[start:end, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1)
        for start, end, chunk in _row_chunks(logits, temperature)
    ]
    return torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)


def entropy_of_rows(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits[i] / temperature) for flat rows; [N] float32.

    Differentiable with respect to `logits` (an entropy bonus trains through it). The
    backward pass recomputes the softmax chunk by chunk from the logits instead of
    keeping fp32 copies: with x = z / T, dH/dz_j = -p_j (log p_j + H) / T."""
    if logits.requires_grad and torch.is_grad_enabled():
        return _RowEntropy.apply(logits, temperature)
    return _entropy_rows(logits, temperature)


def _entropy_rows(logits: Tensor, temperature: float) -> Tensor:
    pieces = []
    for _, _, chunk in _row_chunks(logits, temperature):
        log_probs = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
        pieces.append(-(torch.exp(log_probs) * log_probs).sum(-1))
    return torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)


class _RowEntropy(torch.autograd.Function):
    """`entropy_of_rows` with a backward that recomputes p from the saved logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float) -> Tensor:
        entropy = _entropy_rows(logits.detach(), temperature)
        ctx.save_for_backward(logits, entropy)
        ctx.temperature = temperature
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: Tensor) -> tuple[Tensor, None]:
        logits, entropy = ctx.saved_tensors
        scale = ctx.temperature or 1.0
        grad = torch.empty_like(logits)
        for start, end, chunk in _row_chunks(logits.detach(), ctx.temperature):
            log_probs = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
            local = -torch.exp(log_probs) * (log_probs + entropy[start:end, None])
            grad[start:end] = (local * (grad_entropy[start:end, None] / scale)).to(grad.dtype)
        return grad, None


def _row_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[int, int, Tensor]]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = temperature or 1.0
    step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for start in range(0, logits.shape[0], step):
        end = min(start + step, logits.shape[0])
        chunk = logits[start:end].float()
        yield start, end, chunk if scale == 1.0 else chunk / scale


def _check_logits(logits: Tensor, input_ids: Tensor | None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if input_ids is not None and tuple(input_ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"input_ids shape {tuple(input_ids.shape)} does not match logits [B, T] = "
            f"{tuple(logits.shape[:2])}"
        )


def _fp32_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, logits[:, start:end] / temperature in fp32) over predictor positions 0..T-2."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = temperature or 1.0  # 0 = greedy: logprobs of the raw distribution
    batch, length, vocab = logits.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * vocab))
    for start in range(0, length - 1, step):
        end = min(start + step, length - 1)
        scaled = logits[:, start:end].float()
        yield start, end, scaled if scale == 1.0 else scaled / scale
