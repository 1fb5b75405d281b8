"""Advantage estimators and policy losses: pure functions on torch tensors.

Layout (see `streamrl.backends.base`): per-token tensors are `[B, T]` and
aligned with `input_ids`, position t holding data about token t; `loss_mask`
is 1 on trained (model-produced) tokens; the samples of one group are
consecutive rows. The training loop composes these functions: advantages once
per step (`token_advantages`), then per micro-batch `policy_loss` (plus
`kl_penalty` and entropy) reduced with `aggregate` against the mini-batch
totals. With a critic, `gae_advantages` gives the advantages and value
targets, and `value_loss` is reduced the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators that give one scalar advantage per sample."""
ADVANTAGE_ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_plus_plus")
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

_CHUNK_ELEMENTS = 1 << 24
"""Logit elements (B * positions * V) converted to fp32 at once by the logits helpers (64 MiB)."""


# ---------------------------------------------------------------- helpers


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is nonzero (0 where there are none, never NaN)."""
    is_on = mask > 0
    values = torch.where(is_on, x, 0.0)
    if dim is None:
        return values.sum() / is_on.sum().clamp_min(1)
    return values.sum(dim) / is_on.sum(dim).clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the masked positions, 0 off the mask.

    The std is the population one (divide by the count), so the masked result
    has mean 0 and std 1 exactly up to eps."""
    is_on = mask > 0
    centered = torch.where(is_on, x - masked_mean(x, mask), 0.0)
    std = masked_mean(centered.square(), mask).sqrt()
    return centered / (std + eps)


# ---------------------------------------------------------------- advantages


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


# ---------------------------------------------------------------- losses


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


# ---------------------------------------------------------------- critic


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
    When Var[R] = 0 (constant returns, or no masked token) there is nothing to
    explain and the result is 0, never NaN, so averages of it stay finite.
    """
    is_on = mask > 0
    returns = returns.detach().double()[is_on]
    residuals = returns - values.detach().double()[is_on]
    returns_variance = returns.var(correction=0) if returns.numel() else returns.new_zeros(())
    if returns_variance == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return (1.0 - residuals.var(correction=0) / returns_variance).float()


# ---------------------------------------------------------------- logits


def logprobs_from_logits(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits[:, t-1] / temperature)[input_ids[:, t]] at position t; [B, T] float32.

    Position 0 (no predictor) is 0. Temperature 0 is treated as 1: greedy
    decoding has no tempered distribution, and engines report its logprobs on
    the raw one. Works in fp32 on chunks of positions (logsumexp + gather), so
    no fp32 log-softmax copy of the whole [B, T, V] is made; under autograd the
    fp32 chunks kept for backward add up to one fp32 copy of the logits.
    """
    _check_logits(logits, input_ids)
    pieces = [logits.new_zeros(logits.shape[0], min(logits.shape[1], 1), dtype=torch.float32)]
    for start, end, scaled in _fp32_chunks(logits, temperature):
        targets = input_ids[:, start + 1 : end + 1].unsqueeze(-1)
        picked = scaled.gather(-1, targets).squeeze(-1)
        pieces.append(picked - torch.logsumexp(scaled, dim=-1))
    return torch.cat(pieces, dim=1)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits[:, t-1] / temperature) at position t; [B, T] float32.

    Position 0 is 0; temperature 0 is treated as 1 (as in `logprobs_from_logits`);
    computed in fp32 chunks as H = -sum_v p_v log p_v with log p = z - logsumexp(z)
    (not logsumexp(z) - sum p z, which cancels badly for peaked distributions).
    """
    _check_logits(logits, None)
    pieces = [logits.new_zeros(logits.shape[0], min(logits.shape[1], 1), dtype=torch.float32)]
    for _, _, scaled in _fp32_chunks(logits, temperature):
        log_probs = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
        pieces.append(-(torch.exp(log_probs) * log_probs).sum(-1))
    return torch.cat(pieces, dim=1)


def logprobs_of_rows(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits[i] / temperature)[targets[i]] for flat rows; [N] float32.

    For a learner that ran its output head only on the positions it trains
    (logits [N, V], one row per predicted token). Same temperature rule and
    fp32 chunking as `logprobs_from_logits`."""
    pieces = [
        chunk.gather(-1, targets[start:end, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1)
        for start, end, chunk in _row_chunks(logits, temperature)
    ]
    return torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)


def entropy_of_rows(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits[i] / temperature) for flat rows; [N] float32."""
    pieces = []
    for _, _, chunk in _row_chunks(logits, temperature):
        log_probs = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
        pieces.append(-(torch.exp(log_probs) * log_probs).sum(-1))
    return torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)


def _row_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[int, int, Tensor]]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = temperature or 1.0
    step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for start in range(0, logits.shape[0], step):
        end = min(start + step, logits.shape[0])
        chunk = logits[start:end].float()
        yield start, end, chunk if scale == 1.0 else chunk / scale


def _check_logits(logits: Tensor, input_ids: Tensor | None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if input_ids is not None and tuple(input_ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"input_ids shape {tuple(input_ids.shape)} does not match logits [B, T] = "
            f"{tuple(logits.shape[:2])}"
        )


def _fp32_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, logits[:, start:end] / temperature in fp32) over predictor positions 0..T-2."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = temperature or 1.0  # 0 = greedy: logprobs of the raw distribution
    batch, length, vocab = logits.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * vocab))
    for start in range(0, length - 1, step):
        end = min(start + step, length - 1)
        scaled = logits[:, start:end].float()
        yield start, end, scaled if scale == 1.0 else scaled / scale
