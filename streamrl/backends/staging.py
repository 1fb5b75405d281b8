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

`reserve` is not a place for a copy but a dry run of `host`: it notes the host buffers a
`host` copy would take (pinned for GPU tensors) and copies nothing; the pool allocates them
when told (`StagingPool.allocate_pending`), so that the first checkpoint finds them ready
instead of page-locking them itself (18 s for the 21.6 GB of a 1.5B learner on the H200,
against 0.4 s for the copy into them); a backend's write function for it writes nothing.
The learner reserves once, after its first step (Adam's moments exist only then), and
allocates while it waits for a batch: allocated in a thread while it trained, the 21.6 GB
held up the step beside them by 17 s on the H200.

The host buffers are kept from one checkpoint to the next in a `StagingPool` (one per
backend): page-locking tens of GB of new memory is what makes a host copy slow, not the
copy. A checkpoint's buffers go back to the pool when its write is done with them (the
`with staged.host()` block ends), and the next checkpoint's copy takes them again: a
buffer is reused for a tensor of the same shape and dtype, in the order the tensors come.
A copy that finds its buffers still out (their write not done) allocates new ones rather
than wait, so a buffer is never written while a write may read it. The device copies of
`device` staging are not kept: each is freed once moved to the host.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


class Staging(enum.StrEnum):
    HOST = "host"
    DEVICE = "device"
    RESERVE = "reserve"
    """`host`'s buffers taken into the pool, nothing copied (the module docstring)."""


@dataclass(frozen=True)
class Reuse:
    """What one copy did for its host buffers."""

    reused_bytes: int = 0
    """Bytes copied into buffers a previous copy allocated."""
    allocated_bytes: int = 0
    """Bytes of buffers allocated for this copy (pinned when copied from a GPU)."""

    def __add__(self, other: Reuse) -> Reuse:
        return Reuse(
            self.reused_bytes + other.reused_bytes, self.allocated_bytes + other.allocated_bytes
        )


Spec = tuple[tuple[int, ...], torch.dtype, bool]
"""A host buffer to be: shape, dtype, pinned."""


class StagingPool:
    """The host buffers of each part of a checkpoint (`policy`, `critic`: one set each), kept
    between one checkpoint's write and the next checkpoint's copy. A set is out of the pool
    from the copy that takes it until its write gives it back; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[str, list[torch.Tensor]] = {}
        self._pending: dict[str, tuple[list[Spec], list[torch.Tensor]]] = {}
        """Reservations not yet allocated: each part's specs to go and buffers so far."""
        self.last_copy: dict[str, Reuse] = {}
        """Each part's latest copy: bytes reused and allocated."""
        self.reserved: dict[str, tuple[int, float]] = {}
        """Each part's reservation once allocated: bytes, seconds spent allocating."""
        self._reserve_s: dict[str, float] = {}
        self.allocated_by_take: dict[str, int] = {}
        """Bytes of a reservation that each part's latest `take` had to allocate itself (the
        learner had not waited long enough for `allocate_pending` to finish them)."""

    def take(self, part: str) -> list[torch.Tensor]:
        """`part`'s buffers, in the order the last copy used them (empty: none are free); the
        rest of a reservation of `part` is allocated first (`allocated_by_take`)."""
        allocated = 0
        while (nbytes := self._allocate_one(part)) is not None:
            allocated += nbytes
        self.allocated_by_take[part] = allocated
        with self._lock:
            return self._free.pop(part, [])

    def reserve(self, part: str, specs: list[Spec]) -> None:
        """Buffers of `specs` (shape, dtype, pinned), in order, for `part`'s next copy: to be
        allocated by `allocate_pending` (or by the copy's `take`)."""
        with self._lock:
            self._pending[part] = (list(specs), [])
            self._reserve_s[part] = 0.0

    @property
    def pending(self) -> bool:
        """Whether a reservation is still to be allocated."""
        return bool(self._pending)

    def allocate_pending(self, seconds: float) -> None:
        """Allocate reserved buffers, one at a time, for about `seconds` (each buffer whole:
        page-locking one takes about a second per GB; the learner runs this while it waits
        for a batch, as it slows a training step beside it by as much)."""
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            part = next(iter(self._pending), None)
            if part is None or self._allocate_one(part) is None:
                return

    def _allocate_one(self, part: str) -> int | None:
        """Allocate `part`'s next reserved buffer and return its bytes; None when none is
        left."""
        with self._lock:
            if part not in self._pending:
                return None
            specs, buffers = self._pending[part]
            if not specs:
                del self._pending[part]
                return None
            shape, dtype, pinned = specs.pop(0)
        started = time.perf_counter()
        buffers.append(torch.empty(shape, dtype=dtype, pin_memory=pinned))
        self._reserve_s[part] += time.perf_counter() - started
        if not specs:
            with self._lock:
                self._pending.pop(part, None)
            self.give_back(part, buffers)
            self.reserved[part] = (sum(b.nbytes for b in buffers), self._reserve_s[part])
            log.info(
                "checkpoint staging (%s): %.2f GB of host buffers allocated ahead of the first "
                "checkpoint (%.1f s of allocation)", part, self.reserved[part][0] / 1e9,
                self.reserved[part][1],
            )  # fmt: skip
        return buffers[-1].nbytes

    def give_back(self, part: str, buffers: list[torch.Tensor]) -> None:
        """Keep `buffers` for `part`'s next copy (replacing any set kept before)."""
        with self._lock:
            self._free[part] = buffers

    def reuse(self) -> Reuse:
        """The latest copy of every part, summed."""
        return sum(self.last_copy.values(), Reuse())


