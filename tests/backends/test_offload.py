"""The learner's state moved to host memory and back (colocated mode, `learner.offload`)."""

from __future__ import annotations

import torch
from test_torch_backend import _config, _micro_batches

from streamrl.backends.offload import HostOffload, distinct_storages, optimizer_tensors
from streamrl.backends.step import make_loss_fn
from streamrl.backends.torch import TorchBackend


def _losses(backend, cfg, *, offload: bool) -> tuple[list[float], list[dict[str, int]]]:
    """Three steps; with `offload`, the optimizer and then the parameters leave between them
    (as in a colocated step) and come back before the next. Returns the losses and the
    bytes left on the device after each offload."""
    losses, resident = [], []
    for _ in range(2):
        metrics = backend.train_mini_batch(
            _micro_batches(), make_loss_fn(cfg), temperature=1.0, need_entropy=False
        )
        losses.append(metrics["loss"])
        if offload:
            backend.offload_to_host("optimizer")
            backend.offload_to_host("parameters")
            resident.append(
                {
                    "optimizer": sum(
                        t.untyped_storage().nbytes() for t in optimizer_tensors(backend.optimizer)
                    ),
                    "parameters": sum(
                        p.untyped_storage().nbytes() for p in backend.model.parameters()
                    ),
                    "gradients": sum(p.grad is not None for p in backend.model.parameters()),
                }
            )
            backend.reload_from_host()
    return losses, resident


def test_training_through_offloads_and_reloads_equals_training_resident(tiny_model_dir):
    cfg = _config(tiny_model_dir, lr=1e-3)
    backends = [
        TorchBackend(tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32)
        for _ in range(2)
    ]
    resident_losses, _ = _losses(backends[0], cfg, offload=False)
    offloaded_losses, resident = _losses(backends[1], cfg, offload=True)
    assert offloaded_losses == resident_losses  # bit for bit: the same bytes came back
    assert resident == [{"optimizer": 0, "parameters": 0, "gradients": 0}] * 2
    for before, after in zip(
        backends[0].model.parameters(), backends[1].model.parameters(), strict=True
    ):
        assert torch.equal(before, after)
    assert not backends[1].host_offload.is_offloaded


def test_a_storage_viewed_by_many_tensors_moves_once_and_dropped_ones_come_back_zeroed():
    buffer = torch.arange(12, dtype=torch.float32)
    views = [buffer[:6], buffer[6:]]
    grads = torch.ones(4)
    assert len(distinct_storages([*views, buffer, None], torch.device("cpu"))) == 1
    offload = HostOffload(torch.device("cpu"))
    offload.offload(views, [grads])
    assert offload.num_bytes == 12 * 4 + 4 * 4
    assert buffer.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    offload.reload()
    assert torch.equal(views[1], torch.arange(6, 12, dtype=torch.float32))
    assert torch.equal(grads, torch.zeros(4))
    assert offload.num_bytes == 0
