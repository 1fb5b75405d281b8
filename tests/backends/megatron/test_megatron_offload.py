"""The Megatron backend's host offload (colocated mode) on the CPU: one gloo rank, run as a
script in a child process (`python this_file worker`; readiness is its own rendezvous)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]


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


def _worker(model_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    for distributed_optimizer in (True, False):
        resident = _steps(model_dir, distributed_optimizer=distributed_optimizer, offload=False)
        offloaded = _steps(model_dir, distributed_optimizer=distributed_optimizer, offload=True)
        assert offloaded == resident, (distributed_optimizer, resident, offloaded)
    print("offload ok")


def test_megatron_training_through_offloads_and_reloads_equals_training_resident(
    tiny_model_dir, free_port
):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)]
    )
    result = subprocess.run(
        [sys.executable, __file__, "worker", tiny_model_dir],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "offload ok" in result.stdout


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])
