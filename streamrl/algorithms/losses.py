"""Policy losses (PPO, GSPO, CISPO) with the off-policy corrections, the KL penalty, and the
reduction of per-token losses to a mini-batch mean."""

from __future__ import annotations

import torch
from torch import Tensor

from streamrl.algorithms.masks import masked_mean

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
CORRECTIONS = ("decoupled_ppo", "tis", "none")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token_mean", "seq_mean")

LOG_RATIO_BOUND = 20.0
"""Bound on |log(pi / pi_prox)| and |log(pi_prox / pi_behav)| in `policy_loss`, applied before exp.

exp(20) ~ 4.85e8 is finite in fp32 (exp overflows past ~88.7), and so is the
product of both ratios with an advantage (exp(40) ~ 2.4e17); a token that far
off-policy carries no usable signal anyway. verl clamps its log-ratio to the
same +-20 before exp. Ordinary ratios (|log u| of a few units at most) are unchanged."""


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs.

    Estimators from Schulman, "Approximating KL Divergence" (2020), with
    x = log pi_ref - log pi: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - x - 1.
    `low_var_kl` is k3 clamped to [-10, 10] (verl's name); x is first clamped
    to [-20, 20], which changes no value (k3 is past 10 there) but keeps
    exp from overflowing into NaN gradients.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        x = -log_ratio
        if kind == "low_var_kl":
            x = x.clamp(-20.0, 20.0)
        kl = torch.exp(x) - x - 1.0
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown kl kind {kind!r}; expected one of {', '.join(KL_KINDS)}")


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float = 0.0,
    dual_clip_c: float = 0.0,
    correction: str = "decoupled_ppo",
    tis_clip: float = 2.0,
    behaviour_weight_cap: float = 0.0,
    loss: str = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy-gradient loss [B, T] to minimise (0 off the mask), and metrics.

    With r = pi_theta / pi_prox per token and high = eps_clip_high or eps_clip
    (DAPO's clip-higher, arXiv 2503.14476), `loss` picks the objective:

    - `ppo`: obj = min(u A, clip(u, 1 - eps_clip, 1 + high) A), u = r (PPO, arXiv 1707.06347).
    - `gspo`: the same obj with u = s_i,t = sg[s_i] * pi_t / sg[pi_t], where
      s_i = exp(mean of log r over the trained tokens of row i) (GSPO, arXiv
      2507.18071, Eq. 7, and its GSPO-token form). Each row is one sequence:
      u equals s_i on all its tokens, so the clip binds per sequence, and the
      gradient of the row's token mean (`aggregate` seq_mean) is GSPO's
      sequence-level one when A is constant over the row (token_mean weighs
      long rows more). eps_clip and eps_clip_high are used as given, and GSPO's
      are far smaller than PPO's (the paper: 3e-4 and 4e-4). A row without
      trained tokens has s_i = 1 and loss 0.
    - `cispo`: obj = sg[clip(r, 1 - eps_clip, 1 + high)] * A * log pi_theta
      (CISPO, MiniMax-M1, arXiv 2506.13585): the importance weight is clipped
      and detached, so no token loses its gradient. MiniMax set no lower bound
      in practice and tuned only the upper one: eps_clip >= 1 does that here.
      The loss value contains log pi, so it is not comparable with ppo's.

    With dual_clip_c = c > 1 (ppo and gspo), obj >= c A for A < 0 (dual-clip
    PPO, arXiv 1912.09729). The loss is -w * obj where w corrects for the
    behaviour policy that sampled the tokens:
    `decoupled_ppo` w = pi_prox / pi_behav (AReaL, arXiv 2505.24298, Eq. 5),
    capped at `behaviour_weight_cap` when that is > 0; `tis` w =
    min(pi_prox / pi_behav, tis_clip) (truncated importance sampling, Ionides
    2008; as slime's --tis-clip); `none` w = 1. Only `logprobs` carries a
    gradient; `proximal_logprobs=None` means pi_prox = pi_theta detached (r = 1).

    Both log-ratios, log r and log(pi_prox / pi_behav), are clamped to
    [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before exp, so a stale token or a
    -inf / -1e9 sentinel logprob gives a large but finite loss and gradient.
    Under `ppo` a token whose log r was clamped gets no gradient (as a clipped one).

    Metrics, each [B, T] and 0 off the mask: `clipped` 1 where a clip binds
    (ppo, gspo: the token gives no gradient; cispo: its weight was truncated),
    `ratio` u (gspo: s_i; cispo: r before clipping), `behaviour_weight` w,
    `log_ratio_clamped` 1 where a log-ratio that enters the loss (log r, and
    log(pi_prox / pi_behav) unless correction is `none`) was clamped.
    """
    _check_policy_loss_options(loss, correction, dual_clip_c)
    is_trained = loss_mask > 0
    proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.detach()
    advantages = advantages.detach()
    log_ratio, is_ratio_clamped = _bounded_log_ratio(logprobs - proximal, is_trained)
    high = eps_clip_high or eps_clip
    current = torch.where(is_trained, logprobs, 0.0)  # padding may hold -inf
    if loss == "cispo":
        ratio = torch.exp(log_ratio.detach())
        is_weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
        objective = is_weight * advantages * current
        is_clipped = is_weight != ratio
    else:
        if loss == "gspo":
            sequence_ratio = torch.exp(masked_mean(log_ratio.detach(), loss_mask, dim=1))
            ratio = sequence_ratio[:, None] * torch.exp(current - current.detach())
        else:
            ratio = torch.exp(log_ratio)
        objective, is_clipped = _clipped_objective(
            ratio, advantages, low=1.0 - eps_clip, high=1.0 + high, dual_clip_c=dual_clip_c
        )
    weight, is_weight_clamped = _behaviour_weight(
        proximal,
        behaviour_logprobs.detach(),
        is_trained,
        correction,
        tis_clip,
        behaviour_weight_cap,
    )
    per_token = torch.where(is_trained, -weight * objective, 0.0)
    metrics = {
        "clipped": (is_clipped & is_trained).float(),
        "ratio": torch.where(is_trained, ratio.detach(), 0.0),
        "behaviour_weight": torch.where(is_trained, weight, 0.0),
        "log_ratio_clamped": (is_ratio_clamped | is_weight_clamped).float(),
    }
    return per_token, metrics


def _check_policy_loss_options(loss: str, correction: str, dual_clip_c: float) -> None:
    if loss not in POLICY_LOSSES:
        raise ValueError(
            f"unknown policy loss {loss!r}; expected one of {', '.join(POLICY_LOSSES)}"
        )
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {correction!r}; expected one of {', '.join(CORRECTIONS)}"
        )
    if dual_clip_c != 0.0 and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be 0 (off) or > 1, got {dual_clip_c}")
    if dual_clip_c and loss == "cispo":
        raise ValueError("dual_clip_c applies to the ppo and gspo losses; cispo has no min to clip")


def _clipped_objective(
    ratio: Tensor, advantages: Tensor, *, low: float, high: float, dual_clip_c: float
) -> tuple[Tensor, Tensor]:
    """min(u A, clip(u, low, high) A), raised to c A for A < 0 under dual clip; and where a clip binds."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(low, high) * advantages
    objective = torch.minimum(unclipped, clipped)
    is_clipped = clipped < unclipped
    if dual_clip_c > 1.0:
        floor = dual_clip_c * advantages
        is_dual = (advantages < 0) & (objective < floor)
        objective = torch.where(is_dual, floor, objective)
        is_clipped = is_clipped | is_dual
    return objective, is_clipped


def _behaviour_weight(
    proximal: Tensor,
    behaviour: Tensor,
    is_trained: Tensor,
    correction: str,
    tis_clip: float,
    cap: float,
) -> tuple[Tensor, Tensor]:
    """The off-policy weight w of `policy_loss` (detached), and where its log-ratio was clamped."""
    if correction == "none":
        return torch.ones_like(proximal), torch.zeros_like(is_trained)
    log_weight, is_clamped = _bounded_log_ratio(proximal - behaviour, is_trained)
    weight = torch.exp(log_weight)
    if correction == "tis":
        weight = weight.clamp(max=tis_clip)
    elif cap > 0:
        weight = weight.clamp(max=cap)
    return weight, is_clamped


def _bounded_log_ratio(log_ratio: Tensor, is_trained: Tensor) -> tuple[Tensor, Tensor]:
    """log_ratio clamped to +-LOG_RATIO_BOUND on trained tokens and 0 off them, and where it was clamped.

    Off the mask the value is forced to 0 so padding can never overflow into NaN;
    a NaN log-ratio (-inf minus -inf) stays NaN and is not reported as clamped."""
    log_ratio = torch.where(is_trained, log_ratio, 0.0)
    is_clamped = log_ratio.abs() > LOG_RATIO_BOUND
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), is_clamped


def aggregate(
    per_token: Tensor, loss_mask: Tensor, mode: str, *, num_tokens: float, num_sequences: int
) -> Tensor:
    """Reduce a per-token quantity of one micro-batch to a scalar share of the mini-batch mean.

    `token_mean`: sum of masked values / num_tokens. `seq_mean`: sum over rows of
    the row's masked mean (0 for a row without trained tokens) / num_sequences.
    The totals are the whole mini-batch's, so the sum over its micro-batches is
    the mini-batch mean. Totals below 1 count as 1 (an empty batch gives 0, not NaN).
    """
    masked = torch.where(loss_mask > 0, per_token, 0.0)
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1.0)
    if mode == "seq_mean":
        return masked_mean(per_token, loss_mask, dim=1).sum() / max(num_sequences, 1)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}"
    )
