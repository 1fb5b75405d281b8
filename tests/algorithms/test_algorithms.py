"""Advantage estimators, policy losses and logits helpers against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl import algorithms
from streamrl.algorithms import (
    aggregate,
    entropy_from_logits,
    entropy_of_rows,
    explained_variance,
    gae_advantages,
    group_advantages,
    kl_penalty,
    logprobs_from_logits,
    logprobs_of_rows,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_advantages,
    value_loss,
)


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.detach().float(), expected, atol=atol, rtol=1e-6)


# ---------------------------------------------------------------- group advantages


def test_grpo_divides_by_the_unbiased_group_std():
    # Group [1, 0, 1, 0]: mean 0.5, deviations +-0.5, unbiased var 4 * 0.25 / 3 = 1/3,
    # std 0.577350, advantage +-0.5 / 0.577350 = +-0.866025 (population std would give +-1).
    # Group [2, 2, 2, 2]: all deviations 0, so 0 / (0 + eps) = 0.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    advantages = group_advantages(rewards, 4, "grpo")
    close(advantages, [0.866025, -0.866025, 0.866025, -0.866025, 0, 0, 0, 0], atol=1e-5)


def test_grpo_gives_zero_for_groups_of_one_sample():
    close(group_advantages(torch.tensor([3.0, -1.0]), 1, "grpo"), [0.0, 0.0])


def test_dr_grpo_subtracts_the_group_mean_without_dividing():
    # [1, 0, 0]: mean 1/3 -> 2/3, -1/3, -1/3.  [3, 1, 2]: mean 2 -> 1, -1, 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    close(group_advantages(rewards, 3, "dr_grpo"), [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # [1, 0, 0]: 1 - (0+0)/2 = 1;  0 - (1+0)/2 = -0.5 (twice).
    # [3, 1, 2]: 3 - (1+2)/2 = 1.5;  1 - (3+2)/2 = -1.5;  2 - (3+1)/2 = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    close(group_advantages(rewards, 3, "rloo"), [1.0, -0.5, -0.5, 1.5, -1.5, 0.0])


def test_rloo_gives_zero_for_groups_of_one_sample():
    close(group_advantages(torch.tensor([5.0, 1.0]), 1, "rloo"), [0.0, 0.0])


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    close(group_advantages(rewards, 2, "reinforce_plus_plus_baseline"), [0.5, -0.5, 0.0, 0.0])


def test_group_advantages_reject_unknown_estimators_and_uneven_groups():
    with pytest.raises(ValueError, match="unknown group advantage estimator 'ppo'"):
        group_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match="token-level"):
        group_advantages(torch.zeros(4), 2, "reinforce_plus_plus")
    with pytest.raises(ValueError, match="5 rewards cannot be split into groups of group_size = 2"):
        group_advantages(torch.zeros(5), 2, "grpo")


# ---------------------------------------------------------------- token advantages


def test_group_estimators_broadcast_the_sample_advantage_over_masked_tokens():
    rewards = torch.tensor([1.0, 0.0, 0.0])  # rloo, n = 3 -> [1, -0.5, -0.5]
    mask = t([0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 1, 0])
    advantages = token_advantages("rloo", rewards, 3, mask)
    close(advantages, [[0, 1, 1, 0], [0, 0, -0.5, -0.5], [-0.5, 0, -0.5, 0]])


def test_reinforce_plus_plus_discounts_over_model_tokens_across_holes_then_whitens():
    # Row 0: prompt, 2 model tokens, a tool-output hole, 1 model token, padding; reward 1.
    # Row 1: 3 prompt tokens, 2 model tokens, padding; reward 0.  kl_coef 0.5, gamma 0.5.
    mask = t([0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0])
    kl = t([5, 0.2, 0.4, 9, 0.2, 9], [5, 5, 5, 0.0, 0.2, 9])
    # Token rewards -0.5 * kl on masked tokens, + reward on the last one:
    #   row 0: t1 -0.1, t2 -0.2, t4 -0.1 + 1 = 0.9;  row 1: t3 0, t4 -0.1.
    # Returns (the hole costs no discount step):
    #   row 0: G4 = 0.9, G2 = -0.2 + 0.5 * 0.9 = 0.25, G1 = -0.1 + 0.5 * 0.25 = 0.025
    #   row 1: G4 = -0.1, G3 = 0 + 0.5 * -0.1 = -0.05
    # Whitening over the 5 masked returns: mean 1.025 / 5 = 0.205; deviations -0.18, 0.045,
    # 0.695, -0.255, -0.305; population var 0.6755 / 5 = 0.1351, std 0.3675595.
    advantages = token_advantages(
        "reinforce_plus_plus",
        torch.tensor([1.0, 0.0]),
        1,
        mask,
        kl=kl,
        kl_coef=0.5,
        gamma=0.5,
        eps=0.0,
    )
    close(
        advantages,
        [[0, -0.489717, 0.122429, 0, 1.890850, 0], [0, 0, 0, -0.693765, -0.829798, 0]],
        atol=1e-5,
    )


def test_reinforce_plus_plus_with_gamma_one_sums_the_remaining_rewards():
    # Same rows as above with gamma 1: row 0 returns 0.6, 0.7, 0.9; row 1 -0.1, -0.1.
    # Mean 2.0 / 5 = 0.4; deviations 0.2, 0.3, 0.5, -0.5, -0.5; var 0.88 / 5 = 0.176,
    # std 0.4195235.
    mask = t([0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0])
    kl = t([5, 0.2, 0.4, 9, 0.2, 9], [5, 5, 5, 0.0, 0.2, 9])
    advantages = token_advantages(
        "reinforce_plus_plus", torch.tensor([1.0, 0.0]), 1, mask, kl=kl, kl_coef=0.5, eps=0.0
    )
    close(
        advantages,
        [[0, 0.476731, 0.715097, 0, 1.191828, 0], [0, 0, 0, -1.191828, -1.191828, 0]],
        atol=1e-5,
    )


def test_reinforce_plus_plus_ignores_rows_without_trained_tokens():
    # Row 1 has no model token: its reward 7 goes nowhere. Row 0 returns 1, 1 (gamma 1, no kl)
    # and row 2 returns 0: mean 2/3, deviations 1/3, 1/3, -2/3, var (1/9+1/9+4/9)/3 = 2/9,
    # std 0.4714045 -> 0.707107, 0.707107, -1.414214.
    mask = t([1, 1, 0], [0, 0, 0], [0, 0, 1])
    advantages = token_advantages("reinforce_plus_plus", t(1, 7, 0), 1, mask, eps=0.0)
    close(advantages, [[0.707107, 0.707107, 0], [0, 0, 0], [0, 0, -1.414214]], atol=1e-5)


def test_reinforce_plus_plus_baseline_whitens_the_broadcast_advantages_over_the_batch():
    # Group advantages [0.5, -0.5, 0, 0] over 2, 2, 1, 1 tokens: values 0.5, 0.5, -0.5, -0.5,
    # 0, 0; mean 0, population var 1/6, std 0.4082483 -> +-1.224745 and 0.
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = t([0, 1, 1], [0, 1, 1], [1, 0, 0], [0, 0, 1])
    advantages = token_advantages("reinforce_plus_plus_baseline", rewards, 2, mask, eps=0.0)
    close(advantages, [[0, 1.224745, 1.224745], [0, -1.224745, -1.224745], [0, 0, 0], [0, 0, 0]])


def test_token_advantages_reject_bad_inputs():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        token_advantages("gae", torch.zeros(2), 2, mask)
    with pytest.raises(ValueError, match="N = 3 rewards"):
        token_advantages("grpo", torch.zeros(3), 3, mask)
    with pytest.raises(ValueError, match="needs the per-token kl"):
        token_advantages("reinforce_plus_plus", torch.zeros(2), 2, mask, kl_coef=0.1)


def test_masked_helpers_ignore_values_off_the_mask():
    x = t(1.0, 3.0, float("inf"))
    mask = t(1, 1, 0)
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, torch.zeros(3)), 0.0)
    close(masked_whiten(x, mask, eps=0.0), [-1.0, 1.0, 0.0])  # mean 2, std 1


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds_match_their_formulas():
    # log p - log ref = [0.5, -1]; x = log ref - log p = [-0.5, 1].
    logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    close(kl_penalty(logp, ref, "k1"), [0.5, -1.0])
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.5])  # 0.5 * 0.25, 0.5 * 1
    # exp(-0.5) + 0.5 - 1 = 0.1065307;  e - 1 - 1 = 0.7182818
    close(kl_penalty(logp, ref, "k3"), [0.1065307, 0.7182818])
    close(kl_penalty(logp, ref, "low_var_kl"), [0.1065307, 0.7182818])


def test_low_var_kl_is_clamped_to_ten_with_finite_gradients():
    # x = 30: e^30 - 31 ~ 1.07e13;  x = -30: e^-30 + 29 ~ 29;  x = 200 overflows exp in fp32.
    logp = t(-30.0, 0.0, -200.0).requires_grad_()
    ref = t(0.0, -30.0, 0.0)
    assert kl_penalty(logp.detach(), ref, "k3")[0] > 1e13
    kl = kl_penalty(logp, ref, "low_var_kl")
    close(kl, [10.0, 10.0, 10.0])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_penalty_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="unknown kl kind 'k4'"):
        kl_penalty(t(0.0), t(0.0), "k4")


# ---------------------------------------------------------------- policy loss


def test_uncorrected_loss_without_proximal_has_gradient_minus_advantage_on_masked_tokens():
    logprobs = t([-1.0, -2.0, -0.5]).requires_grad_()
    advantages, mask = t([2.0, -1.0, 0.5]), t([1, 1, 0])
    loss, _ = policy_loss(
        logprobs, None, torch.zeros(1, 3), advantages, mask, eps_clip=0.2, correction="none"
    )
    close(loss, [[-2.0, 1.0, 0.0]])  # u = 1, loss = -A
    loss.sum().backward()
    close(logprobs.grad, [[-2.0, 1.0, 0.0]])


def test_clipped_tokens_give_no_gradient():
    # u = [1.5, 0.5, 1.5, 0.5], A = [1, 1, -1, -1], clip to [0.8, 1.2]:
    #   min(1.5, 1.2) = 1.2 (clipped);  min(0.5, 0.8) = 0.5;
    #   min(-1.5, -1.2) = -1.5;  min(-0.5, -0.8) = -0.8 (clipped).
    # d(-u A)/d log pi = -u A where not clipped: -0.5 and 1.5.
    logprobs = torch.log(t([1.5, 0.5, 1.5, 0.5])).requires_grad_()
    zeros = torch.zeros(1, 4)
    loss, metrics = policy_loss(
        logprobs, zeros, zeros, t([1.0, 1.0, -1.0, -1.0]), torch.ones(1, 4), eps_clip=0.2
    )
    close(loss, [[-1.2, -0.5, 1.5, 0.8]])
    close(metrics["clipped"], [[1.0, 0.0, 0.0, 1.0]])
    close(metrics["ratio"], [[1.5, 0.5, 1.5, 0.5]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, -0.5, 1.5, 0.0]])


def test_asymmetric_clip_raises_only_the_upper_bound():
    # eps 0.2, eps_high 0.28 -> [0.8, 1.28]: u 1.25 (A 1) is kept (symmetric would clip to 1.2),
    # u 1.5 (A 1) -> 1.28, u 0.7 (A -1) -> min(-0.7, -0.8) = -0.8.
    logprobs = torch.log(t([1.25, 1.5, 0.7]))
    zeros = torch.zeros(1, 3)
    advantages, mask = t([1.0, 1.0, -1.0]), torch.ones(1, 3)
    loss, _ = policy_loss(
        logprobs, zeros, zeros, advantages, mask, eps_clip=0.2, eps_clip_high=0.28
    )
    close(loss, [[-1.25, -1.28, 0.8]])
    symmetric, _ = policy_loss(logprobs, zeros, zeros, advantages, mask, eps_clip=0.2)
    close(symmetric, [[-1.2, -1.2, 0.8]])


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_minus_a():
    # c = 3.  u 5, A -1: min(-5, -1.2) = -5, raised to -3 -> loss 3 (clipped, no gradient).
    # u 2, A -1: -2 > -3 -> loss 2, gradient -u A = 2.  u 5, A 1: PPO clip -> loss -1.2.
    logprobs = torch.log(t([5.0, 2.0, 5.0])).requires_grad_()
    zeros = torch.zeros(1, 3)
    advantages, mask = t([-1.0, -1.0, 1.0]), torch.ones(1, 3)
    loss, metrics = policy_loss(
        logprobs, zeros, zeros, advantages, mask, eps_clip=0.2, dual_clip_c=3.0
    )
    close(loss, [[3.0, 2.0, -1.2]])
    close(metrics["clipped"], [[1.0, 0.0, 1.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 2.0, 0.0]])
    plain, _ = policy_loss(logprobs, zeros, zeros, advantages, mask, eps_clip=0.2)
    close(plain, [[5.0, 2.0, -1.2]])


def test_dual_clip_c_must_be_zero_or_above_one():
    zeros = torch.zeros(1, 1)
    for bad in (0.5, 1.0):
        with pytest.raises(ValueError, match="dual_clip_c must be 0"):
            policy_loss(zeros, zeros, zeros, zeros, zeros, eps_clip=0.2, dual_clip_c=bad)


def test_off_policy_corrections_weight_the_loss_by_proximal_over_behaviour():
    # pi_prox / pi_behav = [0.5/0.25, 0.5/0.5, 0.6/0.2] = [2, 1, 3]; logprobs = prox so u = 1
    # and obj = A = [1, -2, 0.5].
    behaviour = torch.log(t([0.25, 0.5, 0.2]))
    proximal = torch.log(t([0.5, 0.5, 0.6]))
    advantages, mask = t([1.0, -2.0, 0.5]), torch.ones(1, 3)
    expected = {
        ("decoupled_ppo", 0.0): ([2.0, 1.0, 3.0], [-2.0, 2.0, -1.5]),
        ("decoupled_ppo", 2.5): ([2.0, 1.0, 2.5], [-2.0, 2.0, -1.25]),
        ("tis", 0.0): ([2.0, 1.0, 2.0], [-2.0, 2.0, -1.0]),  # min(w, 2)
        ("none", 0.0): ([1.0, 1.0, 1.0], [-1.0, 2.0, -0.5]),
    }
    for (correction, cap), (weights, losses) in expected.items():
        loss, metrics = policy_loss(
            proximal.clone(),
            proximal,
            behaviour,
            advantages,
            mask,
            eps_clip=0.2,
            correction=correction,
            tis_clip=2.0,
            behaviour_weight_cap=cap,
        )
        close(metrics["behaviour_weight"], [weights])
        close(loss, [losses])


def test_proximal_and_behaviour_logprobs_receive_no_gradient():
    logprobs = t([-1.0, -2.0]).requires_grad_()
    proximal = t([-1.2, -1.5]).requires_grad_()
    behaviour = t([-1.1, -1.9]).requires_grad_()
    loss, _ = policy_loss(
        logprobs, proximal, behaviour, t([1.0, -1.0]), torch.ones(1, 2), eps_clip=0.2
    )
    loss.sum().backward()
    assert logprobs.grad is not None
    assert proximal.grad is None and behaviour.grad is None


def test_padding_with_extreme_logprobs_gives_zero_loss_metrics_and_finite_gradients():
    logprobs = t([-1.0, 0.0]).requires_grad_()
    proximal, behaviour = t([-1.0, 0.0]), t([-1.0, -1000.0])  # exp(1000) would overflow
    loss, metrics = policy_loss(
        logprobs, proximal, behaviour, t([1.0, 1.0]), t([1, 0]), eps_clip=0.2
    )
    close(loss, [[-1.0, 0.0]])
    for name in ("clipped", "ratio", "behaviour_weight"):
        assert metrics[name][0, 1] == 0
    loss.sum().backward()
    close(logprobs.grad, [[-1.0, 0.0]])


# Each token of one row pushes one log-ratio far out (a stale or sentinel logprob):
#   t0: log(pi / pi_prox) = -0.5 - (-100.5) = +100, log(pi_prox / pi_behav) = 0
#   t1: log(pi / pi_prox) = -100.5 - (-0.5) = -100, log(pi_prox / pi_behav) = 0
#   t2: log(pi_prox / pi_behav) = +inf (behaviour logprob -inf)
#   t3: log(pi_prox / pi_behav) = 1e9 - 0.5 (behaviour logprob -1e9, a "missing" sentinel)
#   t4: log(pi_prox / pi_behav) = -100.5 - (-0.5) = -100
#   t5: both +100: pi -0.5, pi_prox -100.5, pi_behav -200.5
# exp(+100) overflows fp32 (max ~3.4e38 = exp(88.7)), so unbounded ratios give inf or NaN.
EXTREME_LOGPROBS = t([-0.5, -100.5, -0.5, -0.5, -100.5, -0.5])
EXTREME_PROXIMAL = t([-100.5, -0.5, -0.5, -0.5, -100.5, -100.5])
EXTREME_BEHAVIOUR = t([-100.5, -0.5, float("-inf"), -1e9, -0.5, -200.5])


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive_A", "negative_A"])
@pytest.mark.parametrize("dual_clip_c", [0.0, 3.0], ids=["no_dual_clip", "dual_clip"])
@pytest.mark.parametrize(
    ("correction", "cap"),
    [("decoupled_ppo", 0.0), ("decoupled_ppo", 5.0), ("tis", 0.0)],
    ids=["decoupled_uncapped", "decoupled_capped", "tis"],
)
@pytest.mark.parametrize("has_proximal", [True, False], ids=["proximal", "no_proximal"])
def test_extreme_log_ratios_give_a_finite_loss_and_gradient(
    sign, dual_clip_c, correction, cap, has_proximal
):
    _assert_finite_on_extreme_log_ratios(
        sign, has_proximal, dual_clip_c=dual_clip_c, correction=correction, behaviour_weight_cap=cap
    )


def _assert_finite_on_extreme_log_ratios(sign: float, has_proximal: bool, **options) -> None:
    """`policy_loss` of the EXTREME_* log-probabilities, advantages `sign`: its loss, its
    gradient and every metric are finite."""
    logprobs = EXTREME_LOGPROBS.clone().requires_grad_()
    loss, metrics = policy_loss(
        logprobs,
        EXTREME_PROXIMAL if has_proximal else None,
        EXTREME_BEHAVIOUR,
        torch.full((1, 6), sign),
        torch.ones(1, 6),
        eps_clip=0.2,
        **options,
    )
    assert torch.isfinite(loss).all(), loss
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all(), logprobs.grad
    for name, value in metrics.items():
        assert torch.isfinite(value).all(), (name, value)


def test_log_ratios_beyond_the_bound_are_clamped_to_it_and_counted():
    # Bound 20, e^20 = 485165195.4; decoupled PPO, uncapped, eps 0.2.
    #   t0: log u = -0.5 - (-100.5) = 100 -> 20, w = 1, A = -1:
    #       obj = min(-e^20, -1.2) = -e^20, loss e^20; the clamp passes no gradient.
    #   t1: log u = 0, log w = -1 - (-inf) -> 20, A = 1: loss -e^20 * 1, gradient -w u A = -e^20.
    #   t2: log u = 0.1, log w = 0.5 (both inside the bound), A = 1, u = 1.105 < 1.2 unclipped:
    #       loss = gradient = -e^0.5 * e^0.1 = -e^0.6 = -1.8221188.
    #   t3: padding with sentinel logprobs: all 0.
    assert algorithms.LOG_RATIO_BOUND == 20.0
    logprobs = t([-0.5, -1.0, -1.4, -1e9]).requires_grad_()
    proximal = t([-100.5, -1.0, -1.5, 0.0])
    behaviour = t([-100.5, float("-inf"), -2.0, float("-inf")])
    loss, metrics = policy_loss(
        logprobs, proximal, behaviour, t([-1.0, 1.0, 1.0, 1.0]), t([1, 1, 1, 0]), eps_clip=0.2
    )
    close(loss, [[485165195.4, -485165195.4, -1.8221188, 0.0]], atol=1e-5)
    close(metrics["log_ratio_clamped"], [[1.0, 1.0, 0.0, 0.0]])
    close(metrics["ratio"], [[485165195.4, 1.0, 1.1051709, 0.0]], atol=1e-5)
    close(metrics["behaviour_weight"], [[1.0, 485165195.4, 1.6487213, 0.0]], atol=1e-5)
    loss.sum().backward()
    close(logprobs.grad, [[0.0, -485165195.4, -1.8221188, 0.0]], atol=1e-5)


def test_uncorrected_loss_counts_only_the_clamped_policy_ratio():
    # correction none: the behaviour logprob -inf enters nothing, so t0 is not counted;
    # t1 has log u = -30 -> -20 (counted), A = -1: obj = min(-e^-20, -0.8) = -0.8, loss 0.8.
    loss, metrics = policy_loss(
        t([-1.0, -31.0]),
        t([-1.0, -1.0]),
        t([float("-inf"), -1.0]),
        t([1.0, -1.0]),
        torch.ones(1, 2),
        eps_clip=0.2,
        correction="none",
    )
    close(loss, [[-1.0, 0.8]])
    close(metrics["log_ratio_clamped"], [[0.0, 1.0]])


def test_policy_loss_rejects_unknown_corrections():
    zeros = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown off-policy correction 'is'"):
        policy_loss(zeros, zeros, zeros, zeros, zeros, eps_clip=0.2, correction="is")


# ---------------------------------------------------------------- GSPO and CISPO


def test_gspo_clips_whole_sequences_by_their_mean_log_ratio():
    # pi_prox = e^-1 everywhere; log r on trained tokens, eps 0.2 -> [0.8, 1.2], correction none:
    #   row 0: log r = 0.3, -0.1 (t2 is padding with log r = 50, excluded): mean 0.1,
    #          s = e^0.1 = 1.1051709, A = 1, inside the range: loss -s, gradient -s A = -1.1051709
    #          on both (PPO would clip t0, u = e^0.3 = 1.35, and give it no gradient).
    #   row 1: log r = 0.9, -0.1, 0.4: mean 0.4, s = e^0.4 = 1.4918247 > 1.2, A = 1: obj 1.2,
    #          loss -1.2 and no gradient on every token (PPO would keep t1, u = e^-0.1 = 0.905).
    #   row 2: log r = 0.5, 0.3, 0.4: s = 1.4918247, A = -1: min(-1.4918, -1.2) = -1.4918,
    #          loss 1.4918247, gradient -s A = +1.4918247.
    #   row 3: no trained token: 0 everywhere.
    logprobs = t(
        [-0.7, -1.1, 5.0], [-0.1, -1.1, -0.6], [-0.5, -0.7, -0.6], [-1.0, -1.0, -1.0]
    ).requires_grad_()
    proximal = t([-1.0, -1.0, -45.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])
    mask = t([1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0])
    advantages = t([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, 1.0])
    loss, metrics = policy_loss(
        logprobs, proximal, proximal, advantages, mask, eps_clip=0.2, correction="none", loss="gspo"
    )
    s01, s04 = 1.1051709, 1.4918247
    close(loss, [[-s01, -s01, 0], [-1.2, -1.2, -1.2], [s04, s04, s04], [0, 0, 0]])
    close(metrics["ratio"], [[s01, s01, 0], [s04, s04, s04], [s04, s04, s04], [0, 0, 0]])
    close(metrics["clipped"], [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]])
    loss.sum().backward()
    close(logprobs.grad, [[-s01, -s01, 0], [0, 0, 0], [s04, s04, s04], [0, 0, 0]])


def test_gspo_weights_each_token_by_its_behaviour_ratio():
    # log r = 0.2, -0.2: mean 0, s = 1. pi_prox / pi_behav = e^ln2 = 2 and e^-ln2 = 0.5, A = 1:
    # loss = gradient = -w s A = -2 and -0.5.
    logprobs = t([-0.8, -1.2]).requires_grad_()
    proximal = t([-1.0, -1.0])
    behaviour = t([-1.0 - math.log(2), -1.0 + math.log(2)])
    loss, metrics = policy_loss(
        logprobs, proximal, behaviour, t([1.0, 1.0]), torch.ones(1, 2), eps_clip=0.2, loss="gspo"
    )
    close(loss, [[-2.0, -0.5]])
    close(metrics["behaviour_weight"], [[2.0, 0.5]])
    loss.sum().backward()
    close(logprobs.grad, [[-2.0, -0.5]])


def test_gspo_token_loss_averaged_per_sequence_has_the_sequence_objectives_gradient():
    # GSPO's objective for one row: s_i(theta) A_i, s_i = exp(mean_t log r_t); its gradient is
    # s_i A_i / |y_i| * grad log pi_t, the same as the per-token form's row mean.
    generator = torch.Generator().manual_seed(3)
    proximal = -torch.rand(3, 5, generator=generator) - 0.5
    logprobs = (proximal + 0.05 * torch.randn(3, 5, generator=generator)).requires_grad_()
    mask = t([0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0])
    advantages = t(0.7, -1.3, 0.4)[:, None].expand(3, 5)
    loss, _ = policy_loss(
        logprobs,
        proximal,
        proximal,
        advantages,
        mask,
        eps_clip=10.0,
        correction="none",
        loss="gspo",
    )
    (actual,) = torch.autograd.grad(
        aggregate(loss, mask, "seq_mean", num_tokens=10, num_sequences=3), logprobs
    )
    sequence_ratio = torch.exp(masked_mean(logprobs - proximal, mask, dim=1))
    objective = (sequence_ratio * advantages[:, 0]).sum() / 3
    (expected,) = torch.autograd.grad(-objective, logprobs)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)


def test_cispo_clips_and_detaches_the_weight_so_every_token_keeps_a_gradient():
    # eps 0.2, high 0.28 -> weights in [0.8, 1.28]; loss = -sg[clip(r)] A log pi, gradient -clip(r) A.
    #   t0: r = e^(-0.5 - -1) = e^0.5 = 1.6487 -> 1.28, A = 1:  loss -1.28 * 1 * -0.5 = 0.64,
    #       gradient -1.28 (PPO would give it none).
    #   t1: r = e^-0.5 = 0.6065 -> 0.8, A = -1:  loss -0.8 * -1 * -1.5 = -1.2, gradient 0.8.
    #   t2: r = e^0.1 = 1.1051709 unclipped, A = 2:  loss -1.1051709 * 2 * -0.9 = 1.9893076,
    #       gradient -2.2103418.
    #   t3: padding with log pi = -inf: 0.
    logprobs = t([-0.5, -1.5, -0.9, float("-inf")]).requires_grad_()
    proximal = t([-1.0, -1.0, -1.0, -1.0])
    loss, metrics = policy_loss(
        logprobs,
        proximal,
        proximal,
        t([1.0, -1.0, 2.0, 1.0]),
        t([1, 1, 1, 0]),
        eps_clip=0.2,
        eps_clip_high=0.28,
        correction="none",
        loss="cispo",
    )
    close(loss, [[0.64, -1.2, 1.9893076, 0.0]])
    close(metrics["clipped"], [[1.0, 1.0, 0.0, 0.0]])
    close(metrics["ratio"], [[1.6487213, 0.6065307, 1.1051709, 0.0]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.28, 0.8, -2.2103418, 0.0]])


def test_cispo_with_eps_clip_of_one_or_more_has_no_lower_bound():
    # MiniMax-M1's setting: eps_clip = 1 puts the lower bound at 0, so r = e^-0.5 = 0.6065307
    # is kept: loss -0.6065307 * -1 * -1.5 = -0.9097960, gradient 0.6065307.
    logprobs = t([-1.5]).requires_grad_()
    loss, metrics = policy_loss(
        logprobs,
        t([-1.0]),
        t([-1.0]),
        t([-1.0]),
        torch.ones(1, 1),
        eps_clip=1.0,
        eps_clip_high=0.28,
        loss="cispo",
    )
    close(loss, [[-0.9097960]])
    close(metrics["clipped"], [[0.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.6065307]])


def test_cispo_without_proximal_weights_the_log_likelihood_by_the_behaviour_ratio():
    # r = 1; w = pi_prox / pi_behav = e^(-1 - -1.5) = e^0.5 = 1.6487213, A = 0.5:
    # loss -w A log pi = -1.6487213 * 0.5 * -1 = 0.8243607, gradient -w A = -0.8243607.
    logprobs = t([-1.0]).requires_grad_()
    loss, _ = policy_loss(
        logprobs, None, t([-1.5]), t([0.5]), torch.ones(1, 1), eps_clip=0.2, loss="cispo"
    )
    close(loss, [[0.8243607]])
    loss.sum().backward()
    close(logprobs.grad, [[-0.8243607]])


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive_A", "negative_A"])
@pytest.mark.parametrize(
    ("loss_name", "dual_clip_c"),
    [("gspo", 0.0), ("gspo", 3.0), ("cispo", 0.0)],
    ids=["gspo", "gspo_dual_clip", "cispo"],
)
@pytest.mark.parametrize(
    ("correction", "cap"),
    [("decoupled_ppo", 0.0), ("decoupled_ppo", 5.0), ("tis", 0.0)],
    ids=["decoupled_uncapped", "decoupled_capped", "tis"],
)
@pytest.mark.parametrize("has_proximal", [True, False], ids=["proximal", "no_proximal"])
def test_gspo_and_cispo_give_a_finite_loss_and_gradient_for_extreme_log_ratios(
    sign, loss_name, dual_clip_c, correction, cap, has_proximal
):
    _assert_finite_on_extreme_log_ratios(
        sign, has_proximal, dual_clip_c=dual_clip_c, correction=correction,
        behaviour_weight_cap=cap, loss=loss_name,
    )  # fmt: skip


def test_policy_loss_rejects_unknown_losses_and_dual_clip_with_cispo():
    zeros = torch.zeros(1, 1)
    with pytest.raises(
        ValueError, match="unknown policy loss 'grpo'; expected one of ppo, gspo, cispo"
    ):
        policy_loss(zeros, zeros, zeros, zeros, zeros, eps_clip=0.2, loss="grpo")
    with pytest.raises(ValueError, match="cispo has no min to clip"):
        policy_loss(zeros, zeros, zeros, zeros, zeros, eps_clip=0.2, dual_clip_c=3.0, loss="cispo")


# ---------------------------------------------------------------- aggregation


PER_TOKEN = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0])
MASK = t([1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0])


def test_token_mean_divides_the_masked_sum_by_the_mini_batch_tokens():
    # (1 + 2 + 4 + 7 + 8 + 9) / 6 = 31 / 6
    close(aggregate(PER_TOKEN, MASK, "token_mean", num_tokens=6, num_sequences=4), 31 / 6)


def test_seq_mean_averages_row_means_and_counts_empty_rows_as_zero():
    # Row means 1.5, 4, 8, and 0 for the empty row: 13.5 / 4.
    close(aggregate(PER_TOKEN, MASK, "seq_mean", num_tokens=6, num_sequences=4), 13.5 / 4)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_aggregates_of_micro_batches_sum_to_the_mini_batch_mean(mode):
    totals = {"num_tokens": 6.0, "num_sequences": 4}
    whole = aggregate(PER_TOKEN, MASK, mode, **totals)
    parts = aggregate(PER_TOKEN[:1], MASK[:1], mode, **totals) + aggregate(
        PER_TOKEN[1:], MASK[1:], mode, **totals
    )
    close(parts, whole.item())


def test_aggregate_rejects_unknown_modes():
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(PER_TOKEN, MASK, "sum", num_tokens=1, num_sequences=1)


# ---------------------------------------------------------------- critic


def test_gae_with_gamma_and_lambda_one_is_the_remaining_reward_minus_the_value():
    # Trained t1, t2, t4 (t0 prompt, t3 tool output: their rewards and values are ignored).
    # Remaining rewards: t4 1, t2 0.5 + 1 = 1.5, t1 0 + 1.5 = 1.5.
    # A = G - V: t4 1 - 0.7 = 0.3, t2 1.5 - 0.6 = 0.9, t1 1.5 - 0.2 = 1.3; R = A + V = G.
    rewards = t([9.0, 0.0, 0.5, 7.0, 1.0])
    values = t([9.0, 0.2, 0.6, 9.0, 0.7])
    advantages, returns = gae_advantages(rewards, values, t([0, 1, 1, 0, 1]), gamma=1.0, lam=1.0)
    close(advantages, [[0.0, 1.3, 0.9, 0.0, 0.3]], atol=1e-6)
    close(returns, [[0.0, 1.5, 1.5, 0.0, 1.0]], atol=1e-6)


def test_gae_skips_holes_and_bootstraps_from_the_next_trained_token():
    # Row 0: trained t0, t2, t3 with r = 0, 0, 1 and V = 0.5, 0.4, 0.8; t1 is a hole (r 5, V 99).
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45), V after the last token = 0:
    #   t3: delta = 1 + 0.9 * 0 - 0.8 = 0.2;        A = 0.2
    #   t2: delta = 0 + 0.9 * 0.8 - 0.4 = 0.32;     A = 0.32 + 0.45 * 0.2 = 0.41
    #   t0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14;    A = -0.14 + 0.45 * 0.41 = 0.0445
    #   R = A + V: 0.5445, 0.81, 1.0.
    # Row 1 has no trained token: all 0.
    rewards = t([0.0, 5.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0])
    values = t([0.5, 99.0, 0.4, 0.8], [1.0, 1.0, 1.0, 1.0])
    mask = t([1, 0, 1, 1], [0, 0, 0, 0])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    close(advantages, [[0.0445, 0.0, 0.41, 0.2], [0.0, 0.0, 0.0, 0.0]], atol=1e-6)
    close(returns, [[0.5445, 0.0, 0.81, 1.0], [0.0, 0.0, 0.0, 0.0]], atol=1e-6)


def test_gae_rejects_mismatched_shapes_and_factors_outside_zero_one():
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match="must both be"):
        gae_advantages(ones, torch.ones(2, 4), ones, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="loss_mask shape"):
        gae_advantages(ones, ones, torch.ones(2, 4), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got 1.5"):
        gae_advantages(ones, ones, ones, gamma=1.0, lam=1.5)


def test_value_loss_without_clipping_is_half_the_squared_error():
    # V - R = -0.5, 1.0 -> loss 0.125, 0.5, gradient V - R; t2 is off the mask.
    values = t([1.0, 2.0, 0.5]).requires_grad_()
    loss, metrics = value_loss(
        values, t([9.0, 9.0, 9.0]), t([1.5, 1.0, 7.0]), t([1, 1, 0]), clip=0.0
    )
    close(loss, [[0.125, 0.5, 0.0]])
    close(metrics["value_clipped"], [[0.0, 0.0, 0.0]])
    loss.sum().backward()
    close(values.grad, [[-0.5, 1.0, 0.0]])


def test_clipped_value_loss_takes_the_larger_error_of_the_clipped_prediction():
    # c = 0.2.
    #   t0: V 1, V_old 0.5 -> clip 0.7, R 1.5: (1 - 1.5)^2 = 0.25 < (0.7 - 1.5)^2 = 0.64,
    #       loss 0.32, clipped, no gradient.
    #   t1: V 2, V_old 1.9 -> inside [1.7, 2.1], R 1: both 1, loss 0.5, gradient V - R = 1.
    #   t2: V 1, V_old 0.5 -> clip 0.7, R 0: (1 - 0)^2 = 1 > 0.49, loss 0.5, gradient 1
    #       (the clipped prediction is closer to R, so the unclipped error is kept).
    #   t3: off the mask.
    values = t([1.0, 2.0, 1.0, 5.0]).requires_grad_()
    old_values = t([0.5, 1.9, 0.5, 0.0])
    returns = t([1.5, 1.0, 0.0, 0.0])
    loss, metrics = value_loss(values, old_values, returns, t([1, 1, 1, 0]), clip=0.2)
    close(loss, [[0.32, 0.5, 0.5, 0.0]])
    close(metrics["value_clipped"], [[1.0, 0.0, 0.0, 0.0]])
    loss.sum().backward()
    close(values.grad, [[0.0, 1.0, 1.0, 0.0]])


def test_value_loss_rejects_a_negative_clip():
    with pytest.raises(ValueError, match="value clip must be >= 0"):
        value_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip=-1
        )


def test_explained_variance_compares_the_residual_and_return_variances():
    # R = 1, 2, 4 (t3 off the mask): mean 7/3, Var = (16 + 1 + 25) / 9 / 3 = 14/9.
    # R - V = 0, 0, 1: mean 1/3, Var = (1 + 1 + 4) / 9 / 3 = 2/9.  1 - (2/9) / (14/9) = 6/7.
    values, returns, mask = t([1.0, 2.0, 3.0, 50.0]), t([1.0, 2.0, 4.0, -50.0]), t([1, 1, 1, 0])
    close(explained_variance(values, returns, mask), 6 / 7)
    close(explained_variance(returns, returns, mask), 1.0)
    close(explained_variance(torch.full((1, 4), 7 / 3), returns, mask), 0.0)


def test_explained_variance_is_zero_when_the_returns_do_not_vary():
    close(explained_variance(t([0.0, 1.0]), t([2.0, 2.0]), t([1, 1])), 0.0)
    close(explained_variance(t([0.0, 1.0]), t([2.0, 3.0]), t([0, 0])), 0.0)
    close(explained_variance(t([0.0, 0.0]), t([0.0, 0.0]), t([1, 1])), 0.0)


def test_explained_variance_ignores_the_rounding_of_constant_gae_returns():
    """Rewards all 1: GAE's returns are 1 up to float32 rounding of its sums (seen in a
    quickstart run as an explained variance of -2.7e14); that is nothing to explain."""
    values = torch.tensor([[0.3, 0.7, 0.9, 0.2]])
    mask = torch.ones(1, 4)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    _, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert float((returns - 1).abs().max()) < 1e-6
    close(explained_variance(values, returns, mask), 0.0)
    close(explained_variance(values, t([1.0, 1.0, 1.0, 1.0 + 1e-7]), mask), 0.0)
    small = t([1e-4, 2e-4, 3e-4, 4e-4])  # small returns that do vary are still explained
    close(explained_variance(small, small, mask), 1.0)


# ---------------------------------------------------------------- logits


def test_logprobs_of_uniform_logits_are_minus_log_vocab_after_position_zero():
    logprobs = logprobs_from_logits(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 3]]))
    close(logprobs, [[0.0, -math.log(4), -math.log(4)]])  # -1.3862944


def test_logprobs_divide_by_temperature_and_treat_zero_as_one():
    # Predictor logits [2, 0], target token 0.  T = 2: z = [1, 0], 1 - log(1 + e) = -0.3132617.
    # T = 0 (greedy) and T = 1: 2 - log(1 + e^2) = -0.1269280.
    logits, ids = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]]), torch.tensor([[1, 0]])
    close(logprobs_from_logits(logits, ids, temperature=2.0), [[0.0, -0.3132617]])
    close(logprobs_from_logits(logits, ids, temperature=0.0), [[0.0, -0.1269280]])
    close(logprobs_from_logits(logits, ids, temperature=1.0), [[0.0, -0.1269280]])


@pytest.mark.parametrize("chunk_elements", [1 << 24, 2 * 11])  # one chunk; one position each
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_log_softmax_and_gather_with_the_same_gradient(
    monkeypatch, chunk_elements, temperature
):
    monkeypatch.setattr(algorithms.logits, "_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=generator).requires_grad_()
    ids = torch.randint(0, 11, (2, 6), generator=generator)
    actual = logprobs_from_logits(logits, ids, temperature=temperature)
    reference = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    reference = reference.gather(-1, ids[:, 1:, None]).squeeze(-1)
    reference = torch.cat([torch.zeros(2, 1), reference], dim=1)
    torch.testing.assert_close(actual, reference, rtol=1e-6, atol=1e-6)
    weights = torch.randn(2, 6, generator=generator)
    (actual_grad,) = torch.autograd.grad((actual * weights).sum(), logits)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(actual_grad, reference_grad, rtol=1e-6, atol=1e-6)


def test_logprobs_of_bfloat16_logits_are_computed_in_float32():
    logits = torch.randn(1, 4, 9, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.tensor([[1, 2, 3, 4]])
    actual = logprobs_from_logits(logits, ids)
    assert actual.dtype == torch.float32
    reference = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])
    torch.testing.assert_close(actual[:, 1:], reference.squeeze(-1), rtol=1e-6, atol=1e-6)


def test_logprobs_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="does not match logits"):
        logprobs_from_logits(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))


def test_entropy_of_known_distributions():
    # Uniform over 4: log 4 = 1.3862944.  Logits [2, 0] at T = 2: p = [e, 1] / (1 + e),
    # H = log(1 + e) - p0 * 1 = 1.3132617 - 0.7310586 = 0.5822031.
    close(entropy_from_logits(torch.zeros(1, 2, 4)), [[0.0, 1.3862944]])
    logits = torch.tensor([[[2.0, 0.0], [5.0, 5.0]]])
    close(entropy_from_logits(logits, temperature=2.0), [[0.0, 0.5822031]])


@pytest.mark.parametrize("chunk_elements", [1 << 24, 3 * 13])
def test_entropy_matches_the_direct_formula(monkeypatch, chunk_elements):
    monkeypatch.setattr(algorithms.logits, "_CHUNK_ELEMENTS", chunk_elements)
    logits = 3 * torch.randn(3, 5, 13, generator=torch.Generator().manual_seed(2))
    z = logits[:, :-1] / 0.8
    direct = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    expected = torch.cat([torch.zeros(3, 1), direct], dim=1)
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature=0.8), expected, rtol=1e-6, atol=1e-6
    )


def test_row_logprobs_and_entropy_match_the_sequence_forms():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    for temperature in (1.0, 0.7, 0.0):
        full = logprobs_from_logits(logits, ids, temperature=temperature)
        rows = logprobs_of_rows(
            logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1), temperature=temperature
        )
        torch.testing.assert_close(rows, full[:, 1:].reshape(-1), rtol=1e-6, atol=1e-6)
        entropy = entropy_from_logits(logits, temperature=temperature)
        torch.testing.assert_close(
            entropy_of_rows(logits[:, :-1].reshape(-1, 11), temperature=temperature),
            entropy[:, 1:].reshape(-1),
            rtol=1e-6,
            atol=1e-6,
        )


@pytest.mark.parametrize("chunk_elements", [1 << 24, 2 * 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_entropy_has_the_gradient_of_the_direct_formula(monkeypatch, chunk_elements, dtype):
    monkeypatch.setattr(algorithms.logits, "_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(7, 11, generator=generator)).to(dtype)
    weights = torch.randn(7, generator=generator)
    for temperature in (1.0, 0.7, 0.0):
        ours = logits.clone().requires_grad_(True)
        (entropy_of_rows(ours, temperature=temperature) * weights).sum().backward()
        direct = logits.clone().requires_grad_(True)
        z = direct.float() / (temperature or 1.0)
        entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
        (entropy * weights).sum().backward()
        assert ours.grad.dtype == dtype and ours.grad.abs().sum() > 0
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours.grad, direct.grad, rtol=tolerance, atol=tolerance)
