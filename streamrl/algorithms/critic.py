"""The critic's side of PPO: GAE advantages and returns, the clipped value loss, and the
explained variance of the value model."""

from __future__ import annotations

import torch
from torch import Tensor

RETURNS_VARIANCE_TOLERANCE = 1e-10
"""Below this share of mean(R^2), Var[R] is rounding (see `explained_variance`)."""


def gae_advantages(
    rewards_per_token: Tensor, values: Tensor, loss_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and value targets over trained tokens; two [N, T] float32.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next
    (GAE, Schulman et al., arXiv 1506.02438), where "next" is the row's next
    trained token: positions off `loss_mask` (prompt, tool output, padding) are
    skipped, earning no discount step and not breaking the chain (as the
    REINFORCE++ returns of `token_advantages`), and their rewards and values are
    ignored. After a row's last trained token V_next = 0 and A_next = 0 (the
    sample ends there). Returns R_t = A_t + V_t, the lambda-returns a critic
    regresses on (gamma = lam = 1: R_t = sum of the remaining rewards). Both are
    0 off the mask and carry no gradient.
    """
    if rewards_per_token.dim() != 2 or values.shape != rewards_per_token.shape:
        raise ValueError(
            f"rewards_per_token and values must both be [N, T], got shapes "
            f"{tuple(rewards_per_token.shape)} and {tuple(values.shape)}"
        )
    if loss_mask.shape != rewards_per_token.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} does not match the rewards' "
            f"{tuple(rewards_per_token.shape)}"
        )
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    is_trained = loss_mask > 0
    rewards = rewards_per_token.detach().float()
    values = values.detach().float()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        is_on = is_trained[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(is_on, values[:, t], next_value)
        next_advantage = torch.where(is_on, advantage, next_advantage)
        advantages[:, t] = torch.where(is_on, advantage, 0.0)
    returns = torch.where(is_trained, advantages + values, 0.0)
    return advantages, returns


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *, clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss per token [B, T] to minimise (0 off the mask), and metrics.

    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) with c = `clip`,
    the value clipping of PPO's reference implementation (OpenAI baselines'
    ppo2; studied in Engstrom et al., arXiv 2005.12729); clip = 0 turns it off:
    0.5 * (V - R)^2. Only `values` carries a gradient.

    Metrics, [B, T] and 0 off the mask: `value_clipped` 1 where the clipped
    term is the larger (V left the band around V_old: the token gives no gradient).
    """
    if clip < 0:
        raise ValueError(f"value clip must be >= 0 (0 turns clipping off), got {clip}")
    is_trained = loss_mask > 0
    returns = returns.detach()
    unclipped = (values - returns).square()
    if clip > 0:
        old_values = old_values.detach()
        clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
        clipped = (clipped_values - returns).square()
        squared_error = torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
    else:
        squared_error = unclipped
        is_clipped = torch.zeros_like(is_trained)
    per_token = torch.where(is_trained, 0.5 * squared_error, 0.0)
    return per_token, {"value_clipped": (is_clipped & is_trained).float()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over the masked tokens; a float32 scalar, no gradient.

    1 for a perfect critic, 0 for one that predicts the mean return, negative
    for one worse than that. Variances are population ones, taken in float64.
    When the returns do not vary (no masked token, or Var[R] <= 1e-10 * mean(R^2):
    constant returns up to the float32 rounding of GAE's sums, such as a batch whose
    rewards are all 1) there is nothing to explain and the result is 0, never NaN or a
    huge negative number, so averages of it stay meaningful.
    """
    is_on = mask > 0
    returns = returns.detach().double()[is_on]
    residuals = returns - values.detach().double()[is_on]
    if not returns.numel():
        return torch.zeros((), dtype=torch.float32, device=values.device)
    returns_variance = returns.var(correction=0)
    if returns_variance <= RETURNS_VARIANCE_TOLERANCE * returns.square().mean():
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return (1.0 - residuals.var(correction=0) / returns_variance).float()
