"""RoPE for the Megatron learner on CUDA as two hand-written Triton kernels.

Without Transformer Engine, megatron-core rotates every query and key through
`rope_utils._apply_rotary_pos_emb_bshd` (a cos, a sin, a rotate-half `cat`, two products and
a sum). `speed.compiled_rope` runs it torch.compile'd with dynamic shapes; on the H200 at
Qwen2-1.5B with 8 x 4,096-token micro-batches those kernels moved their bytes at about
0.5 TB/s and took 41 ms of a 0.96 s step (`bench/results/gpu/megatron_profile_h200x1_d22d3de.json`:
the `triton_poi_fused_..._cos_mul_neg_sin` kernels), a tenth of what the bytes allow.

Here the cos and sin tables are made in torch exactly as Megatron makes them (from the
float32 angles, times `mscale`, rounded to the input's dtype: [S, 1 or B, D], small), and one
program per token rotates all its heads: for the halves x1, x2 of each head,

    out1 = x1 c1 - x2 s1,        out2 = x2 c2 + x1 s2,

in float32, rounded once to the dtype (Megatron's eager path rounds each product and the
sum). The backward is the transpose: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1. The input
may be a strided view (Megatron's queries and keys are slices of the fused QKV projection);
the output is contiguous. `speed.compiled_rope` sends a call here when its kernels are on,
the tensor is on CUDA, the rotary dimension is the head dimension and the layout is
Megatron's usual one (not interleaved, not MLA's); every other call keeps the compiled
function. A start-up check (`agrees`) keeps them off where they compute something else.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

logger = logging.getLogger(__name__)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rotate(
        x_ptr, cos_ptr, sin_ptr, out_ptr,
        batch, heads, half,
        x_seq, x_batch, x_head, table_seq, table_batch,
        SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One token (s, b): out1 = x1 c1 - SIGN x2 s1, out2 = x2 c2 + SIGN x1 s2 for all heads,
        with c/s the token's table rows; the backward passes SIGN = -1 and swaps the sine
        halves' roles (see `_rotate`)."""
        token = tl.program_id(0).to(tl.int64)
        s = token // batch
        b = token % batch
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        inside = (h < heads) & (d < half)
        at = x_ptr + s * x_seq + b * x_batch + h * x_head + d
        x1 = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(at + half, mask=inside, other=0.0).to(tl.float32)
        row = s * table_seq + b * table_batch + d
        in_row = d < half
        c1 = tl.load(cos_ptr + row, mask=in_row, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + row + half, mask=in_row, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + row, mask=in_row, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + row + half, mask=in_row, other=0.0).to(tl.float32)
        if SIGN > 0:
            out1 = x1 * c1 - x2 * s1
            out2 = x2 * c2 + x1 * s2
        else:
            out1 = x1 * c1 + x2 * s2
            out2 = x2 * c2 - x1 * s1
        dtype = out_ptr.dtype.element_ty
        to = out_ptr + token * heads * 2 * half + h * 2 * half + d
        tl.store(to, out1.to(dtype), mask=inside)
        tl.store(to + half, out2.to(dtype), mask=inside)

    return rotate


_LAST_TABLES: dict[str, tuple] = {}


def tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """Megatron's cos and sin of [S, 1 or B, 1, D] float32 angles, times `mscale`, in `dtype`:
    two contiguous [S, 1 or B, D] tensors.

    Every layer's queries and keys of one forward are rotated by the same angles tensor, so
    the last tables are kept for as long as that tensor lives unchanged: made once per
    forward instead of twice per layer (five small kernels each, which a learner whose step
    is bound by kernel launches notices)."""
    key = (freqs.data_ptr(), freqs._version, freqs.shape, freqs.stride(), dtype, mscale)
    last = _LAST_TABLES.get("last")
    if last is not None and last[0] == key and last[1]() is freqs:
        return last[2]
    angles = freqs.squeeze(2)
    cos = (torch.cos(angles) * mscale).to(dtype).contiguous()
    sin = (torch.sin(angles) * mscale).to(dtype).contiguous()
    _LAST_TABLES["last"] = (key, weakref.ref(freqs), (cos, sin))
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x [S, B, H, D] (last dimension contiguous) rotated by the [S, 1 or B, D] tables: the
    forward with sign 1, its transpose (the backward) with -1. Contiguous [S, B, H, D]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    seq, batch, heads, dim = x.shape
    half = dim // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    table_batch = cos.stride(1) if cos.shape[1] > 1 else 0
    _kernels()[(seq * batch,)](
        x, cos, sin, out,
        batch, heads, half,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), table_batch,
        SIGN=sign, BLOCK_H=_next_power_of_2(heads), BLOCK_D=_next_power_of_2(half),
    )  # fmt: skip
    return out


