"""The Megatron backend's side of the training recipe, on CPU: the entropy bonus's gradient,
the learning-rate schedule across a resume, and the KL reference from its own path.

One real gloo rank runs this file as a script (`python tests/backends/megatron/test_megatron_recipe.py
worker single OUT MODEL_DIR OTHER_MODEL_DIR`, megatron_ranks.py), started in a module fixture;
each test reads its result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ranks import hf_token_logprobs, seeded_micro_batches, worker_main

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

RUN_TIMEOUT_S = 240.0


def micro_batches(vocab_size: int):
    """Two right-padded micro-batches with zero advantages, the same in every process."""
    return seeded_micro_batches(
        [[10, 7, 9], [8, 5]], token_ids=range(vocab_size),
        generator=torch.Generator().manual_seed(99), prompt_tokens=3, advantage=0.0,
        random_behaviour=True,
    )  # fmt: skip


SCHEDULE = {"lr": 1e-3, "lr_warmup_steps": 2, "lr_decay_style": "linear", "lr_decay_steps": 2}
SCHEDULE |= {"min_lr": 1e-4}


def run_config(*, algorithm: dict | None = None, **learner):
    from streamrl.config import config_from_dict

    return config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": "m"},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 5},
            "algorithm": algorithm or {"entropy_coef": 1.0},
            "learner": {
                "backend": "megatron",
                "grad_clip": 0.0,
                "megatron": {"use_distributed_optimizer": False},
                **learner,
            },
        }
    )


# ---------------------------------------------------------------- the worker (a script)


def _hf_named_main_grads(backend) -> dict[str, torch.Tensor]:
    """Megatron's accumulated gradient of every parameter, under its HF name(s)."""
    from streamrl.backends.megatron import convert

    layout = backend.layout
    grads = {}
    for rule, param in convert.iter_stage_tensors(
        backend.model, backend.shape, pp_rank=layout.pp_rank, pp_size=layout.pp_size
    ):
        grad = param.main_grad.detach().float().clone()
        for name, part in zip(
            rule.hf, convert.merge(rule.kind, [grad], backend.shape), strict=True
        ):
            grads[name] = part
    return grads


def _worker(out: Path, model_dir: str, other_dir: str) -> None:
    from streamrl.backends.build import build_backend
    from streamrl.backends.step import make_loss_fn

    cpu, fp32 = torch.device("cpu"), torch.float32
    cfg = run_config(lr=1e-3)
    backend = build_backend(cfg, model_dir, cpu, fp32)
    batches = micro_batches(backend.shape.vocab_size)
    metrics = backend.train_mini_batch(
        batches, make_loss_fn(cfg), temperature=1.0, need_entropy=True
    )
    results = {"entropy": {"grads": _hf_named_main_grads(backend), "metrics": metrics}}

    cfg = run_config(algorithm={"entropy_coef": 1.0, "kl_loss_coef": 0.1}, **SCHEDULE)
    backend = build_backend(cfg, model_dir, cpu, fp32, reference_path=other_dir)
    results["policy"] = backend.compute_logprobs(batches, temperature=1.0)
    results["reference"] = backend.compute_logprobs(batches, temperature=1.0, reference=True)
    loss_fn = make_loss_fn(run_config())  # the entropy bonus only: no reference logprobs

    def lrs(backend, num_steps: int) -> list[float]:
        return [
            backend.train_mini_batch(batches, loss_fn, temperature=1.0, need_entropy=True)["lr"]
            for _ in range(num_steps)
        ]

    before = lrs(backend, 3)
    backend.save(out.parent / "checkpoint")
    resumed = build_backend(
        cfg, str(out.parent / "checkpoint"), cpu, fp32, reference_path=other_dir
    )
    resumed.load(out.parent / "checkpoint")
    results["lrs"] = before + lrs(resumed, 3)
    results["reference_after_resume"] = resumed.compute_logprobs(
        batches, temperature=1.0, reference=True
    )
    torch.save(results, out)


# ---------------------------------------------------------------- fixtures and tests


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    """A second random Qwen3 of the same shape (seed 1): the KL reference."""
    from streamrl.models import save_random_model

    path = tmp_path_factory.mktemp("models") / "qwen3-tiny-seed1"
    save_random_model("qwen3-tiny", path, seed=1)
    return str(path)


@pytest.fixture(scope="module")
def result(rank_runs, tiny_model_dir, other_model_dir) -> dict:
    rank_runs.start("single", 1, tiny_model_dir, other_model_dir, timeout_s=RUN_TIMEOUT_S)
    return rank_runs("single")


def test_with_zero_advantages_megatrons_entropy_bonus_gradient_is_that_of_the_mean_entropy(
    result, tiny_model_dir
):
    from transformers import AutoModelForCausalLM

    from streamrl import algorithms

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for mb in micro_batches(model.config.vocab_size):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        entropy = algorithms.entropy_from_logits(logits)
        algorithms.aggregate(
            entropy, mb.loss_mask, "token_mean",
            num_tokens=mb.num_tokens_in_mini_batch, num_sequences=mb.num_sequences_in_mini_batch,
        ).backward()  # fmt: skip
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    got = result["entropy"]["grads"]
    assert sum(float(g.abs().sum()) for g in got.values()) > 0
    compared = sorted(set(got) & set(expected))
    assert len(compared) >= len(got) - 1  # a tied lm_head is the embedding under HF's names
    for name in compared:
        # the loss is -entropy_coef * H: its gradient is minus the entropy's
        torch.testing.assert_close(got[name], -expected[name], atol=1e-5, rtol=1e-3, msg=name)


def _hf_logprobs(model_dir: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_token_logprobs(model, mb) for mb in micro_batches(model.config.vocab_size)]


def test_megatrons_kl_reference_is_built_from_the_reference_path_and_survives_a_resume(
    result, tiny_model_dir, other_model_dir
):
    for got, expected in zip(result["policy"], _hf_logprobs(tiny_model_dir), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    reference = _hf_logprobs(other_model_dir)
    for key in ("reference", "reference_after_resume"):
        for got, expected in zip(result[key], reference, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_megatron_follows_the_lr_schedule_and_resumes_it_where_it_stopped(result):
    from streamrl.schedules import lr_at

    expected = [
        lr_at(step, lr=1e-3, warmup_steps=2, decay_style="linear", decay_steps=2, min_lr=1e-4)
        for step in range(6)
    ]
    assert expected == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4, 1e-4, 1e-4])
    assert result["lrs"] == pytest.approx(expected, rel=1e-12)


if __name__ == "__main__":
    worker_main(single=_worker)
