"""Starting learner ranks and their torch.distributed rendezvous.

One learner process per rank (one per GPU; gloo processes on CPU). Every
rank runs the same program, builds a `MegatronBackend` and makes the same
calls in the same order; rank 0 additionally talks to the buffer and passes
the real micro-batches (the others pass `[]`). Typical use by `streamrl run`:

    group = start_ranks(argv_of_learner, world_size=N, ranks=range(1, N), log_dir=run_dir)
    init_distributed(rank=0, world_size=N, master_port=group.master_port)   # this process is rank 0
    backend = MegatronBackend(...)

or start all N ranks as children (`ranks=None`) and let the child with
`RANK=0` talk to the buffer. `spawn` decides where a rank runs: a child here
(`streamrl.process.spawn`, the default) or a process a Ray actor starts on its
node (`RaySpawner.spawn`, with `master_addr` this node's IP). A rank learns its place from the environment
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, the same
names torchrun uses), so `init_distributed()` with no arguments works in a
child. Readiness is the rendezvous itself: `init_process_group` returns on a
rank only once all ranks have joined (or fails after `timeout_s`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamrl.process import ProcessDied, ProcessHandle, free_port, spawn

SpawnFn = Callable[..., ProcessHandle]
"""`spawn(name, argv, *, log_path, env)`: `streamrl.process.spawn` or a Spawner's `spawn`."""


def rank_env(
    rank: int, world_size: int, *, master_addr: str, master_port: int, local_rank: int | None = None
) -> dict[str, str]:
    """Environment variables that place a process at `rank` of the rendezvous."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


@dataclass
class RankGroup:
    """Learner rank processes started by `start_ranks`."""

    processes: list[ProcessHandle]
    """Ranks in order of `ranks` (1..N-1 when rank 0 is the caller)."""
    master_addr: str
    master_port: int
    world_size: int
    ranks: list[int]

    def lost(self) -> tuple[int, ProcessHandle, int] | None:
        """(rank, process, exit code) of the first rank that has exited, or None."""
        for rank, child in zip(self.ranks, self.processes, strict=True):
            code = child.poll()
            if code is not None:
                return rank, child, code
        return None

    def wait(self, timeout_s: float) -> None:
        """Wait for every rank to exit; raise with the log tail of the first that failed."""
        import subprocess
        import time

        deadline = time.monotonic() + timeout_s
        pending = list(self.processes)
        while pending:
            for child in list(pending):
                try:
                    code = child.wait(max(0.05, min(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(
                            f"learner ranks still running after {timeout_s:.0f} s"
                        ) from None
                    continue
                pending.remove(child)
                if code != 0:
                    self.stop()
                    raise ProcessDied(
                        f"{child.name} exited with code {code}; last lines of its log:\n{child.log_tail()}"
                    )

    def stop(self) -> None:
        for child in self.processes:
            child.stop(timeout_s=5.0)


def start_ranks(
    argv: Sequence[str],
    *,
    world_size: int,
    log_dir: Path,
    ranks: Iterable[int] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    env: Mapping[str, str] | None = None,
    name: str = "learner",
    spawn_fn: SpawnFn = spawn,
) -> RankGroup:
    """Start `argv` once per rank in `ranks` (default: all), each with its rank environment,
    as the process `{name}-rank{R}` of `spawn_fn`.

    `master_port` 0 picks a free port. With rank 0 left out, the caller joins
    as rank 0 through `init_distributed(rank=0, ...)` with this group's port."""
    port = master_port or free_port(master_addr)
    ranks = list(range(world_size) if ranks is None else ranks)
    processes = []
    try:
        for rank in ranks:
            child_env = dict(env or {})
            child_env.update(rank_env(rank, world_size, master_addr=master_addr, master_port=port))
            processes.append(
                spawn_fn(
                    f"{name}-rank{rank}",
                    argv,
                    log_path=Path(log_dir) / f"{name}-rank{rank}.log",
                    env=child_env,
                )
            )
    except BaseException:
        for child in processes:
            child.stop(timeout_s=5.0)
        raise
    return RankGroup(processes, master_addr, port, world_size, ranks)


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: str = "auto",
    timeout_s: float = 600.0,
) -> tuple[int, int]:
    """Join the rendezvous (arguments default to the environment); returns (rank, world_size).

    Backend: NCCL when `device` is CUDA (`auto`: CUDA when available), with
    this rank's GPU set to `LOCAL_RANK`; gloo otherwise."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = master_port or int(os.environ["MASTER_PORT"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return rank, world_size


def shutdown() -> None:
    """Tear down Megatron's groups and the default group (end of a learner process)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
