"""Rotary position embeddings: the cos/sin table and its application.

Convention: Hugging Face's "rotate half" layout (the two halves of each head
are the pair), which is what Llama/Qwen checkpoints on the Hub expect.
Supported ``rope_type``: ``default`` and ``llama3`` (Llama 3.1's frequency
scaling). Other types raise `UnsupportedModel`, so "auto" falls back to the
generic transformers runner.
"""

from __future__ import annotations

import math

import torch


class UnsupportedModel(ValueError):
    """The compact runner cannot serve this config (use the transformers runner)."""


def rope_parameters(config) -> dict:
    """``{"rope_type", "rope_theta", ...}`` from a transformers 4.x or 5.x config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, scaled per ``rope_type``."""
    params = rope_parameters(config)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    raise UnsupportedModel(f"rope_type {rope_type!r} is not supported by the compact runner")


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short kept, a smooth ramp between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(config, head_dim: int, max_positions: int, device, dtype) -> torch.Tensor:
    """[max_positions, 2, head_dim]: full-width cos then sin of each position (``dtype``).

    Angles are computed in float32 and rounded to ``dtype`` once, as transformers does.
    """
    inv_freq = inverse_frequencies(config, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1).to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim] by per-token ``cos_sin`` [tokens, 2, head_dim].

    ``x * cos + rotate_half(x) * sin``, rounded op by op exactly as transformers does."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos_sin[:, None, 0] + rotated * cos_sin[:, None, 1]
