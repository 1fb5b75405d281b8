"""Token sampling and logprobs, vectorised per row, on the logits' device.

Logprob convention (what the learner must recompute): the sampled token's
log-probability under ``log_softmax(logits / temperature)``, before top-k,
top-p or min-p filtering; for greedy rows (temperature 0) under
``log_softmax(logits)``. Always float32.

Sampling is by inverse CDF with ONE uniform number per row, drawn from a
counter-based hash of (row seed, number of tokens before the sampled one). So a
request's draws depend only on its seed and position: not on the batch it runs
in, on retraction, or on the device. The float32 CDF resolves probabilities
down to about 6e-8 (24-bit uniforms).

Everything here is graph-capturable: fixed shapes, no host syncs, no
data-dependent branches (``use_filters`` is a Python flag fixed per graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31 so that (x < 2**32) * C never overflows int64.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
_GOLDEN = 0x1E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def uniform_from_seed(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A float32 in [0, 1) per row, a pure function of (seed, counter); int64 inputs."""
    key = _mix32(_mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    bits = _mix32(key ^ ((counters * _GOLDEN) & _MASK32))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device ([rows] each)."""

    temperature: torch.Tensor  # float32; <= 0 means greedy
    top_p: torch.Tensor  # float32; 1 means off
    top_k: torch.Tensor  # int64; <= 0 means off
    min_p: torch.Tensor  # float32; 0 means off
    seeds: torch.Tensor  # int64
    counters: torch.Tensor  # int64: tokens in the sequence before the sampled one

    @staticmethod
    def needs_filters(params_list) -> bool:
        """True when some row needs the filtered path (top-p / top-k sort, min-p)."""
        return any(p.top_p < 1.0 or p.top_k > 0 or p.min_p > 0.0 for p in params_list)


def tempered_softmax(logits: torch.Tensor, inv_temperature: torch.Tensor):
    """``(log_normaliser [rows, 1], probs)`` of float32 ``logits * inv_temperature`` per row."""
    scaled = logits.float() * inv_temperature[:, None]
    log_normaliser = torch.logsumexp(scaled, dim=-1, keepdim=True)
    return log_normaliser, torch.exp(scaled - log_normaliser)


def sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    *,
    use_filters: bool,
    softmax=tempered_softmax,
    uniform=uniform_from_seed,
    unfiltered=None,
):
    """Sample one token per row of ``logits`` [rows, vocab]; returns (tokens int64, logprobs f32).

    ``use_filters=False`` ignores top_p/top_k/min_p (callers pass True when any row sets them)
    and saves the passes over the vocabulary they cost. ``softmax`` and ``uniform`` may be
    compiled `tempered_softmax` and `uniform_from_seed` (one fused kernel each);
    ``unfiltered`` a kernel that does the whole unfiltered path
    (`triton_ops.sample_rows`)."""
    greedy = st.temperature <= 0
    inv_temperature = torch.where(greedy, 1.0, 1.0 / st.temperature.clamp_min(1e-6))
    draws = uniform(st.seeds, st.counters)
    if unfiltered is not None and not use_filters:
        return unfiltered(logits, inv_temperature, greedy, draws)
    log_normaliser, probs = softmax(logits, inv_temperature)
    if use_filters:
        # min-p keeps tokens with p >= min_p * max p (a zero threshold keeps all).
        threshold = probs.amax(dim=-1, keepdim=True) * st.min_p[:, None]
        probs = torch.where(probs < threshold, 0.0, probs)
        tokens = _sample_sorted(probs, st, draws)
    else:
        tokens = _sample_from_cdf(probs, draws)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    # The sampled token's scaled logit, computed as `tempered_softmax` computes every one.
    scaled = logits.gather(1, tokens[:, None]).float() * inv_temperature[:, None]
    return tokens, (scaled - log_normaliser).squeeze(1)


def _sample_from_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]: never a zero-probability token."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    index = torch.searchsorted(cdf, target, right=True)
    return index.squeeze(1).clamp_max(probs.shape[-1] - 1)


def _sample_sorted(probs: torch.Tensor, st: SamplingTensors, uniform: torch.Tensor):
    """Top-k then top-p (nucleus) over probabilities sorted descending."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_k = torch.where(st.top_k > 0, st.top_k, probs.shape[-1])
    keep = rank[None, :] < top_k[:, None]
    # Nucleus: keep a token while the mass strictly before it is below top_p
    # (the most likely token is always kept).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < st.top_p[:, None]
    position = _sample_from_cdf(sorted_probs * keep, uniform)
    return order.gather(1, position[:, None]).squeeze(1)


def make_sampling_tensors(params_list, seeds, counters, device) -> SamplingTensors:
    """Build per-row tensors from host values (used by eager paths)."""

    def floats(values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    def ints(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return SamplingTensors(
        temperature=floats([p.temperature for p in params_list]),
        top_p=floats([p.top_p for p in params_list]),
        top_k=ints([p.top_k for p in params_list]),
        min_p=floats([p.min_p for p in params_list]),
        seeds=ints(seeds),
        counters=ints(counters),
    )
