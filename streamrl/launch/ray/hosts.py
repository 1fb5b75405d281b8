"""One component process on a Ray node: the `ProcessHost` actor that runs it as its child,
and `RayProcess`, the driver's handle to it with `ChildProcess`'s interface (so the engine
supervisor and the launcher drive local and Ray processes alike)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from streamrl.mains.follower import NODE_IP_ENV
from streamrl.process import ChildProcess, free_port, spawn

log = logging.getLogger(__name__)

LOST_EXIT_CODE = -int(signal.SIGKILL)
"""What `RayProcess.poll` reports once its actor is gone: the child died with it (PDEATHSIG)."""
CALL_TIMEOUT_S = 60.0
"""Bound on one call to a ProcessHost (they answer in milliseconds unless the node is lost)."""
STOP_TIMEOUT_S = 10.0
"""A stopped process gets SIGKILL this long after its SIGTERM."""
REPLY_MARGIN_S = 5.0
"""How long past a stop's own timeout the driver waits for the actor's answer; an actor that
has not answered by then is killed, and its process with it (PDEATHSIG)."""


class ProcessHost:
    """Ray actor body: one component process on the actor's node (its child, so it dies
    with the actor: PDEATHSIG). Async, so `wait` never blocks `stop` or `log_tail`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.child: ChildProcess | None = None

    async def node(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id and IP, its own pid, the GPUs Ray gave it."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        }

    async def free_port(self) -> int:
        """A port free on this node's IP a moment ago."""
        import ray

        return free_port(ray.util.get_node_ip_address())

    async def start(
        self, argv: list[str], env: dict[str, str], log_path: str | None, cwd: str
    ) -> int:
        """Start `argv` (again, after an exit); returns its pid. `CUDA_VISIBLE_DEVICES` is
        the actor's GPUs (empty without), `STREAMRL_NODE_IP` this node's IP; `cwd` is used
        where it exists on this node."""
        import ray

        if self.child is not None and self.child.is_alive():
            raise RuntimeError(f"{self.name} still runs as pid {self.child.pid}")
        env = {
            **env,
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in ray.get_gpu_ids()),
            NODE_IP_ENV: ray.util.get_node_ip_address(),
        }
        # Spawned from the actor's event-loop thread, which lives as long as the actor.
        self.child = spawn(
            self.name,
            argv,
            log_path=Path(log_path) if log_path else None,
            env=env,
            cwd=Path(cwd) if Path(cwd).is_dir() else None,
        )
        return self.child.pid

    async def poll(self) -> int | None:
        return self.child.poll()

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit code; None if it still runs after `timeout_s`."""
        try:
            return await asyncio.to_thread(self.child.wait, timeout_s)
        except subprocess.TimeoutExpired:
            return None

    async def log_tail(self, num_lines: int = 30) -> str:
        return self.child.log_tail(num_lines) if self.child is not None else "(not started)"

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        if self.child is None:
            return None
        return await asyncio.to_thread(self.child.stop, timeout_s)

    async def kill(self) -> None:
        if self.child is not None:
            await asyncio.to_thread(self.child.kill)


class RayProcess:
    """A component process started by a ProcessHost; `ChildProcess`'s interface, over Ray.

    Each call is a round trip to the actor (milliseconds on a healthy cluster). Once the
    actor is gone the process is too: `poll` answers LOST_EXIT_CODE."""

    def __init__(self, name: str, host, pid: int, node: dict[str, Any], log_path: Path | None):
        self.name = f"{name} (Ray node {node['node_ip']})"
        self.log_path = log_path
        self._host = host
        self._pid = pid
        self._node = node

    @property
    def pid(self) -> int:
        """The pid on its node."""
        return self._pid

    @property
    def placement(self) -> dict[str, Any]:
        return {
            "node_id": self._node["node_id"],
            "node_ip": self._node["node_ip"],
            "actor_pid": self._node["actor_pid"],
        }

    def _call(self, method: str, *args: Any, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
        import ray

        return ray.get(getattr(self._host, method).remote(*args), timeout=timeout_s)

    def poll(self) -> int | None:
        import ray

        try:
            return self._call("poll")
        except ray.exceptions.RayActorError:
            return LOST_EXIT_CODE

    def is_alive(self) -> bool:
        return self.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        import ray

        try:
            code = self._call("wait", timeout_s, timeout_s=None)
        except ray.exceptions.RayActorError:
            return LOST_EXIT_CODE
        if code is None:
            raise subprocess.TimeoutExpired(self.name, timeout_s)
        return code

    def log_tail(self, num_lines: int = 30) -> str:
        import ray

        try:
            return self._call("log_tail", num_lines)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            return f"(the log on node {self._node['node_ip']} is out of reach: {exc})"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, SIGKILL after `timeout_s`; the exit code. Bounded by `timeout_s` plus
        REPLY_MARGIN_S: an actor that does not answer by then is killed with its process."""
        import ray

        try:
            return self._call("stop", timeout_s, timeout_s=timeout_s + REPLY_MARGIN_S)
        except ray.exceptions.RayActorError:
            return LOST_EXIT_CODE
        except ray.exceptions.GetTimeoutError:
            log.warning("%s did not answer a stop within %.0f s: killing its actor", self.name,
                        timeout_s + REPLY_MARGIN_S)  # fmt: skip
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(self._host)
            return LOST_EXIT_CODE

    def kill(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):
            self._call("kill")


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22); None
    when there is no such process. With the pid it names one process, even once pids wrap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def kill_survivors(processes: dict[int, int], *, grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the processes in `processes` (pid -> `start_time`) to exit,
    then SIGKILL the rest (the whole process group of a group leader); their pids."""
    pending: dict[int, int] = {}  # pidfd -> pid: readable once the process has exited
    for pid, started in processes.items():
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        if start_time(pid) == started:  # checked after opening: the pidfd pins the process
            pending[pidfd] = pid
        else:
            os.close(pidfd)
    deadline = time.monotonic() + grace_s
    while pending and (left_s := deadline - time.monotonic()) > 0:
        exited, _, _ = select.select(list(pending), [], [], left_s)
        for pidfd in exited:
            os.close(pidfd)
            del pending[pidfd]
    for pidfd, pid in pending.items():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)
    return sorted(pending.values())
