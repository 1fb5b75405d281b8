"""Hand-written Triton kernels for steps of the decoder on CUDA.

torch.compile fuses the decoder's small ops (`kernels.compiled_ops`), but its
dynamic-shape kernels index with symbolic sizes: SwiGLU over the fused
gate/up projection took 13 us a layer at 512 lanes on the H200, where moving
its 15 MB at full bandwidth takes about 3; and fused RoPE and cache stores
took three kernels. Here:

- `silu_mul`: each row in wide blocks, SiLU rounded to the model dtype before
  the product, as `kernels.silu_mul` rounds;
- `rope_store`: `kernels.rope_store` as one program per token, RoPE rounded op
  by op as `rope.apply_rope` (on the H200 not bit for bit: within one bf16
  step of the eager op);
- `sample_rows`: `sampling.sample`'s unfiltered path, one program per row
  reading the logits three times instead of materialising probabilities and
  their cumulative sum.

Where Triton is missing (`available`) callers keep the compiled or eager op.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

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


@functools.cache
def _sample_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def sample_rows(
        logits_ptr, inv_temperature_ptr, greedy_ptr, uniform_ptr, tokens_ptr, logprobs_ptr,
        vocab, row_stride, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        source = logits_ptr + row * row_stride
        inv_temperature = tl.load(inv_temperature_ptr + row)
        cols = tl.arange(0, BLOCK)
        # Pass 1: the largest scaled logit (and the raw argmax, for greedy rows).
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        top_at = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            at = start + cols
            x = tl.load(source + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
            better = x > top  # strictly: the first of equal maxima stays
            top = tl.where(better, x, top)
            top_at = tl.where(better, at, top_at)
        raw_max = tl.max(top, axis=0)
        argmax = tl.min(tl.where(top == raw_max, top_at, vocab), axis=0)
        # inv_temperature > 0, so the scaled maximum is the scaled raw maximum.
        peak = raw_max * inv_temperature
        # Pass 2: the total of exp(scaled - peak), accumulated as pass 3 accumulates it.
        total = 0.0
        for start in range(0, vocab, BLOCK):
            at = start + cols
            x = tl.load(source + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
            total += tl.sum(tl.exp(x * inv_temperature - peak), axis=0)
        # Pass 3: the first token whose cumulative mass exceeds u * total (never one of
        # probability zero: the same rule as `sampling._sample_from_cdf`).
        target = tl.load(uniform_ptr + row) * total
        running = 0.0
        token = vocab
        for start in range(0, vocab, BLOCK):
            at = start + cols
            x = tl.load(source + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
            weight = tl.exp(x * inv_temperature - peak)
            cumulative = running + tl.cumsum(weight, axis=0)
            crossing = tl.min(tl.where((cumulative > target) & (weight > 0), at, vocab), axis=0)
            token = tl.minimum(token, crossing)
            running += tl.sum(weight, axis=0)
        # u * total past the last cumulative sum (rounding, u within ~1e-7 of 1): the mode
        token = tl.where(token < vocab, token, argmax)
        token = tl.where(tl.load(greedy_ptr + row) != 0, argmax, token)
        chosen = tl.load(source + token).to(tl.float32)
        logprob = chosen * inv_temperature - peak - tl.log(total)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, logprob)

    return sample_rows


def sample_rows(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample`'s unfiltered path in one kernel: one program per row reads the row
    three times (maximum, total, inverse CDF) instead of materialising the probabilities
    and their cumulative sum. ``inv_temperature`` [rows] float32, > 0 (1 for greedy rows);
    ``greedy`` [rows] bool: those rows take the first maximal logit; ``uniform`` [rows] in
    [0, 1). Returns (tokens int64, logprobs float32), logprobs under
    ``log_softmax(logits * inv_temperature)`` as `sampling.sample` gives them."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_kernel()[(rows,)](
        logits, inv_temperature, greedy, uniform, tokens, logprobs, vocab, logits.stride(0),
        BLOCK=SAMPLE_BLOCK,
    )  # fmt: skip
    return tokens, logprobs


SAMPLE_BLOCK = 2048  # vocabulary entries per iteration of the sampler


@functools.cache
def sampler_agrees(device: torch.device) -> bool:
    """Whether `sample_rows` gives `sampling.sample`'s tokens and logprobs on ``device``
    (checked once per process on 64 rows of bf16 logits, greedy and tempered). The engine
    uses the kernel only where it does: a sampler that drew wrong tokens would corrupt
    every rollout without an error."""
    from streamrl.engine.runner.sampling import SamplingTensors, sample

    generator = torch.Generator(device=device).manual_seed(0)
    rows, vocab = 64, 3 * SAMPLE_BLOCK + 5
    logits = (3 * torch.randn(rows, vocab, device=device, generator=generator)).bfloat16()
    temperature = 0.3 + torch.rand(rows, device=device, generator=generator)
    temperature[:4] = 0
    st = SamplingTensors(
        temperature=temperature,
        top_p=torch.ones(rows, device=device),
        top_k=torch.zeros(rows, dtype=torch.int64, device=device),
        min_p=torch.zeros(rows, device=device),
        seeds=torch.arange(rows, device=device),
        counters=torch.full((rows,), 5, device=device),
    )
    want_tokens, want_logprobs = sample(logits, st, use_filters=False)
    try:
        got_tokens, got_logprobs = sample(logits, st, use_filters=False, unfiltered=sample_rows)
    except Exception as error:  # a Triton that cannot build it here: the torch sampler serves
        logger.warning("the Triton sampler failed on %s (%r): using the torch one", device, error)
        return False
    agrees = bool(
        torch.equal(got_tokens, want_tokens)
        and (got_logprobs - want_logprobs).abs().max().item() < 1e-4
    )
    if agrees:
        logger.info("the Triton sampler agrees with the torch sampler on %s: using it", device)
    else:
        logger.warning(
            "the Triton sampler disagrees with the torch sampler on %s: using the torch one",
            device,
        )
    return agrees


def _power_of_two(count: int) -> int:
    return 1 << (count - 1).bit_length()


def available(device: torch.device, head_dim: int | None = None) -> bool:
    """Whether these kernels serve tensors on ``device`` (and `rope_store` ``head_dim``:
    a power of two)."""
    if head_dim is not None and head_dim & (head_dim - 1):
        return False
    return device.type == "cuda" and _silu_mul_kernel() is not None
