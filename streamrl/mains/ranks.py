"""Learner ranks 1..N-1 of a run, seen from rank 0 (`streamrl run`): start, join, watch.

    start_learner_ranks ─► spawner.spawn("learner-rankR", `streamrl _learner`) for R = 1..N-1
                           (children here, or processes of Ray actors on their nodes)
                       ─► join the rendezvous as rank 0 at spawner.reachable(127.0.0.1):free port
                          (a rank that exits first fails the start at once: RankLost)
    watch_ranks        ─► during training: the first rank to exit raises RankLost
    rank_lost_error    ─► after a failure: RankLost when a rank is gone (its collective
                          is usually what failed on rank 0), else None

RankLost names the rank, its node (Ray node id and IP, or this machine), its exit code,
the newest checkpoint to `--resume` from, and the tail of the rank's log. The caller
stops every process afterwards (`Trainer.stop`); a resume may land on other nodes, since
every rank loads the checkpoint from the shared run directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import anyio

from streamrl import checkpoint
from streamrl.backends.rendezvous import RankGroup, init_distributed, start_ranks
from streamrl.events import append_event
from streamrl.process import ProcessDied, ProcessHandle, Spawner, free_port, streamrl_argv

log = logging.getLogger(__name__)

LOST_GRACE_S = 10.0
"""After a collective failed on rank 0: how long to wait for the dead rank to be seen exited
(a Ray actor's death reaches the driver within a second or two)."""


class RankLost(ProcessDied):
    """A learner rank exited before the run told it to stop; the message says where to resume."""


def start_learner_ranks(
    cfg, run_dir: Path, spawner: Spawner, device, *, rendezvous_timeout_s: float = 600.0
) -> RankGroup | None:
    """Start ranks 1..learner.num_gpus-1 through `spawner` and join them as rank 0 (None
    when this process is the only rank). Every rank reads `run_dir/learner.json`."""
    world_size = cfg.learner.num_gpus
    if world_size == 1:
        init_distributed(rank=0, world_size=1, master_port=free_port(), device=device.type)
        return None
    env = {}
    if cfg.cluster.learner_gpus:  # local ranks; a Ray actor sets its own GPUs
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.cluster.learner_gpus))
    master_addr = spawner.reachable("127.0.0.1")  # this node's IP under Ray
    argv = streamrl_argv("--log-level", cfg.logging.level, "_learner", "--run-dir", str(run_dir))
    group = start_ranks(
        argv,
        world_size=world_size,
        ranks=range(1, world_size),
        log_dir=run_dir / "logs",
        master_addr=master_addr,
        env=env,
        spawn_fn=spawner.spawn,
    )
    try:
        _record_ranks(run_dir, group, spawner)
        _join(group, device, run_dir, rendezvous_timeout_s)
    except BaseException:
        group.stop()
        raise
    return group


def _join(group: RankGroup, device, run_dir: Path, timeout_s: float) -> None:
    """Join as rank 0 in a thread, watching the other ranks: one that exits before the
    rendezvous completes fails the start now, not after `timeout_s`."""
    failure: list[BaseException] = []

    def join() -> None:
        try:
            init_distributed(
                rank=0,
                world_size=group.world_size,
                master_addr=group.master_addr,
                master_port=group.master_port,
                device=device.type,
                timeout_s=timeout_s,
            )
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=join, name="rank0-rendezvous", daemon=True)
    thread.start()
    delay = 0.05
    while thread.is_alive():
        thread.join(delay)
        delay = min(delay * 1.5, 1.0)
        lost = rank_lost(group, run_dir, during="before the rendezvous")
        if lost is not None and thread.is_alive():
            raise lost
    if failure:
        raise failure[0]


