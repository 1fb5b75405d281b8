"""The Megatron backend's host offload (colocated mode) on the CPU: one gloo rank, this file
run as a script (`megatron_ranks.worker_main`, started by the `rank_runs` fixture; readiness is
its own rendezvous)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_ranks import worker_main

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

RUN_TIMEOUT_S = 300.0


def _steps(path: str, *, distributed_optimizer: bool, offload: bool) -> list[list]:
    """Three steps' metrics; with `offload`, everything leaves for the host between them."""
    import msgspec
    import torch
    from megatron_ranks import fixed_micro_batches, learner_config, nll_loss

    from streamrl.backends.megatron.backend import MegatronBackend

    cfg = learner_config()
    megatron = msgspec.structs.replace(
        cfg.megatron, use_distributed_optimizer=distributed_optimizer
    )
    backend = MegatronBackend(
        path, msgspec.structs.replace(cfg, megatron=megatron), device="cpu",
        dtype=torch.float32, seed=0,
    )  # fmt: skip
    micro_batches = fixed_micro_batches(backend.shape.vocab_size)
    steps = []
    for _ in range(3):
        metrics = backend.train_mini_batch(
            micro_batches, nll_loss, temperature=1.0, need_entropy=False
        )
        steps.append(sorted(metrics.items()))
        if offload:
            backend.offload_to_host("optimizer")
            backend.offload_to_host("parameters")
            assert sum(p.untyped_storage().nbytes() for p in backend.model.parameters()) == 0
            assert backend.host_offload.num_bytes > 0
            backend.reload_from_host()
    return steps


def _worker(out: Path, model_dir: str) -> None:
    """Three steps resident and three through offloads, with and without the distributed
    optimizer."""
    import torch

    results = {
        distributed_optimizer: {
            "resident": _steps(
                model_dir, distributed_optimizer=distributed_optimizer, offload=False
            ),
            "offloaded": _steps(
                model_dir, distributed_optimizer=distributed_optimizer, offload=True
            ),
        }
        for distributed_optimizer in (True, False)
    }
    torch.save(results, out)


def test_megatron_training_through_offloads_and_reloads_equals_training_resident(
    rank_runs, tiny_model_dir
):
    rank_runs.start("offload", 1, tiny_model_dir, timeout_s=RUN_TIMEOUT_S)
    result = rank_runs("offload")
    for distributed_optimizer in (True, False):
        run = result[distributed_optimizer]
        assert run["offloaded"] == run["resident"], (distributed_optimizer, run)


if __name__ == "__main__":
    worker_main(offload=_worker)