class Staged:
    """A copy of a tree of dicts, lists and tuples whose tensors are copies, taken with
    `stage`; `host()` gives it with every tensor on the host (in the writing thread)."""

    def __init__(
        self,
        tree: Any,
        event: torch.cuda.Event | None,
        device: torch.device | None,
        release: Callable[[], None],
    ):
        self._tree = tree
        self._event = event
        """Recorded after the copies were queued (device staging on a GPU), else None."""
        self._device = device
        self._release = release
        """Gives the host buffers back to their pool (a no-op without one)."""

    @contextlib.contextmanager
    def host(self) -> Iterator[Any]:
        """The tree with its tensors on the host, for the block's length: its host buffers
        go back to their pool when the block ends (moves a device staging's copies and lets
        them go: enter it once)."""
        tree, self._tree = self._tree, None
        try:
            if self._event is not None:
                tree = self._moved_to_host(tree)  # the device copies go with the old tree
            yield tree
        finally:
            self._release()

    def _moved_to_host(self, tree: Any) -> Any:
        torch.cuda.set_device(self._device)
        stream = torch.cuda.Stream(self._device)
        stream.wait_event(self._event)  # the copies were queued on the learner's stream
        with torch.cuda.stream(stream):
            return _map_tensors(tree, lambda t: t.to("cpu"), {})


def stage(
    tree: Any, *, to: Staging | str, pool: StagingPool | None = None, part: str = "policy"
) -> Staged:
    """Copy every tensor of `tree` (tensors that share storage stay shared) to pinned host
    memory (`host`) or to a new tensor on its device (`device`); host buffers come from
    `pool`'s set for `part` where it has them."""
    stager = Stager(to, pool=pool, part=part)
    return stager.done(stager.copy(tree))


class Stager:
    """Copies taken one tree at a time (a stream of tensors that may reuse one buffer:
    each copied as it comes), then `done` once."""

    def __init__(
        self, to: Staging | str, *, pool: StagingPool | None = None, part: str = "policy"
    ) -> None:
        self.to = Staging(to)
        self.gpu: torch.device | None = None
        """The GPU of the first GPU tensor copied (None: all were on the host)."""
        self._pool, self._part = pool, part
        self._spare: defaultdict[tuple, deque[torch.Tensor]] = defaultdict(deque)
        """The pool's buffers not yet reused, by `_buffer_key`, in their old order."""
        taken = pool.take(part) if pool is not None and self.to is not Staging.RESERVE else []
        self._allocated_by_take = pool.allocated_by_take.get(part, 0) if taken else 0
        """Bytes among `taken` that the take allocated: counted as allocated, not reused."""
        for buffer in taken:
            self._spare[_buffer_key(buffer, buffer.is_pinned())].append(buffer)
        self._buffers: list[torch.Tensor] = []
        """The host buffers of this copy, in order (the pool's next set)."""
        self._specs: list[Spec] = []
        """`reserve`: the buffers a host copy would take, in order."""
        self._reuse = Reuse()

    def copy(self, tree: Any) -> Any:
        """`tree` with each of its tensors copied (shared storage stays shared within it)."""
        return _map_tensors(tree, self._copy_tensor, {})

    def done(self, tree: Any) -> Staged:
        """`tree` (of copies) as staged, once the copies are safe from the training that
        follows: host copies complete, device copies queued on the current stream ahead
        of any later kernel. Buffers of the pool's set that this copy did not use are let
        go."""
        self._spare.clear()
        if self.to is Staging.RESERVE:
            if self._pool is not None:
                self._pool.reserve(self._part, self._specs)
            return Staged(None, None, None, lambda: None)
        if self._pool is not None:
            late = min(self._allocated_by_take, self._reuse.reused_bytes)
            self._pool.last_copy[self._part] = self._reuse + Reuse(
                reused_bytes=-late, allocated_bytes=late
            )
        release = self._release
        if self.gpu is None:
            return Staged(tree, None, None, release)
        if self.to is Staging.HOST:
            torch.cuda.current_stream(self.gpu).synchronize()
            return Staged(tree, None, None, release)
        event = torch.cuda.Event()
        event.record()
        return Staged(tree, event, self.gpu, release)

    def _release(self) -> None:
        buffers, self._buffers = self._buffers, []
        if self._pool is not None and buffers:  # a second call has none to give
            self._pool.give_back(self._part, buffers)

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        is_cuda = tensor.device.type == "cuda"
        if is_cuda:
            self.gpu = self.gpu or tensor.device
            if self.to is Staging.DEVICE:
                return tensor.clone()
        if self.to is Staging.RESERVE:  # nothing copied, nothing kept
            self._specs.append(_buffer_key(tensor, is_cuda))
            return None
        return self._host_buffer(tensor, pinned=is_cuda).copy_(tensor, non_blocking=is_cuda)

    def _host_buffer(self, tensor: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """A spare buffer of the pool's for `tensor`, else a new one."""
        spare = self._spare.get(_buffer_key(tensor, pinned))
        if spare:
            buffer = spare.popleft()
            self._reuse += Reuse(reused_bytes=buffer.nbytes)
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._reuse += Reuse(allocated_bytes=buffer.nbytes)
        self._buffers.append(buffer)
        return buffer


def _buffer_key(tensor: torch.Tensor, pinned: bool) -> tuple:
    """Which host buffers a tensor's copy may go into: same shape, dtype and pinning."""
    return tuple(tensor.shape), tensor.dtype, pinned


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
