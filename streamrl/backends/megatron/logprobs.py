"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the vocabulary `[B, T, V / tp]`.
Nothing gathers the full vocabulary: three all-reduces over the TP group
carry the row maximum (MAX), the sum of exponentials (SUM) and the target's
logit (SUM, only the owning rank contributes); entropy adds one more SUM
(of p * logit). With x = logits / temperature and m = max x:

    log p(y) = (x_y - m) - log S,          S = sum_i exp(x_i - m)
    H        = log S - (sum_i exp(x_i - m) (x_i - m)) / S

The SUM all-reduces are identity in the backward pass: every TP rank computes
the same loss from the same reduced values, so each rank's share of the
gradient flows into its own logits (the output layer's column-parallel
backward then all-reduces the hidden-state gradient).

Alignment (see streamrl.backends.base): position t holds the value for token
t, predicted by the logits at t - 1; position 0 holds 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Forward: SUM all-reduce over `group`. Backward: identity."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum_over(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _AllReduceSum.apply(tensor, group)


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

    logits: [..., V_local] (any float dtype; computed in fp32) for vocabulary ids
    `[vocab_start, vocab_start + V_local)`; targets: [...] global ids.
    Returns tensors of shape [...]; differentiable with respect to `logits`."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    row_max = x.detach().max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = x - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _sum_over(exp.sum(dim=-1), group)

    local = targets - vocab_start
    owned = (local >= 0) & (local < x.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over(torch.where(owned, picked, torch.zeros_like(picked)), group)
    log_sum_exp = sum_exp.log()
    logprobs = target_logit - log_sum_exp

    entropy = None
    if need_entropy:
        weighted = _sum_over((exp * shifted).sum(dim=-1), group)
        entropy = log_sum_exp - weighted / sum_exp
    return logprobs, entropy


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
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(
        logits[:, :-1],
        input_ids[:, 1:],
        vocab_start=vocab_start,
        temperature=temperature,
        group=group,
        need_entropy=need_entropy,
    )
    mask = attention_mask[:, 1:].to(logprobs.dtype)
    zero = logprobs.new_zeros(input_ids.shape[0], 1)
    logprobs = torch.cat([zero, logprobs * mask], dim=1)
    if entropy is not None:
        entropy = torch.cat([zero, entropy * mask], dim=1)
    return logprobs, entropy
