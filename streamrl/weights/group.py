"""The weight-update process group that trainers and engines share.

SGLang engines join a separately named process group to receive weights, and
a trainer must build its side the same way or the two never meet:

    store  = tcp://master_address:master_port rendezvous (rank 0 hosts the TCPStore)
    store  = PrefixStore(group_name, store)
    group  = torch.distributed's private `_new_process_group_helper(...)`
    ranks  = {i: i for i in range(world_size)} registered for the group

The group is not torch's default group: a trainer may keep its own default
group (data parallel, Megatron) next to it, and an engine needs none. Rank 0
is the trainer; engines are ranks 1.. (`rank_offset` of
`/init_weights_update_group`). Two wire formats for one update call's tensors:

    load_format = null                one broadcast(src=0) per tensor, in order
    load_format = "flattened_bucket"  one broadcast of a uint8 tensor: each tensor's
                                      bytes (C order) back to back, in order

The second is SGLang's bucketed path: one collective per bucket instead of one
per tensor (a 0.5B model has ~290 tensors), which is what lets a broadcast run
near the link's bandwidth.

All private torch.distributed API use in streamrl lives in this module:
`_new_process_group_helper`, `_world.pg_group_ranks` and `Tensor._use_count`.
The helper's keyword names changed across torch releases (older ones spell
`backend_options` as `pg_options`), so they are read from its signature at
run time; only the stable positional order and the `group_name` and
`timeout` keywords are relied on. Run here on torch 2.13 (2.11 not run).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"
"""`load_format` of an update call whose tensors travel as one flat byte broadcast."""


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank >= 1) or host (rank 0) the named weight-update group.

    Blocks until all `world_size` ranks have joined or `timeout_s` passes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)

    helper = c10d._new_process_group_helper
    parameters = inspect.signature(helper).parameters
    kwargs: dict = {"group_name": group_name, "timeout": timeout}
    # torch < 2.6 spelled `backend_options` as `pg_options`; both default to None.
    options_key = "backend_options" if "backend_options" in parameters else "pg_options"
    if options_key in parameters:
        kwargs[options_key] = None
    # An empty rank list makes the helper skip the membership check that
    # would consult the default group (which an engine does not have).
    with _no_split_from_default_group():
        result = helper(world_size, rank, [], backend, store, **kwargs)
    group = result[0] if isinstance(result, tuple) else result
    # Without this mapping `broadcast(src=0, group=group)` cannot translate the
    # source rank when no default group exists (or the default is another one).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    logger.info(
        "joined weight-update group %r as rank %d of %d (%s, %s)",
        group_name,
        rank,
        world_size,
        backend,
        url,
    )
    return group


@contextlib.contextmanager
def _no_split_from_default_group() -> Iterator[None]:
    """Hide the default group's bound device while the weight group is made.

    When a trainer's default group is bound to a device (`init_process_group(
    device_id=...)`), the helper would create an NCCL group by splitting the
    default group's communicator: a collective over the trainer's ranks that
    the engines are not part of (it hangs). Without a bound device it makes a
    fresh communicator from the store, as SGLang's engines do."""
    default = c10d.GroupMember.WORLD if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


async def join_in_daemon_thread(**kwargs) -> dist.ProcessGroup:
    """`init_weight_update_group(**kwargs)` from async code, in a daemon thread.

    A join whose group will never complete (a member died before joining) blocks
    until the rendezvous times out (minutes). Cancelling this call abandons the
    thread, and being a daemon it keeps neither the caller nor the process from
    exiting, as a worker thread of the event loop's executor would."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["group"] = init_weight_update_group(**kwargs)
        except Exception as exc:
            outcome["error"] = exc
        with contextlib.suppress(RuntimeError):  # the event loop has exited meanwhile
            anyio.from_thread.run_sync(done.set, token=token)

    name = f"join-{kwargs.get('group_name', DEFAULT_GROUP_NAME)}"
    threading.Thread(target=target, name=name, daemon=True).start()
    await done.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["group"]


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Shut the group down and forget it, so its name can be reused."""
    dist.destroy_process_group(group)


def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` -> `torch.bfloat16` (the names SGLang clients send)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0: send each tensor, in order, one broadcast each (contiguous copies if needed)."""
    sent = [tensor.contiguous() for tensor in tensors]
    baselines = [tensor._use_count() for tensor in sent]
    for tensor in sent:
        dist.broadcast(tensor, src=0, group=group)
    _wait_until_released(group, sent, baselines)


def broadcast_flat(group: dist.ProcessGroup, flat: torch.Tensor) -> None:
    """Rank 0: send one flattened bucket (see `FlatBucket`) in a single broadcast."""
    baseline = flat._use_count()
    dist.broadcast(flat, src=0, group=group)
    _wait_until_released(group, [flat], [baseline])


def receive_tensors(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str,
    load_format: str | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Ranks >= 1: receive one update call's tensors into fresh tensors on `device`, one
    broadcast per name or, with `load_format = "flattened_bucket"`, one for them all."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    specs = [
        (tuple(shape), torch_dtype(dtype)) for dtype, shape in zip(dtypes, shapes, strict=True)
    ]
    if load_format == FLATTENED_BUCKET:
        layout = FlatLayout(specs)
        flat = torch.empty(layout.num_bytes, dtype=torch.uint8, device=device)
        baselines = [flat._use_count()]
        dist.broadcast(flat, src=0, group=group)
        _wait_until_released(group, [flat], baselines)
        return list(zip(names, layout.unpack(flat), strict=True))
    if load_format not in (None, "auto"):
        raise ValueError(f"load_format {load_format!r} is not supported")
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    baselines = [tensor._use_count() for tensor in tensors]
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)
    _wait_until_released(group, tensors, baselines)
    return list(zip(names, tensors, strict=True))


class FlatLayout:
    """Byte offsets of tensors packed back to back into one uint8 tensor (C order each)."""

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.specs = list(specs)
        self.offsets: list[int] = []
        offset = 0
        for shape, dtype in self.specs:
            self.offsets.append(offset)
            offset += _num_bytes(shape, dtype)
        self.num_bytes = offset

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Copy `tensors` (matching the specs) into `out`, a uint8 tensor of `num_bytes`: as
        bytes, all in one `_foreach_copy_` (on a GPU a few kernel launches for the bucket, not
        one per tensor)."""
        sources, targets = [], []
        for tensor, offset, (shape, dtype) in zip(tensors, self.offsets, self.specs, strict=True):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"tensor {tuple(tensor.shape)} {tensor.dtype} != {shape} {dtype}")
            sources.append(tensor.detach().contiguous().view(-1).view(torch.uint8))
            targets.append(out[offset : offset + sources[-1].numel()])
        if sources:
            torch._foreach_copy_(targets, sources, non_blocking=True)

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` as the packed tensors (a copy where an offset is misaligned)."""
        tensors = []
        for offset, (shape, dtype) in zip(self.offsets, self.specs, strict=True):
            raw = flat[offset : offset + _num_bytes(shape, dtype)]
            if offset % dtype.itemsize:
                raw = raw.clone()
            tensors.append(raw.view(dtype).view(shape))
        return tensors


def _num_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def _wait_until_released(
    group: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    baselines: Sequence[int],
    timeout_s: float = 10.0,
) -> None:
    """Return once gloo's worker threads have dropped their references to `tensors`.

    A gloo worker drops a finished collective's tensors a moment after the
    caller's wait returns, and needs the GIL to do it; if the interpreter is
    finalizing by then, the thread is unwound and the process aborts
    ("terminate called without an active exception", pytorch/pytorch#190489).
    Waiting here (GIL released) makes exiting right after a transfer safe. The
    wait is bounded: past `timeout_s` it gives up silently.
    """
    if dist.get_backend(group) != "gloo":
        return
    deadline = time.monotonic() + timeout_s
    for tensor, baseline in zip(tensors, baselines, strict=True):
        while tensor._use_count() > baseline and time.monotonic() < deadline:
            time.sleep(0.0005)
