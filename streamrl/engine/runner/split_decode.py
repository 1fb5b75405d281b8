"""Decode attention as a Triton split-KV kernel that reads each KV head once per lane.

One decode step has one query per lane and head. FlashAttention-2's varlen
kernel gives every (lane, head) a 128-row query tile and walks the keys in
one pass: at 512 lanes of a 14-head, 2-KV-head model that is 7,168 mostly
empty tiles, latency-bound (45 us a layer on the H200 at 256 cached tokens a
lane, where reading the keys and values once takes about 14 us). Here a program takes one lane, one KV head
and one span of the lane's keys, with the query heads that share that KV head
as the rows of its tile; where lanes are too few to fill the GPU, a lane's
keys are split into spans and a second kernel merges the spans' partial
outputs by their log-sum-exp. Spans past a lane's length exit at once, so the
cost follows the lanes' real lengths, not the cache's `max_seq_len`.

The cache layout is the runner's (`kv_cache.py`): ``[slots, max_seq_len,
kv_heads, head_dim]``, lane ``i`` in slot ``i``. Needs CUDA, Triton, fp16 or
bf16 and a power-of-two head_dim up to 256 (`available`); callers fall back
to FlashAttention or SDPA otherwise. Softmax and accumulation run in float32.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK_N = 64  # keys per inner iteration
MAX_SPLITS = 32  # spans per lane at most (the merge kernel reads them all)
PROGRAMS = 512  # programs that fill the GPU: a few per SM (132 on the H200)


@functools.cache
def _kernels():
    """``(spans, merge)`` Triton kernels, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def spans(
        q_ptr, k_ptr, v_ptr, lengths_ptr, out_ptr, lse_ptr, result_ptr,
        q_lane, q_head, k_slot, k_row, k_head, r_lane, r_head, scale,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        SPAN: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        lane = tl.program_id(0).to(tl.int64)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        heads = kv * GROUPS + tl.arange(0, BLOCK_G)
        is_head = tl.arange(0, BLOCK_G) < GROUPS
        dims = tl.arange(0, HEAD_DIM)
        length = tl.load(lengths_ptr + lane)
        start = split * SPAN
        end = tl.minimum(start + SPAN, length)
        q = tl.load(
            q_ptr + lane * q_lane + heads[:, None] * q_head + dims[None, :],
            mask=is_head[:, None],
            other=0.0,
        )
        row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        base = lane * k_slot + kv * k_head
        for first in range(start, end, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            is_key = rows < end
            at = base + rows[:, None] * k_row + dims[None, :]
            k = tl.load(k_ptr + at, mask=is_key[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(is_key[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(row_max - new_max)
            row_sum = row_sum * rescale + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + at, mask=is_key[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            row_max = new_max
        has_keys = row_sum > 0
        out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
        if SPLITS == 1:  # the whole lane in one span: the final output
            at = lane * r_lane + heads[:, None] * r_head + dims[None, :]
            tl.store(result_ptr + at, out.to(result_ptr.dtype.element_ty), mask=is_head[:, None])
        else:
            # Partials: out [lanes, heads, SPLITS, HEAD_DIM], lse [lanes, heads, SPLITS].
            lse = tl.where(has_keys, row_max + tl.log(row_sum), float("-inf"))
            at_head = (lane * (tl.num_programs(1) * GROUPS) + heads) * SPLITS + split
            at = at_head[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_ptr + at, out, mask=is_head[:, None])
            tl.store(lse_ptr + at_head, lse, mask=is_head)

    @triton.jit
    def merge(
        out_ptr, lse_ptr, result_ptr, r_lane, r_head,
        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        lane = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        row = lane * HEADS + head
        lse = tl.load(lse_ptr + row * SPLITS + splits)
        weights = tl.exp(lse - tl.max(lse, axis=0))  # span 0 always has keys: a finite max
        partial = tl.load(out_ptr + (row * SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :])
        out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
        tl.store(result_ptr + lane * r_lane + head * r_head + dims, out)

    return spans, merge


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `decode_attention` can serve this device, dtype and head size."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim in (16, 32, 64, 128, 256)
        and _kernels() is not None
    )


def spans_for(max_seq_len: int, lanes: int, kv_heads: int) -> tuple[int, int]:
    """``(span, splits)``: keys per program and programs per lane and KV head. Enough
    programs to fill the GPU (`PROGRAMS`; lanes times KV heads alone do at large batches,
    and one span per lane needs no merge), spans of at least 128 keys, at most
    `MAX_SPLITS`; splits a power of two (the merge kernel's block)."""
    splits = 1
    while (
        lanes * kv_heads * splits < PROGRAMS and splits < MAX_SPLITS and splits * 128 < max_seq_len
    ):
        splits *= 2
    span = math.ceil(max_seq_len / splits / BLOCK_N) * BLOCK_N
    return span, splits


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """One query per lane over its slot's first ``lengths[i]`` cached keys.

    q: [lanes, heads, head_dim] (unit last stride); caches: [slots, max_seq_len, kv_heads,
    head_dim] with unit strides in their last two dims; lengths: int32 [lanes], >= 1.
    Returns [lanes, heads, head_dim] in q's dtype. The split is fixed by the shapes, so a
    CUDA graph captured for a lane count keeps its launch."""
    spans, merge = _kernels()
    lanes, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    groups = heads // kv_heads
    span, splits = spans_for(k_cache.shape[1], lanes, kv_heads)
    out = torch.empty_like(q)
    if splits > 1:
        partial = torch.empty(lanes, heads, splits, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(lanes, heads, splits, device=q.device, dtype=torch.float32)
    else:
        partial = lse = out  # not written
    spans[(lanes, kv_heads, splits)](
        q, k_cache, v_cache, lengths, partial, lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), head_dim**-0.5,
        GROUPS=groups, BLOCK_G=max(16, 1 << (groups - 1).bit_length()), HEAD_DIM=head_dim,
        SPAN=span, SPLITS=splits, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if splits > 1:
        merge[(lanes, heads)](
            partial, lse, out, out.stride(0), out.stride(1),
            HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits,
        )  # fmt: skip
    return out
