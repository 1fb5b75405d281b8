"""One training step over a batch of groups, for any LearnerBackend.

    samples ─► micro-batches (token budget; packed rows or right-padded ones,
               learner.pack_sequences: `batching`)
            ─► proximal logprobs (weights before this step: decoupled PPO's pi_prox;
               a forward pass of its own only when needed, see `needs_proximal_pass`)
            ─► reference logprobs (only with a KL loss)
            ─► values (only with the critic of `gae`)
            ─► advantages (group-relative, REINFORCE++ or GAE, on response tokens)
            ─► for each mini-batch (learner.global_batch_size samples): forward, loss,
               backward per micro-batch, one optimizer step; then the same for the
               critic's value loss on the same micro-batches, with its own optimizer

The loss per token is the policy loss (`algorithm.loss`: ppo, gspo or cispo, with the
configured off-policy correction), plus kl_loss_coef * KL(pi || pi_ref), minus
entropy_coef * H, aggregated over the mini-batch (token_mean or seq_mean).

GAE: the reward of a sample sits on its last trained token (every other token's reward is
0), so with gamma = lam = 1 each token's return is the sample's reward; the values are the
critic's before the step, which are also V_old of the clipped value loss.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch

from streamrl import algorithms
from streamrl.backends.base import LearnerBackend, MicroBatch
from streamrl.backends.batching import (
    gather_responses,
    make_micro_batches,
    scatter_responses,
    token_counts,
)
from streamrl.config import RunConfig
from streamrl.types import Group, Sample

COUNTS = ("log_ratio_clamped_tokens",)
"""Loss metrics that are counts: summed over the step's mini-batches, not averaged."""


