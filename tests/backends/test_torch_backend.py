"""The torch learner backend: which gradients reach the weights, and in what precision."""

from __future__ import annotations

import pytest
import torch

from streamrl import algorithms
from streamrl.backends.batching import pack_micro_batches
from streamrl.backends.step import make_loss_fn
from streamrl.backends.torch import TorchBackend
from streamrl.config import config_from_dict
from streamrl.types import Sample


def _config(model_dir: str, *, algorithm: dict | None = None, **learner):
    return config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": model_dir},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
            "algorithm": algorithm or {},
            "learner": learner,
        }
    )


def _micro_batches():
    samples = [
        Sample(
            prompt_ids=[1, 5, 6, 7],
            response_ids=[100, 101, 102],
            logprobs=[-2.0, -3.0, -1.0],
            versions=[0] * 3,
            loss_mask=[1, 0, 1],
        ),
        Sample(
            prompt_ids=[1, 5],
            response_ids=[100, 101, 102, 7, 8],
            logprobs=[-1.0] * 5,
            versions=[0] * 5,
            loss_mask=[1] * 5,
        ),
    ]
    micro_batches = pack_micro_batches(samples, [0, 1], token_budget=1000, pad_id=0)
    num_tokens = float(sum(mb.loss_mask.sum() for mb in micro_batches))
    for micro_batch in micro_batches:
        micro_batch.advantages = torch.zeros_like(micro_batch.loss_mask)
        micro_batch.num_tokens_in_mini_batch = num_tokens
        micro_batch.num_sequences_in_mini_batch = 2
    return micro_batches


def _mean_entropy_gradient(model, micro_batches) -> dict[str, torch.Tensor]:
    """d/dw of the token mean of the entropy over the trained tokens, by a full forward."""
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        entropy = algorithms.entropy_from_logits(logits)
        mean = algorithms.aggregate(
            entropy, mb.loss_mask, "token_mean", num_tokens=mb.num_tokens_in_mini_batch,
            num_sequences=mb.num_sequences_in_mini_batch,
        )  # fmt: skip
        mean.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_with_zero_advantages_the_entropy_bonus_gradient_is_that_of_the_mean_entropy(
    tiny_model_dir,
):
    cfg = _config(tiny_model_dir, algorithm={"entropy_coef": 1.0}, grad_clip=0.0)
    backend = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    )
    micro_batches = _micro_batches()
    expected = _mean_entropy_gradient(backend.model, micro_batches)
    backend.train_mini_batch(micro_batches, make_loss_fn(cfg), temperature=1.0, need_entropy=True)
    got = {n: p.grad for n, p in backend.model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected)
    total = sum(float(g.abs().sum()) for g in got.values())
    assert total > 0, "the entropy bonus gave no gradient"
    for name, grad in expected.items():
        # the loss is -entropy_coef * H: its gradient is minus the entropy's
        torch.testing.assert_close(got[name], -grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_1e_8_scale_update_survives_training_in_bfloat16(tiny_model_dir):
    """learner.dtype = bfloat16 (the CUDA default, here on the CPU): a step of lr 1e-8 moves
    the weights by about 1e-8 (Adam's first step is lr * sign(g)), which bf16 weights of
    magnitude ~0.02 (spacing ~1e-4) would round away."""
    cfg = _config(tiny_model_dir, algorithm={"entropy_coef": 1.0}, lr=1e-8, grad_clip=0.0)
    backend = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.bfloat16
    )
    before = {n: p.detach().double().clone() for n, p in backend.model.named_parameters()}
    backend.train_mini_batch(
        _micro_batches(), make_loss_fn(cfg), temperature=1.0, need_entropy=True
    )
    moved, total = 0, 0
    for name, parameter in backend.model.named_parameters():
        if parameter.grad is None:
            continue
        step = (parameter.detach().double() - before[name]).abs()
        # Adam moves these by ~lr (eps = 1e-8); weights near 1 (norms) are past fp32's own
        # resolution for 1e-8 (spacing 1.2e-7 at 1.0), those below 1/16 well within it.
        has_gradient = (parameter.grad.abs() > 1e-6) & (before[name].abs() < 1 / 16)
        total += int(has_gradient.sum())
        moved += int((step[has_gradient] > 0.5e-8).sum())
        assert float(step.max()) < 2e-8, name
    assert total > 1000
    assert moved / total > 0.99, f"{moved} of {total} weights kept a 1e-8 update"


def test_training_in_bfloat16_computes_in_bfloat16_and_publishes_bfloat16_weights(tiny_model_dir):
    cfg = _config(tiny_model_dir)
    exact = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    )
    mixed = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.bfloat16
    )
    batches = _micro_batches()
    fp32 = exact.compute_logprobs(batches, temperature=1.0)[0]
    bf16 = mixed.compute_logprobs(batches, temperature=1.0)[0]
    difference = (fp32 - bf16).abs().max()
    assert 0 < difference < 0.1  # bf16 matmuls: close to fp32, not equal to it
    published = dict(mixed.hf_weights())
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    for name, parameter in mixed.model.named_parameters():
        torch.testing.assert_close(published[name], parameter.detach().to(torch.bfloat16))


def test_the_torch_learning_rate_follows_the_schedule_and_resumes_where_it_stopped(
    tiny_model_dir, tmp_path
):
    from streamrl.schedules import lr_at

    schedule = {"lr": 1e-3, "warmup_steps": 2, "decay_style": "cosine", "decay_steps": 3}
    schedule["min_lr"] = 1e-4
    cfg = _config(tiny_model_dir, algorithm={"entropy_coef": 1.0})
    loss_fn, batches = make_loss_fn(cfg), _micro_batches()

    def build():
        return TorchBackend(
            tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32,
            lr_schedule=schedule,
        )  # fmt: skip

    def lrs(backend, num_steps: int) -> list[float]:
        return [
            backend.train_mini_batch(batches, loss_fn, temperature=1.0, need_entropy=True)["lr"]
            for _ in range(num_steps)
        ]

    backend = build()
    before = lrs(backend, 3)
    backend.save(tmp_path / "checkpoint")
    resumed = build()
    resumed.load(tmp_path / "checkpoint")
    expected = [lr_at(step, **schedule) for step in range(7)]
    assert expected[:2] == pytest.approx([5e-4, 1e-3]) and expected[5:] == pytest.approx([1e-4] * 2)
    assert before + lrs(resumed, 4) == pytest.approx(expected, rel=1e-12)
