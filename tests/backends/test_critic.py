"""The critic of `advantage_estimator = "gae"` in the torch backend: it learns the returns,
its advantages are GAE's, and it is saved and restored with the policy."""

from __future__ import annotations

import pytest
import torch

from streamrl import algorithms
from streamrl.backends.batching import gather_responses, pack_micro_batches
from streamrl.backends.build import build_backend
from streamrl.backends.step import train_step
from streamrl.config import config_from_dict
from streamrl.types import Group, Sample


def _config(model_dir: str, **algorithm):
    return config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": model_dir},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 2},
            "algorithm": {"advantage_estimator": "gae", **algorithm},
            "learner": {"lr": 1e-4, "critic": {"lr": 3e-3}, "device": "cpu"},
        }
    )


def _groups() -> list[Group]:
    """Two prompts; the reward depends on the prompt and on the sample (so values can learn
    part of it, and advantages are not all zero)."""
    generator = torch.Generator().manual_seed(3)
    groups = []
    for seq, prompt in enumerate(([1, 5, 6, 7], [1, 9, 9])):
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(10, 200, (4 + i,), generator=generator).tolist(),
                logprobs=[-4.0] * (4 + i),
                versions=[0] * (4 + i),
                loss_mask=[1] * (3 + i) + [0],  # the last token is masked: a tool's, say
                reward=float(seq) + 0.25 * i,
            )
            for i in range(2)
        ]
        groups.append(Group(group_id=f"g{seq}", prompt_seq=seq, prompt_index=seq, samples=samples))
    return groups


def _values(backend, groups) -> torch.Tensor:
    samples = [s for g in groups for s in g.samples]
    batches = pack_micro_batches(samples, list(range(len(samples))), token_budget=999, pad_id=0)
    return gather_responses(samples, batches, backend.critic.compute_values(batches))


def test_the_critic_learns_the_returns_and_its_explained_variance_rises(tiny_model_dir):
    cfg = _config(tiny_model_dir, value_clip=0.0)
    backend = build_backend(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)
    groups = _groups()
    assert float(_values(backend, groups).abs().max()) == 0.0  # the head starts at zero
    history = [train_step(backend, groups, cfg, pad_id=0) for _ in range(12)]
    first, last = history[0], history[-1]
    for key in ("critic_value_loss", "critic_grad_norm", "critic_lr", "critic_explained_variance"):
        assert f"train/{key}" in first, key
    assert first["train/critic_explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert last["train/critic_value_loss"] < 0.2 * first["train/critic_value_loss"]
    assert last["train/critic_explained_variance"] > 0.5
    assert first["train/critic_lr"] == pytest.approx(3e-3)


def test_gae_advantages_of_a_step_are_reward_minus_value_on_the_last_trained_token(
    tiny_model_dir, monkeypatch
):
    """gamma = lam = 1: every trained token's return is the sample's reward, and its
    advantage is that reward minus the token's own value before the step."""
    import streamrl.backends.step as step

    cfg = _config(tiny_model_dir)
    backend = build_backend(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)
    groups = _groups()
    train_step(backend, groups, cfg, pad_id=0)  # values are no longer all zero
    values = _values(backend, groups)
    seen = {}
    original = step._gae

    def recording(*args):
        seen["advantages"], seen["returns"] = original(*args)
        return seen["advantages"], seen["returns"]

    monkeypatch.setattr(step, "_gae", recording)
    train_step(backend, groups, cfg, pad_id=0)
    samples = [s for g in groups for s in g.samples]
    for row, sample in enumerate(samples):
        on = torch.from_numpy(sample.loss_mask > 0)
        width = len(sample.response_ids)
        returns = seen["returns"][row, :width]
        # R_t = A_t + V_t telescopes to the reward only in exact arithmetic: in float32 each
        # of the row's trained tokens adds three roundings (r + V_next, - V_t, + A_next) and
        # R_t one more, each within eps/2 of a magnitude of at most |r| + 2 max|V|.
        eps = torch.finfo(torch.float32).eps
        magnitude = abs(sample.reward) + 2 * float(values[row, :width].abs().max())
        bound = (3 * int(on.sum()) + 1) * eps / 2 * magnitude
        assert float((returns[on] - sample.reward).abs().max()) <= bound
        assert torch.all(returns[~on] == 0)  # set, not computed
        expected = torch.where(on, sample.reward - values[row, :width], 0.0)
        torch.testing.assert_close(seen["advantages"][row, :width], expected)


def test_the_critic_is_saved_beside_the_policy_and_restored_on_resume(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir)
    backend = build_backend(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)
    groups = _groups()
    for _ in range(2):
        train_step(backend, groups, cfg, pad_id=0)
    backend.save(tmp_path / "step_2")
    assert (tmp_path / "step_2" / "critic" / "value_model.safetensors").exists()
    resumed = build_backend(cfg, str(tmp_path / "step_2"), torch.device("cpu"), torch.float32)
    resumed.load(tmp_path / "step_2")
    torch.testing.assert_close(_values(resumed, groups), _values(backend, groups))
    after = train_step(backend, groups, cfg, pad_id=0)
    after_resume = train_step(resumed, groups, cfg, pad_id=0)
    for key in ("critic_value_loss", "critic_lr", "loss"):
        assert after_resume[f"train/{key}"] == pytest.approx(after[f"train/{key}"], rel=1e-5)


def test_the_explained_variance_of_the_step_is_that_of_the_values_before_it(tiny_model_dir):
    cfg = _config(tiny_model_dir)
    backend = build_backend(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)
    groups = _groups()
    train_step(backend, groups, cfg, pad_id=0)
    values = _values(backend, groups)
    samples = [s for g in groups for s in g.samples]
    mask = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for row, sample in enumerate(samples):
        mask[row, : len(sample.response_ids)] = torch.from_numpy(sample.loss_mask.astype("float32"))
        returns[row] = sample.reward * mask[row]
    metrics = train_step(backend, groups, cfg, pad_id=0)
    assert metrics["train/critic_explained_variance"] == pytest.approx(
        float(algorithms.explained_variance(values, returns, mask)), abs=1e-6
    )