def train_step(
    backend: LearnerBackend, groups: list[Group], cfg: RunConfig, *, pad_id: int
) -> dict[str, float]:
    """Train on `groups` (rollout.batch_size of them); returns the step's metrics."""
    algo = cfg.algorithm
    temperature = cfg.rollout.sampling.temperature
    samples = [sample for group in groups for sample in group.samples]
    group_size = len(groups[0].samples)
    all_indices = list(range(len(samples)))

    def micro_batches_of(indices: list[int], budget: int = cfg.learner.micro_batch_tokens):
        return make_micro_batches(
            samples, indices, token_budget=budget, pad_id=pad_id,
            packed=cfg.learner.pack_sequences,
        )  # fmt: skip

    # The forward-only passes' micro-batches (proximal, reference, values): their own budget.
    step_batches = micro_batches_of(
        all_indices, cfg.learner.logprob_micro_batch_tokens or cfg.learner.micro_batch_tokens
    )
    phases = _Phases()

    proximal_by_sample = None
    if needs_proximal_pass(cfg):
        with phases("proximal"):
            proximal = backend.compute_logprobs(step_batches, temperature=temperature)
            proximal_by_sample = gather_responses(samples, step_batches, proximal)
    reference_by_sample = None
    if algo.kl_loss_coef > 0:
        with phases("reference"):
            reference = backend.compute_logprobs(
                step_batches, temperature=temperature, reference=True
            )
            reference_by_sample = gather_responses(samples, step_batches, reference)
    critic = _critic_of(backend, cfg)
    values_by_sample = None
    if critic is not None:
        with phases("values"):
            values_by_sample = gather_responses(
                samples, step_batches, critic.compute_values(step_batches)
            )

    response_mask = _response_tensor(samples, "loss_mask")
    behaviour_by_sample = _response_tensor(samples, "logprobs")
    metrics = _batch_metrics(samples, response_mask, behaviour_by_sample, proximal_by_sample)
    returns = None
    if values_by_sample is None:
        advantages = _advantages(
            cfg, samples, group_size, response_mask, proximal_by_sample, reference_by_sample
        )
    else:
        advantages, returns = _gae(cfg, samples, response_mask, values_by_sample)
        metrics.update(_critic_metrics(values_by_sample, returns, response_mask))
    if algo.normalize_advantages:
        advantages = algorithms.masked_whiten(advantages, response_mask)

    mini_batches = _split(all_indices, cfg.optimizer_steps_per_step)
    loss_fn = make_loss_fn(cfg)
    value_loss_fn = make_value_loss_fn(cfg) if critic is not None else None
    need_entropy = True
    sums: dict[str, float] = {}
    real_tokens = computed_tokens = 0
    for indices in mini_batches:
        micro_batches = micro_batches_of(indices)
        real, computed = token_counts(micro_batches)
        real_tokens, computed_tokens = real_tokens + real, computed_tokens + computed
        for micro_batch in micro_batches:
            micro_batch.advantages = scatter_responses(samples, micro_batch, advantages)
            if proximal_by_sample is not None:
                micro_batch.proximal_logprobs = scatter_responses(
                    samples, micro_batch, proximal_by_sample
                )
            if reference_by_sample is not None:
                micro_batch.reference_logprobs = scatter_responses(
                    samples, micro_batch, reference_by_sample
                )
            if returns is not None:
                micro_batch.extras["old_values"] = scatter_responses(
                    samples, micro_batch, values_by_sample
                )
                micro_batch.extras["returns"] = scatter_responses(samples, micro_batch, returns)
        with phases("update"):
            result = backend.train_mini_batch(
                micro_batches, loss_fn, temperature=temperature, need_entropy=need_entropy
            )
        if critic is not None:
            with phases("critic_update"):
                critic_result = critic.train_mini_batch(micro_batches, value_loss_fn)
            result.update({f"critic_{k}": v for k, v in critic_result.items()})
        for key, value in result.items():
            sums[key] = sums.get(key, 0.0) + value
    metrics.update(
        {f"train/{k}": v if k in COUNTS else v / len(mini_batches) for k, v in sums.items()}
    )
    if proximal_by_sample is None:  # the mismatch moments came from the training forward
        w_mean, w2_mean = (
            metrics.pop("train/importance_w_mean"),
            metrics.pop("train/importance_w2_mean"),
        )
        metrics["train/importance_ess"] = w_mean**2 / w2_mean if w2_mean > 0 else 0.0
        metrics["train/importance_ratio_std"] = math.sqrt(max(w2_mean - w_mean**2, 0.0))
    metrics["train/optimizer_steps"] = len(mini_batches)
    # The share of the training passes' tokens that are samples' tokens, not padding.
    metrics["train/token_efficiency"] = real_tokens / max(computed_tokens, 1)
    metrics.update(phases.seconds)
    return metrics


