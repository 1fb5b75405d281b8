"""The copy of a learner's state that a checkpoint writes while training goes on.

A checkpoint is taken in two parts (`LearnerBackend.stage_checkpoint`): the learner copies
what the checkpoint holds (weights, optimizer state) and goes back to training, and a
background thread writes the copy. Where the copy lives is `train.checkpoint_staging`:

    host     pinned host memory (plain host memory on a CPU learner); the learner waits
             for the device-to-host copy, and the host holds one more copy of the state
    device   the learner's own device: the learner waits only for a device-to-device
             copy, the background thread then moves it to the host (on its own CUDA
             stream) and frees it; the device holds one more copy until then

On a CPU learner both are one copy in memory.
"""

from __future__ import annotations

import enum
from typing import Any

import torch


class Staging(enum.StrEnum):
    HOST = "host"
    DEVICE = "device"


class Staged:
    """A copy of a tree of dicts, lists and tuples whose tensors are copies, taken with
    `stage`; `host()` gives it with every tensor on the host (in the writing thread)."""

    def __init__(self, tree: Any, event: torch.cuda.Event | None, device: torch.device | None):
        self._tree = tree
        self._event = event
        """Recorded after the copies were queued (device staging on a GPU), else None."""
        self._device = device

    def host(self) -> Any:
        """The tree with its tensors on the host (moves a device staging's copies and lets
        them go: call it once)."""
        if self._event is None:
            return self._tree
        torch.cuda.set_device(self._device)
        stream = torch.cuda.Stream(self._device)
        stream.wait_event(self._event)  # the copies were queued on the learner's stream
        with torch.cuda.stream(stream):
            tree = _map_tensors(self._tree, lambda t: t.to("cpu"), {})
        self._tree = None
        return tree


def stage(tree: Any, *, to: Staging | str) -> Staged:
    """Copy every tensor of `tree` (tensors that share storage stay shared) to pinned host
    memory (`host`) or to a new tensor on its device (`device`)."""
    stager = Stager(to)
    return stager.done(stager.copy(tree))


class Stager:
    """Copies taken one tree at a time (a stream of tensors that may reuse one buffer:
    each copied as it comes), then `done` once."""

    def __init__(self, to: Staging | str) -> None:
        self.to = Staging(to)
        self.gpu: torch.device | None = None
        """The GPU of the first GPU tensor copied (None: all were on the host)."""

    def copy(self, tree: Any) -> Any:
        """`tree` with each of its tensors copied (shared storage stays shared within it)."""
        return _map_tensors(tree, self._copy_tensor, {})

    def done(self, tree: Any) -> Staged:
        """`tree` (of copies) as staged, once the copies are safe from the training that
        follows: host copies complete, device copies queued on the current stream ahead
        of any later kernel."""
        if self.gpu is None:
            return Staged(tree, None, None)
        if self.to is Staging.HOST:
            torch.cuda.current_stream(self.gpu).synchronize()
            return Staged(tree, None, None)
        event = torch.cuda.Event()
        event.record()
        return Staged(tree, event, self.gpu)

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone()
        self.gpu = self.gpu or tensor.device
        if self.to is Staging.DEVICE:
            return tensor.clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)


def _map_tensors(tree: Any, fn, memo: dict[Any, torch.Tensor]) -> Any:
    """`tree` with `fn(tensor)` for each tensor; a tensor viewing the same storage, offset,
    shape and strides as one already mapped gets that result (tied weights stay tied)."""
    if isinstance(tree, torch.Tensor):
        key = (
            tree.device,
            tree.untyped_storage().data_ptr(),
            tree.storage_offset(),
            tuple(tree.shape),
            tree.stride(),
            tree.dtype,
        )
        if key not in memo:
            memo[key] = fn(tree)
        return memo[key]
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn, memo) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn, memo) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_map_tensors(v, fn, memo) for v in tree)
    return tree