def _record_ranks(run_dir: Path, group: RankGroup, spawner: Spawner) -> None:
    """Where each rank runs: logged, and an event in run_dir/events.jsonl."""
    ranks = [{"rank": 0, "pid": os.getpid(), **spawner.placement_here()}]
    for rank, child in zip(group.ranks, group.processes, strict=True):
        ranks.append({"rank": rank, "pid": child.pid, **child.placement})
    for entry in ranks:
        log.info("learner rank %d: %s", entry["rank"], entry)
    record = {
        "component": "learner",
        "event": "ranks_started",
        "master": f"{group.master_addr}:{group.master_port}",
        "ranks": ranks,
    }
    append_event(run_dir, record)


def rank_lost(group: RankGroup, run_dir: Path, *, during: str = "during training"):
    """RankLost for the first rank that has exited, or None while all run."""
    lost = group.lost()
    if lost is None:
        return None
    rank, child, code = lost
    return RankLost(
        f"learner rank {rank} ({_where(child)}, pid {child.pid}) exited with code {code} "
        f"{during}; the run stopped and every process it started is being stopped. "
        f"{_resume_hint(run_dir)} Last lines of {child.log_path}:\n{_log_tail(child)}"
    )


def _log_tail(child: ProcessHandle, num_lines: int = 30) -> str:
    """The tail of the rank's log: read here when the file is (a shared run directory, or
    this machine), else through its handle (a lost Ray actor cannot answer)."""
    path = child.log_path
    if path is not None and path.exists():
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    return child.log_tail(num_lines)


def _where(child: ProcessHandle) -> str:
    placement = child.placement
    if "node_id" in placement:
        return f"Ray node {placement['node_id']} at {placement['node_ip']}"
    return "on this machine"


def _resume_hint(run_dir: Path) -> str:
    latest = checkpoint.latest(run_dir)
    if latest is None:
        return (
            f"No checkpoint was written yet under {run_dir}/checkpoints (train.save_interval): "
            f"the run has to start over."
        )
    step = checkpoint.read_state(latest).step
    return (
        f"The last checkpoint is {latest} (step {step}): run `streamrl run` with the same "
        f"config and --resume to continue from it (the same learner.num_gpus; under Ray "
        f"the ranks may land on other nodes)."
    )


async def watch_ranks(group: RankGroup, run_dir: Path) -> None:
    """Return never: raise RankLost as soon as any rank exits (cancel this to stop watching)."""
    async with anyio.create_task_group() as tg:
        for child in group.processes:
            tg.start_soon(_cancel_on_exit, child, tg.cancel_scope)
    lost = await anyio.to_thread.run_sync(rank_lost, group, run_dir)
    raise lost or RankLost("a learner rank exited, and none is seen exited now")


async def _cancel_on_exit(child: ProcessHandle, scope: anyio.CancelScope) -> None:
    await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    scope.cancel()


async def rank_lost_error(group: RankGroup | None, run_dir: Path, exc: BaseException):
    """RankLost when `exc` (what stopped the run) comes with a rank gone; None otherwise. A
    collective that failed on rank 0 because a peer died is seen before that peer's exit:
    then wait up to LOST_GRACE_S for it."""
    if group is None:
        return None
    lost = await anyio.to_thread.run_sync(rank_lost, group, run_dir)
    if lost is not None or not _is_collective_failure(exc):
        return lost
    deadline = time.monotonic() + LOST_GRACE_S
    delay = 0.05
    while lost is None and time.monotonic() < deadline:
        await anyio.sleep(delay)
        delay = min(delay * 1.5, 1.0)
        lost = await anyio.to_thread.run_sync(rank_lost, group, run_dir)
    return lost


def _is_collective_failure(exc: BaseException) -> bool:
    """A torch.distributed error (gloo raises plain RuntimeError) among `exc`'s leaves."""
    import torch.distributed as dist

    if isinstance(exc, BaseExceptionGroup):
        return any(_is_collective_failure(inner) for inner in exc.exceptions)
    return isinstance(exc, dist.DistError) or type(exc) is RuntimeError
