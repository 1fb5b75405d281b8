"""The torch learner backend and the training step on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl import algorithms
from streamrl.backends.batching import pack_micro_batches
from streamrl.backends.step import train_step
from streamrl.backends.torch import TorchBackend
from streamrl.config import config_from_dict
from streamrl.types import Group, Sample


def backend_for(model_dir: str, **learner) -> tuple[TorchBackend, object]:
    cfg = config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": model_dir},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 4},
            "learner": learner,
        }
    )
    return TorchBackend(
        model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    ), cfg


def test_learner_logprobs_on_trained_positions_equal_a_full_forward(tiny_model_dir):
    backend, _ = backend_for(tiny_model_dir)
    samples = [
        Sample(
            prompt_ids=[1, 5, 6, 7],
            response_ids=[100, 101, 102],
            logprobs=[0] * 3,
            versions=[0] * 3,
            loss_mask=[1, 0, 1],
        ),
        Sample(
            prompt_ids=[1, 5],
            response_ids=[100, 101, 102, 7, 8],
            logprobs=[0] * 5,
            versions=[0] * 5,
            loss_mask=[1] * 5,
        ),
    ]
    micro_batches = pack_micro_batches(samples, [0, 1], token_budget=1000, pad_id=0)
    ours = backend.compute_logprobs(micro_batches, temperature=0.8)[0]
    batch = micro_batches[0]
    with torch.no_grad():
        logits = backend.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits
    full = algorithms.logprobs_from_logits(logits, batch.input_ids, temperature=0.8)
    torch.testing.assert_close(ours, full * batch.loss_mask, atol=1e-5, rtol=1e-5)


def test_a_training_step_raises_the_logprob_of_the_rewarded_response(tiny_model_dir):
    backend, cfg = backend_for(tiny_model_dir, lr=1e-3)
    prompt, good, bad = [1, 5, 6, 7], [100, 101, 102], [200, 201, 202]

    def logprob(response: list[int]) -> float:
        sample = Sample(
            prompt_ids=prompt,
            response_ids=response,
            logprobs=[0] * 3,
            versions=[0] * 3,
            loss_mask=[1] * 3,
        )
        batches = pack_micro_batches([sample], [0], token_budget=100, pad_id=0)
        return float(backend.compute_logprobs(batches, temperature=1.0)[0].sum())

    before_good, before_bad = logprob(good), logprob(bad)
    for _ in range(3):
        behaviour = {tuple(good): logprob(good) / 3, tuple(bad): logprob(bad) / 3}
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=r,
                logprobs=[behaviour[tuple(r)]] * 3,
                versions=[0] * 3,
                loss_mask=[1] * 3,
                reward=reward,
            )
            for r, reward in [(good, 1.0), (bad, 0.0), (good, 1.0), (bad, 0.0)]
        ]
        metrics = train_step(
            backend,
            [Group(group_id="g", prompt_seq=0, prompt_index=0, samples=samples)],
            cfg,
            pad_id=0,
        )
        assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert logprob(good) > before_good + 1.0
    assert logprob(bad) < before_bad


def test_without_a_proximal_pass_a_step_equals_the_step_with_one(tiny_model_dir, monkeypatch):
    """One optimizer step per step: pi_prox is the training forward's own detached logprobs,
    so skipping the separate proximal pass changes neither the update nor the metrics."""
    import streamrl.backends.step as step_module

    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=[1, 5, 6, 7],
            response_ids=list(rng.integers(10, 300, size=4 + i)),
            logprobs=list(rng.uniform(-6.0, -4.0, size=4 + i)),
            versions=[0] * (4 + i),
            loss_mask=[1] * (4 + i),
            reward=float(i % 2),
        )
        for i in range(4)
    ]
    groups = [Group(group_id="g", prompt_seq=0, prompt_index=0, samples=samples)]
    results = []
    for force_pass in (True, False):
        backend, cfg = backend_for(tiny_model_dir, lr=1e-3, micro_batch_tokens=24)
        passes = []

        def counted(*args, passes=passes, original=backend.compute_logprobs, **kwargs):
            passes.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(backend, "compute_logprobs", counted)
        monkeypatch.setattr(step_module, "needs_proximal_pass", lambda cfg, f=force_pass: f)
        metrics = train_step(backend, groups, cfg, pad_id=0)
        weights = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
        results.append((len(passes), metrics, weights))
    (passes_with, with_pass, weights_with), (passes_without, without, weights_without) = results
    assert (passes_with, passes_without) == (1, 0)
    for name, tensor in weights_with.items():
        torch.testing.assert_close(weights_without[name], tensor, atol=1e-6, rtol=1e-5)
    for key in ("loss", "logprob_abs_diff_mean", "mismatch_kl", "importance_ess", "grad_norm"):
        assert without[f"train/{key}"] == pytest.approx(with_pass[f"train/{key}"], rel=1e-4), key
    assert "train/logprob_abs_diff_max" not in without
    assert without["train/logprob_abs_diff_mean"] > 1.0  # behaviour logprobs are far off
    # Each pass that ran is timed, and only those.
    assert with_pass["train/proximal_s"] > 0 and "train/proximal_s" not in without
    assert with_pass["train/update_s"] > 0 and without["train/update_s"] > 0
    assert "train/reference_s" not in with_pass and "train/values_s" not in with_pass


def test_a_proximal_pass_is_made_only_when_pi_prox_differs_from_the_training_forward():
    from streamrl.backends.step import needs_proximal_pass

    def cfg(**sections):
        base = {"data": {"path": "x"}, "model": {"path": "m"}}
        base["rollout"] = {"batch_size": 2, "n_samples_per_prompt": 4}
        return config_from_dict({**base, **sections})

    assert not needs_proximal_pass(cfg())
    assert needs_proximal_pass(cfg(learner={"global_batch_size": 4}))  # two optimizer steps
    assert needs_proximal_pass(
        cfg(algorithm={"advantage_estimator": "reinforce_plus_plus", "kl_loss_coef": 0.01})
    )
    assert not needs_proximal_pass(cfg(algorithm={"kl_loss_coef": 0.01}))  # KL in the loss only


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
def test_algorithm_loss_selects_the_policy_loss_of_the_step(loss):
    from streamrl.backends.base import MicroBatch
    from streamrl.backends.step import make_loss_fn

    cfg = config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": "m"},
            "algorithm": {"loss": loss, "eps_clip": 0.1},
        }
    )
    generator = torch.Generator().manual_seed(4)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = MicroBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.int64),
        attention_mask=torch.ones(2, 4, dtype=torch.int64),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(2, 4, generator=generator) * mask,
        sample_indices=[0, 1],
        advantages=torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -1.0, -1.0, 0.0]]),
        proximal_logprobs=-torch.rand(2, 4, generator=generator) * mask,
        num_tokens_in_mini_batch=5.0,
        num_sequences_in_mini_batch=2,
    )
    logprobs = (-torch.rand(2, 4, generator=generator) * mask).requires_grad_(True)
    got, metrics = make_loss_fn(cfg)(batch, logprobs, None)
    per_token, _ = algorithms.policy_loss(
        logprobs, batch.proximal_logprobs, batch.behaviour_logprobs, batch.advantages, mask,
        eps_clip=0.1, loss=loss,
    )  # fmt: skip
    torch.testing.assert_close(got, per_token.sum() / 5.0)
    assert metrics["log_ratio_clamped_tokens"] == 0
