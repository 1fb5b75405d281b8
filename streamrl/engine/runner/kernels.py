"""The small elementwise pieces of the decoder, eager or fused by torch.compile.

Eager, each is several kernel launches (RMSNorm alone is ~6); fused, one. In
a CUDA-graph decode step of a 0.5B model at batch 256 fusing them took the
step from ~4.3 ms to ~2.8 ms (reference/fast-engine.md); on CPU and in tests
the eager versions serve. Numerics equal transformers' Llama/Qwen modules.

`rope_store` is the widest fusion: from the fused q/k/v projection it rotates
queries and keys, stores keys and values in the KV cache and writes the
queries out contiguous: on the H200 three kernels where RoPE, the copies that
made slices contiguous and the two index copies took seven.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamrl.engine.runner import triton_ops
from streamrl.engine.runner.rope import apply_rope
from streamrl.engine.runner.sampling import tempered_softmax, uniform_from_seed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the statistics in float32, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(x + residual), x + residual)``; the add in the model dtype."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused [.., 2 * intermediate] projection: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_store(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    queries: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Rotate and store one layer's new tokens.

    ``qkv`` [tokens, (heads + 2 * kv_heads) * head_dim] is the fused projection; ``cos_sin``
    [tokens, 2, head_dim] the RoPE rows of their positions. Keys (rotated) and values go to
    the flat cache rows ``rows`` of ``keys``/``values`` [cache rows, kv_heads, head_dim];
    the rotated queries into ``queries`` [tokens, heads, head_dim]. Qwen3's per-head norms
    come before RoPE."""
    tokens, heads, head_dim = queries.shape
    kv_heads = keys.shape[1]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(qk[:, :heads], q_norm, eps)
        k = rms_norm(qk[:, heads:], k_norm, eps)
        qk = torch.cat([q, k], dim=1)
    qk = apply_rope(qk, cos_sin)  # queries and keys rotated together
    keys.index_put_((rows,), qk[:, heads:])
    values.index_put_((rows,), v)
    queries.copy_(qk[:, :heads])


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    add_rms_norm: Callable
    silu_mul: Callable
    rope_store: Callable
    softmax: Callable  # the sampler's pass over the vocabulary
    uniform: Callable  # the sampler's counter-based random numbers (a dozen integer ops)
    sample_rows: Callable | None = None  # the sampler's unfiltered path in one kernel
    is_compiled: bool = False


EAGER = Ops(rms_norm, add_rms_norm, silu_mul, rope_store, tempered_softmax, uniform_from_seed)


def compiled_ops(device: torch.device | None = None, head_dim: int | None = None) -> Ops:
    """The same functions through ``torch.compile`` (dynamic shapes: one kernel per op for
    every batch); on CUDA with Triton, SwiGLU, the unfiltered sampler and (for a
    power-of-two ``head_dim``) `rope_store` by the hand-written kernels of `triton_ops`."""

    def compile_one(fn):
        return torch.compile(fn, dynamic=True, fullgraph=True)

    use_triton = device is not None and triton_ops.available(device)
    triton_rope = use_triton and head_dim is not None and triton_ops.available(device, head_dim)
    return Ops(
        compile_one(rms_norm),
        compile_one(add_rms_norm),
        triton_ops.silu_mul if use_triton else compile_one(silu_mul),
        triton_ops.rope_store if triton_rope else compile_one(rope_store),
        compile_one(tempered_softmax),
        compile_one(uniform_from_seed),
        sample_rows=(
            triton_ops.sample_rows if use_triton and triton_ops.sampler_agrees(device) else None
        ),
        is_compiled=True,
    )
