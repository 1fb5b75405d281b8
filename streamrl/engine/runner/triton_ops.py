"""Hand-written Triton kernels for elementwise steps of the decoder on CUDA.

torch.compile fuses the decoder's small ops (`kernels.compiled_ops`), but its
dynamic-shape kernels index with symbolic sizes: SwiGLU over the fused
gate/up projection took 13 us a layer at 512 lanes on the H200, where moving
its 15 MB at full bandwidth takes about 3. These kernels read each row in wide blocks
and round as the eager ops do (`kernels.silu_mul`: SiLU rounded to the model
dtype, then the product). None where Triton is missing: callers keep the
compiled or eager op.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 1024  # columns per program


@functools.cache
def _silu_mul_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def silu_mul(x_ptr, out_ptr, width, x_row, out_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(x_ptr + row * x_row + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_row + width + cols, mask=inside, other=0.0)
        activated = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        out = activated.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * out_row + cols, out.to(up.dtype), mask=inside)

    return silu_mul


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 * width] (unit last stride)."""
    rows, double = gate_up.shape
    width = double // 2
    out = gate_up.new_empty(rows, width)
    _silu_mul_kernel()[(rows, -(-width // BLOCK))](
        gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=BLOCK
    )
    return out


@functools.cache
def _rope_store_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rope_store(
        qkv_ptr, cos_sin_ptr, keys_ptr, values_ptr, rows_ptr, queries_ptr, q_norm_ptr, k_norm_ptr,
        qkv_row, cos_sin_row, cache_row, queries_row, eps,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        ROTATED: tl.constexpr, VALUES: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        half: tl.constexpr = HEAD_DIM // 2
        heads = tl.arange(0, ROTATED)[:, None]  # queries, then keys
        dims = tl.arange(0, HEAD_DIM)[None, :]
        partner = (dims + half) % HEAD_DIM  # rotate_half: [-x2, x1]
        is_head = heads < HEADS + KV_HEADS
        source = qkv_ptr + token * qkv_row + heads * HEAD_DIM
        x = tl.load(source + dims, mask=is_head, other=0.0)
        x_partner = tl.load(source + partner, mask=is_head, other=0.0)
        dtype = x.dtype
        if HAS_NORM:  # Qwen3: RMSNorm per head, statistics in float32, as `kernels.rms_norm`
            x32 = x.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)[:, None]
            is_query = heads < HEADS
            weight = tl.where(is_query, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims))
            weight_partner = tl.where(
                is_query, tl.load(q_norm_ptr + partner), tl.load(k_norm_ptr + partner)
            )
            x = (weight.to(tl.float32) * (x32 * inv_rms).to(dtype).to(tl.float32)).to(dtype)
            x_partner = (
                weight_partner.to(tl.float32)
                * (x_partner.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
            ).to(dtype)
        rotated = tl.where(dims < half, -x_partner.to(tl.float32), x_partner.to(tl.float32))
        cos = tl.load(cos_sin_ptr + token * cos_sin_row + dims).to(tl.float32)
        sin = tl.load(cos_sin_ptr + token * cos_sin_row + HEAD_DIM + dims).to(tl.float32)
        # Rounded op by op as `rope.apply_rope` in the model dtype: x * cos, rotated * sin, sum.
        out = (x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(
            tl.float32
        )
        out = out.to(dtype)
        row = tl.load(rows_ptr + token)
        tl.store(queries_ptr + token * queries_row + heads * HEAD_DIM + dims, out,
                 mask=heads < HEADS)  # fmt: skip
        key_at = keys_ptr + row * cache_row + (heads - HEADS) * HEAD_DIM + dims
        tl.store(key_at, out, mask=(heads >= HEADS) & is_head)
        value_heads = tl.arange(0, VALUES)[:, None]
        is_value = value_heads < KV_HEADS
        value_at = qkv_ptr + token * qkv_row + (HEADS + KV_HEADS + value_heads) * HEAD_DIM + dims
        value = tl.load(value_at, mask=is_value, other=0.0)
        tl.store(values_ptr + row * cache_row + value_heads * HEAD_DIM + dims, value,
                 mask=is_value)  # fmt: skip

    return rope_store


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
    """`kernels.rope_store` in one kernel (one program per token); the same arguments, with
    ``qkv``, ``cos_sin`` and ``queries`` contiguous in their last dims and ``keys`` and
    ``values`` contiguous rows."""
    tokens, heads, head_dim = queries.shape
    kv_heads = keys.shape[1]
    has_norm = q_norm is not None
    _rope_store_kernel()[(tokens,)](
        qkv, cos_sin, keys, values, rows, queries,
        q_norm if has_norm else qkv, k_norm if has_norm else qkv,
        qkv.stride(0), cos_sin.stride(0), keys.stride(0), queries.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        ROTATED=_power_of_two(heads + kv_heads), VALUES=_power_of_two(kv_heads),
        HAS_NORM=has_norm,
    )  # fmt: skip


def _power_of_two(count: int) -> int:
    return 1 << (count - 1).bit_length()


def available(device: torch.device, head_dim: int | None = None) -> bool:
    """Whether these kernels serve tensors on ``device`` (and `rope_store` ``head_dim``:
    a power of two)."""
    if head_dim is not None and head_dim & (head_dim - 1):
        return False
    return device.type == "cuda" and _silu_mul_kernel() is not None
