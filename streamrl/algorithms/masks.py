"""Masked reductions over the [B, T] token layout (0 where nothing is masked, never NaN)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is nonzero (0 where there are none, never NaN)."""
    is_on = mask > 0
    values = torch.where(is_on, x, 0.0)
    if dim is None:
        return values.sum() / is_on.sum().clamp_min(1)
    return values.sum(dim) / is_on.sum(dim).clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the masked positions, 0 off the mask.

    The std is the population one (divide by the count), so the masked result
    has mean 0 and std 1 exactly up to eps."""
    is_on = mask > 0
    centered = torch.where(is_on, x - masked_mean(x, mask), 0.0)
    std = masked_mean(centered.square(), mask).sqrt()
    return centered / (std + eps)
