"""Attention over the per-slot KV cache: FlashAttention-2 inside PyTorch, or SDPA.

Layouts: q/k/v of new tokens are flat ``[tokens, heads, head_dim]``; a layer's
cache is ``[slots, max_seq_len, kv_heads, head_dim]`` and decode lane ``i``
reads slot ``i`` (the runner keeps running sequences in slots ``0..n-1``).

The FlashAttention-2 kernel is reached through the private
``torch.ops.aten._flash_attention_forward``; `flash_varlen` is the only place
that calls it. It needs CUDA, fp16/bf16 and a head_dim that is a multiple of 8
(at most 256); otherwise SDPA serves (CPU, float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Set True to route everything through SDPA (a switch for diagnosis and benchmarks).
FORCE_SDPA = False


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `flash_varlen` can serve this device/dtype/head size."""
    return (
        not FORCE_SDPA
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length FlashAttention-2 (grouped-query aware) -> ``[tokens_q, heads, head_dim]``.

    Sequence ``b`` attends with queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` to
    keys from ``k[cu_seqlens_k[b]:]``, ``seqused_k[b]`` of them when given (else up
    to ``cu_seqlens_k[b+1]``). int32 offsets. Causal alignment is bottom-right.
    """
    scale = q.shape[-1] ** -0.5
    # The kernel needs a unit last stride; slices of the fused qkv projection are made
    # contiguous here (a small copy) rather than trusting stride checks across versions.
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    out = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        0.0,  # dropout
        causal,
        False,  # return_debug_mask
        scale=scale,
        seqused_k=seqused_k,
    )
    return out[0]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    use_flash: bool,
) -> torch.Tensor:
    """One query per lane over its slot's first ``lengths[i]`` cached keys.

    q: [lanes, heads, head_dim]; caches: [slots, max_seq_len, kv_heads, head_dim];
    lengths: int32 [lanes] (>= 1); ``max_len`` bounds lengths (the SDPA path reads
    that many keys per lane, FlashAttention only the used ones).
    """
    lanes = q.shape[0]
    if use_flash:
        slots, seq_len = k_cache.shape[:2]
        offsets = torch.arange(lanes + 1, device=q.device, dtype=torch.int32)
        return flash_varlen(
            q,
            k_cache.view(slots * seq_len, *k_cache.shape[2:]),
            v_cache.view(slots * seq_len, *v_cache.shape[2:]),
            offsets,
            offsets * seq_len,
            1,
            seq_len,
            causal=False,
            seqused_k=lengths,
        )
    keys = k_cache[:lanes, :max_len].transpose(1, 2)  # [lanes, kv_heads, max_len, head_dim]
    values = v_cache[:lanes, :max_len].transpose(1, 2)
    mask = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :], enable_gqa=True
    )
    return out[:, :, 0, :]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: list[int],
    use_flash: bool,
) -> torch.Tensor:
    """Causal self-attention of packed sequences that start at position 0.

    q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
    ``cu_seqlens`` int32 [num_seqs + 1] on the device, ``seq_lens`` the same on the host.
    """
    if use_flash:
        max_len = max(seq_lens)
        return flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)
    outputs = []
    start = 0
    for length in seq_lens:
        end = start + length
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],
            k[start:end].transpose(0, 1)[None],
            v[start:end].transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        outputs.append(out[0].transpose(0, 1))
        start = end
    return torch.cat(outputs, dim=0)