class TritonRope(torch.autograd.Function):
    """Rotate [S, B, H, D] by Megatron's cos/sin tables ([S, 1 or B, D], from `tables`)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def takes(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool, mla: bool) -> bool:
    """Whether these kernels compute this call of Megatron's `_apply_rotary_pos_emb_bshd`:
    a CUDA [S, B, H, D] tensor with an even D all rotated by [S, 1 or B, 1, D] angles, in
    Megatron's usual rotate-half layout."""
    return (
        t.is_cuda
        and t.dim() == 4
        and freqs.dim() == 4
        and not interleaved
        and not mla
        and t.shape[-1] % 2 == 0
        and freqs.shape[-1] == t.shape[-1]
        and freqs.shape[0] == t.shape[0]
        and freqs.shape[1] in (1, t.shape[1])
        and freqs.shape[2] == 1
        and freqs.dtype == torch.float32
    )


def apply(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """`_apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)` for a call that `takes`."""
    cos, sin = tables(freqs, t.dtype, mscale)
    return TritonRope.apply(t, cos, sin)


def reference(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """The rotation in float32 from Megatron's dtype-rounded tables (what `apply` rounds once)."""
    cos, sin = (table.float().unsqueeze(2) for table in tables(freqs, t.dtype, mscale))
    x1, x2 = t.float().chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


@functools.cache
def agrees(device: torch.device) -> bool:
    """Whether the kernels rotate as Megatron does on ``device``, and their backward is the
    rotation's transpose (checked once per process on a strided bf16 [S, B, H, D] view,
    within a bf16 ulp of the terms); the learner uses them only where they do."""
    generator = torch.Generator(device=device).manual_seed(0)
    seq, batch, heads, dim = 37, 3, 5, 96
    fused = torch.randn(seq, batch, heads, 2 * dim, device=device, generator=generator)
    x = fused.bfloat16()[..., :dim]  # a strided view, as Megatron's queries are
    inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=device).float() / dim)
    angles = torch.outer(torch.arange(seq, device=device).float() * 40, inverse)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    grad = torch.randn(seq, batch, heads, dim, device=device, generator=generator).bfloat16()
    try:
        leaf = x.detach().requires_grad_()
        out = apply(leaf, freqs)
        out.backward(grad)
    except Exception as error:  # a Triton that cannot build them here: the compiled path
        logger.warning("the Triton RoPE failed on %s (%r): compiled RoPE", device, error)
        return False
    want = reference(x, freqs)
    cos, sin = (table.float().unsqueeze(2) for table in tables(freqs, x.dtype))
    g1, g2 = grad.float().chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    want_dx = torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    size = torch.cat(((x1 * c1).abs() + (x2 * s1).abs(), (x2 * c2).abs() + (x1 * s2).abs()), -1)
    size_dx = torch.cat(((g1 * c1).abs() + (g2 * s2).abs(), (g2 * c2).abs() + (g1 * s1).abs()), -1)
    ulp = 2.0**-7
    good = bool(
        out.is_contiguous()
        and ((out.float() - want).abs() <= ulp * size).all()
        and ((leaf.grad.float() - want_dx).abs() <= ulp * size_dx).all()
    )
    if good:
        logger.info("the Triton RoPE agrees with megatron-core's rotation on %s", device)
    else:
        logger.warning("the Triton RoPE disagrees on %s: compiled RoPE", device)
    return good
