"""A learner's state moved to host memory while colocated engines generate, and back.

    offload(kept, dropped)   copy each storage of `kept` to pinned host memory, then free it;
                             free each storage of `dropped` (gradients, zeroed before every
                             step anyway): the device holds none of them (calls add up)
    reload()                 re-allocate every storage, copy `kept` back, zero `dropped`

The move works on storages, in place (`untyped_storage().resize_`): every tensor, view and
reference the optimizer, Megatron's DDP buffers or the model keep stays the same object and
sees its bytes again after the reload, so neither backend rebuilds anything. Storages are
counted once however many tensors view them (Megatron's contiguous parameter and gradient
buffers are one storage each). On CUDA the copies are pinned and asynchronous with one
synchronisation at the end, and the caching allocator's free blocks go back to the driver
(`empty_cache`) so colocated engines can take them; on the CPU the same path runs with
ordinary host buffers (nothing to gain there, but the path is the one tested).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

OFFLOAD_KINDS = ("none", "optimizer", "all")


def distinct_storages(
    tensors: Iterable[torch.Tensor | None], device: torch.device
) -> list[torch.UntypedStorage]:
    """The storages on `device` behind `tensors` (None skipped), each once."""
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type != device.type:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            unique.setdefault(storage._cdata, storage)
    return list(unique.values())


class HostOffload:
    """The storages one backend has moved out (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (storage, host copy)
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its bytes)

    @property
    def is_offloaded(self) -> bool:
        return bool(self._kept or self._dropped)

    @property
    def num_bytes(self) -> int:
        """Device bytes freed by the current offload (0 when nothing is out)."""
        kept = sum(host.numel() for _, host in self._kept)
        return kept + sum(num_bytes for _, num_bytes in self._dropped)

    def offload(self, kept: Iterable[torch.Tensor | None], dropped: Iterable[torch.Tensor | None]):
        """Move `kept` out and free `dropped` (a storage in both is kept; one moved out by an
        earlier call is left as it is: calls add up until `reload`). Returns seconds."""
        started = time.perf_counter()
        kept_storages = distinct_storages(kept, self.device)  # those out already have 0 bytes
        seen = {storage._cdata for storage in kept_storages}
        dropped_storages = [
            s for s in distinct_storages(dropped, self.device) if s._cdata not in seen
        ]
        is_cuda = self.device.type == "cuda"
        moved = []
        for storage in kept_storages:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=is_cuda)
            host.copy_(_bytes_of(storage), non_blocking=is_cuda)
            moved.append((storage, host))
        if is_cuda:
            torch.cuda.synchronize(self.device)  # the copies are done before the frees
        for storage, _ in moved:
            storage.resize_(0)
        self._kept += moved
        for storage in dropped_storages:
            self._dropped.append((storage, storage.nbytes()))
            storage.resize_(0)
        if is_cuda:
            torch.cuda.empty_cache()
        return time.perf_counter() - started

    def reload(self) -> float:
        """Bring everything back (`kept` with its bytes, `dropped` zeroed). Returns seconds."""
        started = time.perf_counter()
        is_cuda = self.device.type == "cuda"
        for storage, host in self._kept:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=is_cuda)
        for storage, num_bytes in self._dropped:
            storage.resize_(num_bytes)
            _bytes_of(storage).zero_()
        if is_cuda:
            torch.cuda.synchronize(self.device)  # before the host copies go
        self._kept, self._dropped = [], []
        return time.perf_counter() - started


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor of a torch optimizer's state (Adam's moments, step counts on the device)."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
