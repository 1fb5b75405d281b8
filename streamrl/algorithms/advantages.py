"""Advantage estimators without a critic: group-relative (GRPO, Dr. GRPO, RLOO) and
REINFORCE++ returns."""

from __future__ import annotations

import torch
from torch import Tensor

from streamrl.algorithms.masks import masked_whiten

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators that give one scalar advantage per sample."""
ADVANTAGE_ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_plus_plus")


def group_advantages(
    rewards: Tensor, group_size: int, estimator: str, *, eps: float = 1e-6
) -> Tensor:
    """One scalar advantage per sample, from the rewards of its group. [N] -> [N] float32.

    - `grpo`: (r - group mean) / (group std + eps) (DeepSeekMath, arXiv 2402.03300,
      section 4.1.2). The std is the unbiased one (divide by n - 1), as torch.std
      computes it in slime, verl and TRL, so advantages and tuned learning rates
      carry over from them; a group of one sample has std 0 and advantage 0.
    - `dr_grpo`: r - group mean (Dr. GRPO, arXiv 2503.20783: no std division).
    - `rloo`: r_i - mean of the other n - 1 rewards of the group (RLOO,
      arXiv 2402.14740); 0 when the group has one sample.
    - `reinforce_plus_plus_baseline`: r - group mean; `token_advantages` then
      whitens it over the batch (REINFORCE++, arXiv 2501.03262).
    """
    if estimator not in GROUP_ESTIMATORS:
        token_level = estimator in ADVANTAGE_ESTIMATORS
        hint = " (it is token-level: use token_advantages)" if token_level else ""
        raise ValueError(
            f"unknown group advantage estimator {estimator!r}{hint}; "
            f"expected one of {', '.join(GROUP_ESTIMATORS)}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of group_size = {group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = (centered.square().sum(dim=1, keepdim=True) / max(group_size - 1, 1)).sqrt()
        advantages = centered / (std + eps)
    elif estimator == "rloo":
        if group_size == 1:
            advantages = torch.zeros_like(grouped)
        else:
            others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
            advantages = grouped - others_mean
    else:
        advantages = centered
    return advantages.view(-1)


def token_advantages(
    estimator: str,
    rewards: Tensor,
    group_size: int,
    loss_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages [N, T] float32, 0 off `loss_mask`.

    Group estimators broadcast `group_advantages` over each row's masked tokens;
    `reinforce_plus_plus_baseline` then whitens them over every masked token of
    the batch. `reinforce_plus_plus` (arXiv 2501.03262) gives each masked token
    the reward -kl_coef * kl[t], adds the sample's reward on its last masked
    token, takes discounted returns G_t = sum_{k >= t} gamma^(j(k) - j(t)) r_k
    over masked k, where j counts masked tokens (so unmasked holes such as tool
    output neither earn a discount step nor break the chain), and whitens them
    over the batch. `kl`/`kl_coef`/`gamma` are used by `reinforce_plus_plus` only.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; "
            f"expected one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if loss_mask.dim() != 2 or loss_mask.shape[0] != rewards.numel():
        raise ValueError(
            f"loss_mask must be [N, T] with N = {rewards.numel()} rewards, "
            f"got shape {tuple(loss_mask.shape)}"
        )
    mask = (loss_mask > 0).float()
    if estimator == "reinforce_plus_plus":
        if kl_coef and kl is None:
            raise ValueError("reinforce_plus_plus with kl_coef > 0 needs the per-token kl")
        token_rewards = torch.zeros_like(mask)
        if kl is not None:
            token_rewards = torch.where(mask > 0, -kl_coef * kl.float(), 0.0)
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask > 0, positions, -1).amax(dim=1)  # -1: no trained token
        rows = (last >= 0).nonzero().squeeze(1)
        token_rewards[rows, last[rows]] += rewards.float().to(mask.device)[rows]
        return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask, eps)
    advantages = group_advantages(rewards, group_size, estimator, eps=eps).to(mask.device)
    advantages = advantages[:, None] * mask
    if estimator == "reinforce_plus_plus_baseline":
        return masked_whiten(advantages, mask, eps)
    return advantages


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_(next masked token), on masked tokens; 0 elsewhere."""
    if gamma == 1.0:  # a reverse cumulative sum; holes add 0 and cost no discount
        return torch.flip(torch.cumsum(torch.flip(token_rewards * mask, [1]), 1), [1]) * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        is_on = mask[:, t] > 0
        running = torch.where(is_on, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(is_on, running, 0.0)
    return returns
