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

With `compiled` (the backend's `megatron.compile` switch) the forward is one
reduction over the bf16 logits and the backward one pass that reads them and
writes their gradient, where the plain path makes about ten fp32 passes over
each chunk. On CUDA those passes are hand-written Triton kernels
(`logprob_kernels`): torch.compile'd with dynamic shapes they ran at about 1 TB/s
on an H200 (the module says what was measured); the torch.compile'd functions
serve where Triton does not (no Triton, a tensor off CUDA, a device where the
start-up check `logprob_kernels.agrees` fails). All paths compute the same
formulas; they differ by float32 rounding only (the sums run in another order).

Alignment (see streamrl.backends.base): position t holds the value for token
t, predicted by the logits at t - 1; position 0 holds 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from streamrl.backends.megatron import logprob_kernels, speed

CHUNK_BYTES = 256 * 2**20
"""The fp32 working set of one chunk of rows: [rows, V_local] temporaries never exceed it."""


def _chunks(num_rows: int, width: int, *, compiled: bool) -> list[slice]:
    """Row slices of [rows, V_local]. Compiled and Triton kernels keep no [rows, V_local] fp32
    temporary, so they take every row at once."""
    step = num_rows if compiled else max(1, CHUNK_BYTES // (4 * width))
    return [slice(start, start + step) for start in range(0, num_rows, max(step, 1))]


def _scaled_copy(logits, scale: float):
    """logits * scale as a new float32 tensor (also when the logits are float32 already)."""
    x = logits.to(torch.float32, copy=True)
    return x.mul_(scale) if scale != 1.0 else x


def _row_stats(logits, index, scale: float, need_entropy: bool):
    """Per row of [rows, V_local] logits, with x = logits * scale and m = max x: (m,
    x_target - m, sum exp(x - m), sum exp(x - m)(x - m)), all float32 [rows]."""
    x = _scaled_copy(logits, scale)
    row_max = x.amax(dim=-1)
    shifted = x.sub_(row_max.unsqueeze(-1))
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    weighted = (exp * shifted).sum(dim=-1) if need_entropy else torch.zeros_like(sum_exp)
    return row_max, picked, sum_exp, weighted


def _row_grads(logits, index, log_norm, grad_logprobs, target_grad, entropy, grad_entropy, scale):
    """d loss / d logits of [rows, V_local] logits (in their dtype), from the per-row scalars
    (`entropy` and `grad_entropy` None when the entropy feeds no gradient); see
    `_LogprobsAndEntropy`. Compiled, the target's term is a comparison with the column index
    rather than a scatter, so the fused kernel writes each element once."""
    logp = _scaled_copy(logits, scale).sub_(log_norm.unsqueeze(-1))
    p = logp.exp()
    g = p * -grad_logprobs.unsqueeze(-1)
    if grad_entropy is not None:
        g -= p * (logp + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
    if torch.compiler.is_compiling():
        columns = torch.arange(logits.shape[-1], device=logits.device)
        g = torch.where(columns == index.unsqueeze(-1), g + target_grad.unsqueeze(-1), g)
    else:
        g.scatter_add_(-1, index.unsqueeze(-1), target_grad.unsqueeze(-1))
    return g.mul_(scale).to(logits.dtype) if scale != 1.0 else g.to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(compiled: bool, device: torch.device):
    """(row statistics, row gradients) for logits on ``device``: plain torch, or one pass over
    the logits each instead of one fp32 temporary per operation: the Triton kernels on CUDA
    where they agree with these formulas there, torch.compile'd functions elsewhere."""
    if not compiled:
        return _row_stats, _row_grads
    if (
        device.type == "cuda"
        and speed.triton_available()
        and logprob_kernels.agrees(device, _row_stats, _row_grads)
    ):
        return logprob_kernels.row_stats, logprob_kernels.row_grads
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_row_stats, dynamic=True)
        _COMPILED["grads"] = torch.compile(_row_grads, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grads"]


class _LogprobsAndEntropy(torch.autograd.Function):
    """log p(y) and H per row of [B, T, V_local] logits, a chunk of rows at a time.

    Forward keeps per-row scalars only (the global max m, log S, H); backward recomputes
    each chunk's probabilities from the logits, so no [tokens, vocab] fp32 tensor outlives
    its chunk. With x = logits * scale, log p_i = x_i - m - log S:

        d log p(y) / d x_i = [i = y] - p_i,       d H / d x_i = -p_i (log p_i + H)

    Each TP rank computes its slice's gradient from the reduced scalars (the loss is the
    same on every rank), as an identity-backward all-reduce would. Gradients are not
    materialised: an entropy that only feeds metrics (no entropy bonus) costs no backward
    work."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, scale, group, need_entropy, compiled):
        ctx.set_materialize_grads(False)
        batch, seq, width = logits.shape
        row_stats, _ = _kernels(compiled, logits.device)
        rows_of = logits.reshape(batch * seq, width)  # a view: the model's logits are contiguous
        stats = logits.new_zeros((4, batch * seq), dtype=torch.float32)
        local = targets - vocab_start
        owned = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1).reshape(-1)
        for rows in _chunks(batch * seq, width, compiled=compiled):
            chunk = row_stats(rows_of[rows], index[rows], scale, need_entropy)
            for out, value in zip(stats, chunk, strict=True):
                out[rows] = value
        stats = stats.view(4, batch, seq)
        local_max, picked, sum_exp, weighted = stats  # weighted: sum_i e^(x_i - m)(x_i - m)
        row_max = local_max.clone()
        distributed = group is not None and dist.get_world_size(group) > 1
        if distributed:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # Move each rank's sums from its own maximum to the global one: e^(x - m) =
        # e^(x - m_local) * e^(m_local - m). (The sums are over stats' [1:] rows.)
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
        ctx.scale, ctx.need_entropy, ctx.compiled = scale, need_entropy, compiled
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, index, owned, log_norm, entropy = ctx.saved_tensors
        batch, seq, width = logits.shape
        _, row_grads = _kernels(ctx.compiled, logits.device)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_norm)
        if not ctx.need_entropy:
            grad_entropy = None
        target_grad = grad_logprobs.masked_fill(~owned, 0.0).reshape(-1)
        grad_logprobs, log_norm = grad_logprobs.reshape(-1), log_norm.reshape(-1)
        entropy = entropy.reshape(-1)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1)
        rows_of = logits.reshape(batch * seq, width)
        chunks = _chunks(batch * seq, width, compiled=ctx.compiled)
        if len(chunks) == 1:
            grad = row_grads(
                rows_of, index, log_norm, grad_logprobs, target_grad, entropy, grad_entropy,
                ctx.scale,
            )  # fmt: skip
            return grad.view(batch, seq, width), None, None, None, None, None, None
        grad = torch.empty_like(rows_of)
        for rows in chunks:
            grad[rows] = row_grads(
                rows_of[rows], index[rows], log_norm[rows], grad_logprobs[rows],
                target_grad[rows], entropy[rows],
                None if grad_entropy is None else grad_entropy[rows], ctx.scale,
            )  # fmt: skip
        return grad.view(batch, seq, width), None, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    need_entropy: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy per row, from this rank's vocabulary slice.

    logits: [B, T, V_local] (any float dtype; computed in fp32, a chunk of rows at a time)
    for vocabulary ids `[vocab_start, vocab_start + V_local)`; targets: [B, T] global ids.
    Returns [B, T] tensors, differentiable with respect to `logits`. `compiled` runs the
    per-row work as one pass over the logits each way (Triton kernels on CUDA, torch.compile
    elsewhere; all rows at once: nothing [rows, V_local] is kept in fp32); the values agree
    with the plain path to float32 rounding."""
    scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
    logprobs, entropy = _LogprobsAndEntropy.apply(
        logits, targets, vocab_start, scale, group, need_entropy, compiled
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
    compiled: bool = False,
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
        compiled=compiled,
    )
    mask = attention_mask[:, 1:].to(logprobs.dtype)
    zero = logprobs.new_zeros(input_ids.shape[0], 1)
    logprobs = torch.cat([zero, logprobs[:, :-1] * mask], dim=1)
    if entropy is not None:
        entropy = torch.cat([zero, entropy[:, :-1] * mask], dim=1)
    return logprobs, entropy