class _Phases:
    """Wall seconds of a step's passes, as `train/{phase}_s` (summed over mini-batches).
    Each pass ends by bringing its results to the host (log-probabilities gathered, the loss
    read), so on a GPU the clock covers the kernels too."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"train/{phase}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - started


def needs_proximal_pass(cfg: RunConfig) -> bool:
    """Whether pi_prox needs a forward pass before training.

    pi_prox is the policy before this step. With one optimizer step per step
    every micro-batch's training forward runs on exactly those weights, so its
    detached logprobs are pi_prox (u = 1 in value, the gradient unchanged) and
    the extra pass (a third of the step's compute) is skipped. A separate pass
    is needed with several optimizer steps per step (later mini-batches run on
    updated weights) and for REINFORCE++'s KL term in the advantages, which is
    computed before training."""
    algo = cfg.algorithm
    kl_in_advantages = algo.advantage_estimator == "reinforce_plus_plus" and algo.kl_loss_coef > 0
    return cfg.optimizer_steps_per_step > 1 or kl_in_advantages


def make_loss_fn(cfg: RunConfig):
    """The per-micro-batch loss of `cfg.algorithm` (see the module docstring)."""
    algo = cfg.algorithm
    kl_in_loss = algo.kl_loss_coef > 0 and algo.advantage_estimator != "reinforce_plus_plus"

    def loss_fn(
        micro_batch: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.loss_mask
        per_token, parts = algorithms.policy_loss(
            logprobs,
            micro_batch.proximal_logprobs,
            micro_batch.behaviour_logprobs,
            micro_batch.advantages,
            mask,
            eps_clip=algo.eps_clip,
            eps_clip_high=algo.eps_clip_high,
            dual_clip_c=algo.dual_clip_c,
            correction=algo.off_policy_correction,
            tis_clip=algo.tis_clip,
            behaviour_weight_cap=algo.behaviour_weight_cap,
            loss=algo.loss,
        )

        def reduce(values: torch.Tensor) -> torch.Tensor:
            return algorithms.aggregate(
                values,
                mask,
                algo.loss_aggregation,
                num_tokens=micro_batch.num_tokens_in_mini_batch,
                num_sequences=micro_batch.num_sequences_in_mini_batch,
            )

        metrics = {
            "pg_loss": reduce(per_token).detach(),
            "clip_fraction": reduce(parts["clipped"]).detach(),
            "behaviour_weight": reduce(parts["behaviour_weight"]).detach(),
            "log_ratio_clamped_tokens": _token_sum(parts["log_ratio_clamped"], mask),
        }
        if micro_batch.proximal_logprobs is None:
            metrics.update(_mismatch_moments(micro_batch, logprobs.detach()))
        loss_per_token = per_token
        if kl_in_loss:
            kl = algorithms.kl_penalty(logprobs, micro_batch.reference_logprobs, algo.kl_loss_type)
            loss_per_token = loss_per_token + algo.kl_loss_coef * kl
            metrics["kl"] = reduce(kl).detach()
        if entropy is not None:
            if algo.entropy_coef > 0:
                loss_per_token = loss_per_token - algo.entropy_coef * entropy
            metrics["entropy"] = reduce(entropy).detach()
        loss = reduce(loss_per_token)
        metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn


def make_value_loss_fn(cfg: RunConfig):
    """The critic's per-micro-batch loss: `algorithms.value_loss` against the step's returns,
    clipped around the values before the step (`algorithm.value_clip`), reduced like the
    policy loss."""
    algo = cfg.algorithm

    def value_loss_fn(
        micro_batch: MicroBatch, values: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.loss_mask
        per_token, parts = algorithms.value_loss(
            values,
            micro_batch.extras["old_values"],
            micro_batch.extras["returns"],
            mask,
            clip=algo.value_clip,
        )

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return algorithms.aggregate(
                x,
                mask,
                algo.loss_aggregation,
                num_tokens=micro_batch.num_tokens_in_mini_batch,
                num_sequences=micro_batch.num_sequences_in_mini_batch,
            )

        loss = reduce(per_token)
        return loss, {
            "value_loss": loss.detach(),
            "value_clip_fraction": reduce(parts["value_clipped"]).detach(),
        }

    return value_loss_fn


def _critic_of(backend: LearnerBackend, cfg: RunConfig):
    """The backend's critic when the estimator is `gae` (None otherwise)."""
    if cfg.algorithm.advantage_estimator != "gae":
        return None
    critic = getattr(backend, "critic", None)
    if critic is None:
        raise ValueError(
            "algorithm.advantage_estimator = 'gae' needs a critic, and this learner backend "
            f"({type(backend).__name__}) has none"
        )
    return critic


def _gae(
    cfg: RunConfig, samples: list[Sample], mask: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns [N, R] with each sample's reward on its last trained token."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    token_rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1])
    last = torch.where(mask > 0, positions, -1).amax(dim=1)  # -1: no trained token
    rows = (last >= 0).nonzero().squeeze(1)
    token_rewards[rows, last[rows]] = rewards[rows]
    algo = cfg.algorithm
    return algorithms.gae_advantages(token_rewards, values, mask, gamma=algo.gamma, lam=algo.lam)


def _critic_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor):
    """How well the critic's values before the step predicted the step's returns."""
    on = mask > 0
    return {
        "train/critic_explained_variance": float(
            algorithms.explained_variance(values, returns, mask)
        ),
        "train/critic_value_mean": float(values[on].mean()) if on.any() else 0.0,
        "train/critic_return_mean": float(returns[on].mean()) if on.any() else 0.0,
    }


def _token_sum(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many trained tokens of this micro-batch carry the flag (summed over the step)."""
    return torch.where(mask > 0, flags, 0.0).sum().detach()


def _advantages(
    cfg: RunConfig,
    samples: list[Sample],
    group_size: int,
    mask: torch.Tensor,
    proximal: torch.Tensor | None,
    reference: torch.Tensor | None,
) -> torch.Tensor:
    algo = cfg.algorithm
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    kl = None
    if algo.advantage_estimator == "reinforce_plus_plus" and reference is not None:
        kl = algorithms.kl_penalty(proximal, reference, algo.kl_loss_type)
    return algorithms.token_advantages(
        algo.advantage_estimator,
        rewards,
        group_size,
        mask,
        kl=kl,
        kl_coef=algo.kl_loss_coef if kl is not None else 0.0,
        gamma=algo.gamma,
    )


def _response_tensor(samples: list[Sample], field: str) -> torch.Tensor:
    width = max((len(s.response_ids) for s in samples), default=0)
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        values = getattr(sample, field)
        out[row, : len(values)] = torch.from_numpy(values.astype("float32"))
    return out


def _batch_metrics(
    samples: list[Sample],
    mask: torch.Tensor,
    behaviour: torch.Tensor,
    proximal: torch.Tensor | None,
) -> dict[str, Any]:
    """Engine-vs-learner mismatch and importance-weight health of the batch (without a
    proximal pass these come from the training forward, `_mismatch_moments`; no max then)."""
    on = mask > 0
    metrics = {
        "train/trained_tokens": float(on.sum()),
        "train/response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }
    if proximal is None:
        return metrics
    diff = (proximal - behaviour)[on]
    weights = torch.exp(diff.clamp(-20, 20))
    num = max(int(on.sum()), 1)
    ess = float(weights.sum() ** 2 / (num * (weights**2).sum())) if len(weights) else 1.0
    metrics.update(
        {
            "train/logprob_abs_diff_mean": float(diff.abs().mean()) if len(diff) else 0.0,
            "train/logprob_abs_diff_max": float(diff.abs().max()) if len(diff) else 0.0,
            "train/mismatch_kl": float((-diff).mean()) if len(diff) else 0.0,
            "train/importance_ess": ess if math.isfinite(ess) else 0.0,
            # The spread of pi / mu (engine-learner mismatch; what routing replay narrows).
            "train/importance_ratio_std": float(weights.std(correction=0)) if len(weights) else 0.0,
        }
    )
    return metrics


def _mismatch_moments(micro_batch: MicroBatch, current: torch.Tensor) -> dict[str, torch.Tensor]:
    """This micro-batch's share of the mini-batch's token means of |log pi - log mu|,
    log mu - log pi, w and w^2 (w = pi / mu): the batch metrics, from the training forward."""
    on = micro_batch.loss_mask > 0
    diff = torch.where(on, current - micro_batch.behaviour_logprobs, 0.0)
    weights = torch.where(on, torch.exp(diff.clamp(-20, 20)), 0.0)
    num_tokens = max(micro_batch.num_tokens_in_mini_batch, 1.0)
    return {
        "logprob_abs_diff_mean": diff.abs().sum() / num_tokens,
        "mismatch_kl": -diff.sum() / num_tokens,
        "importance_w_mean": weights.sum() / num_tokens,
        "importance_w2_mean": (weights**2).sum() / num_tokens,
    }


def _split(indices: list[int], num_parts: int) -> list[list[int]]:
    size = len(indices) // num_parts
    return [indices[i * size : (i + 1) * size] for i in range(num_parts)]
