"""A resumed run keeps the KL reference of the run's start."""

from __future__ import annotations

import torch

from streamrl import checkpoint
from streamrl.backends.batching import pack_micro_batches
from streamrl.backends.step import train_step
from streamrl.config import config_from_dict
from streamrl.mains.trainer import Trainer
from streamrl.types import Group, Sample


def _samples() -> list[Sample]:
    generator = torch.Generator().manual_seed(5)
    return [
        Sample(
            prompt_ids=[1, 5, 6, 7],
            response_ids=torch.randint(10, 200, (5,), generator=generator).tolist(),
            logprobs=[-4.0] * 5,
            versions=[0] * 5,
            loss_mask=[1] * 5,
            reward=float(i % 2),
        )
        for i in range(4)
    ]


def test_reference_logprobs_after_any_number_of_resumes_equal_those_of_the_first_start(tmp_path):
    cfg = config_from_dict(
        {
            "model": {"path": "random:qwen3-tiny"},
            "data": {"path": "builtin:arithmetic"},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 4},
            "algorithm": {"kl_loss_coef": 0.1},
            "learner": {"lr": 1e-2, "device": "cpu"},
            "train": {"output_dir": str(tmp_path / "run")},
        }
    )
    samples = _samples()
    batches = pack_micro_batches(samples, list(range(4)), token_budget=1000, pad_id=0)
    device, dtype = torch.device("cpu"), torch.float32

    def logprobs(backend, *, reference: bool) -> torch.Tensor:
        return backend.compute_logprobs(batches, temperature=1.0, reference=reference)[0]

    trainer = Trainer(cfg, resume=False)
    state, _, _ = trainer.prepare()
    backend = trainer.build_learner(device, dtype)
    reference_at_start = logprobs(backend, reference=True)
    torch.testing.assert_close(logprobs(backend, reference=False), reference_at_start)
    for resume in range(2):
        for _ in range(2):
            train_step(
                backend,
                [Group(group_id="g", prompt_seq=0, prompt_index=0, samples=samples)],
                cfg,
                pad_id=0,
            )
            state.step += 1
            state.version += 1
        trained = logprobs(backend, reference=False)
        assert (trained - reference_at_start).abs().max() > 1e-2  # the policy moved
        checkpoint.save(trainer.run_dir, state, backend.save, keep=2)

        trainer = Trainer(cfg, resume=True)
        state, _, resume_from = trainer.prepare()
        assert state.step == 2 * (resume + 1)
        backend = trainer.build_learner(device, dtype)
        backend.load(resume_from)
        torch.testing.assert_close(logprobs(backend, reference=False), trained)
        torch.testing.assert_close(
            logprobs(backend, reference=True), reference_at_start, atol=1e-6, rtol=1e-6
        )
