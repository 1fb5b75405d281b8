"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the vocabulary `[B, T, V / tp]`.
Nothing gathers the full vocabulary, and no fp32 copy of the logits is made:
rows are taken a chunk at a time (`CHUNK_BYTES` of fp32 working set), each
rank reduces its slice of every row to four scalars, and two all-reduces over
the TP group combine them: the row maximum (MAX), then the sum of
exponentials, the target's logit (only the owning rank contributes) and, for
entropy, the sum of p * logit (one SUM). With x = logits / temperature and
m = max x:

    log p(y) = (x_y - m) - log S,          S = sum_i exp(x_i - m)
    H        = log S - (sum_i exp(x_i - m) (x_i - m)) / S

The backward pass recomputes each chunk's probabilities from the logits and
the saved per-row scalars (`_LogprobsAndEntropy`); every TP rank computes the
same loss from the same reduced values, so each rank's share of the gradient
flows into its own logits (the output layer's column-parallel backward then
all-reduces the hidden-state gradient).

Alignment (see streamrl.backends.base): position t holds the value for token
t, predicted by the logits at t - 1; position 0 holds 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_BYTES = 256 * 2**20
"""The fp32 working set of one chunk of rows: [rows, V_local] temporaries never exceed it."""


def _chunks(num_rows: int, width: int) -> list[slice]:
    step = max(1, CHUNK_BYTES // (4 * width))
    return [slice(start, start + step) for start in range(0, num_rows, step)]


class _LogprobsAndEntropy(torch.autograd.Function):
    """log p(y) and H per row of [B, T, V_local] logits, a chunk of rows at a time.

    Forward keeps per-row scalars only (the global max m, log S, H); backward recomputes
    each chunk's probabilities from the logits, so no [tokens, vocab] fp32 tensor outlives
    its chunk. With x = logits * scale, log p_i = x_i - m - log S:

        d log p(y) / d x_i = [i = y] - p_i,       d H / d x_i = -p_i (log p_i + H)

    Each TP rank computes its slice's gradient from the reduced scalars (the loss is the
    same on every rank), as an identity-backward all-reduce would."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, scale, group, need_entropy):
        batch, seq, width = logits.shape
        stats = logits.new_zeros((4, batch, seq), dtype=torch.float32)
        local_max, sum_exp, picked, weighted = stats  # weighted: sum_i e^(x_i - m)(x_i - m)
        local = targets - vocab_start
        owned = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1)
        for b in range(batch):
            for rows in _chunks(seq, width):
                x = logits[b, rows].float() * scale
                row_max = x.max(dim=-1).values
                shifted = x.sub_(row_max.unsqueeze(-1))
                local_max[b, rows] = row_max
                picked[b, rows] = shifted.gather(-1, index[b, rows].unsqueeze(-1)).squeeze(-1)
                exp = shifted.exp()
                sum_exp[b, rows] = exp.sum(dim=-1)
                if need_entropy:
                    weighted[b, rows] = (exp * shifted).sum(dim=-1)
        row_max = local_max.clone()
        distributed = group is not None and dist.get_world_size(group) > 1
        if distributed:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # Move each rank's sums from its own maximum to the global one: e^(x - m) =
        # e^(x - m_local) * e^(m_local - m).
        offset = local_max - row_max
        rescale = offset.exp()
        weighted.mul_(rescale).add_(offset * sum_exp * rescale)
        sum_exp.mul_(rescale)
        picked.add_(offset).masked_fill_(~owned, 0.0)
        if distributed:
            dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=group)
        log_sum_exp = sum_exp.log()
        logprobs = picked - log_sum_exp
        entropy = log_sum_exp - weighted / sum_exp if need_entropy else torch.zeros_like(logprobs)
        ctx.save_for_backward(logits, index, owned, row_max + log_sum_exp, entropy)
        ctx.scale, ctx.need_entropy = scale, need_entropy
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, index, owned, log_norm, entropy = ctx.saved_tensors
        batch, seq, width = logits.shape
        use_entropy = ctx.need_entropy and grad_entropy is not None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_norm)
        target_grad = grad_logprobs.masked_fill(~owned, 0.0)
        grad = torch.empty_like(logits)
        for b in range(batch):
            for rows in _chunks(seq, width):
                logp = logits[b, rows].float().mul_(ctx.scale).sub_(log_norm[b, rows, None])
                p = logp.exp()
                g = p * -grad_logprobs[b, rows, None]
                if use_entropy:
                    g -= p * (logp + entropy[b, rows, None]) * grad_entropy[b, rows, None]
                g.scatter_add_(-1, index[b, rows, None], target_grad[b, rows, None])
                grad[b, rows] = g.mul_(ctx.scale)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    need_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy per row, from this rank's vocabulary slice.

    logits: [B, T, V_local] (any float dtype; computed in fp32, a chunk of rows at a time)
    for vocabulary ids `[vocab_start, vocab_start + V_local)`; targets: [B, T] global ids.
    Returns [B, T] tensors, differentiable with respect to `logits`."""
    scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
    logprobs, entropy = _LogprobsAndEntropy.apply(
        logits, targets, vocab_start, scale, group, need_entropy
    )
    return logprobs, entropy if need_entropy else None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    need_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probabilities (and entropy) aligned with `input_ids` from [B, T, V_local] logits.

    Position 0 and padding hold 0."""
    # Row t scores token t + 1 (the last row's target is a placeholder, dropped below), so
    # the logits are used as they are: slicing off the last position would copy them.
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(
        logits,
        targets,
        vocab_start=vocab_start,
        temperature=temperature,
        group=group,
        need_entropy=need_entropy,
    )
    mask = attention_mask[:, 1:].to(logprobs.dtype)
    zero = logprobs.new_zeros(input_ids.shape[0], 1)
    logprobs = torch.cat([zero, logprobs[:, :-1] * mask], dim=1)
    if entropy is not None:
        entropy = torch.cat([zero, entropy[:, :-1] * mask], dim=1)
    return logprobs, entropy
