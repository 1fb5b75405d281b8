"""Child processes that never outlive their parent, and readiness waits.

Every component process (engines, router, rollout, learner ranks) is started
through `spawn`: its own process group (so a whole tree can be signalled),
`PR_SET_PDEATHSIG` = SIGKILL on Linux (so a `kill -9` of the parent leaves no
orphan), output to a log file whose tail goes into error messages.

PDEATHSIG fires when the *thread* that forked the child exits, so spawn from
the main thread or another thread that lives as long as the child should
(never from a short-lived worker thread such as `anyio.to_thread`).

`Spawner` is the launcher's seam: `LocalSpawner` spawns here, the Ray launcher
(`streamrl.launch.ray`) in actors; both hand back a `ProcessHandle`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import gc
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

_PR_SET_PDEATHSIG = 1

ServerArgv = Callable[[int, str, int], tuple[list[str], dict[str, str]]]
"""How to start server `index` on `host:port`: (index, host, port) -> (argv, extra env)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a server that binds it later.

    Picked at random outside the kernel's ephemeral range (`ip_local_port_range`): a port
    the kernel handed out by binding 0 is one the next outgoing connection of any process
    may take as its own local port before the server binds it (a learner rank's rendezvous
    failed with EADDRINUSE that way while the other test worker made HTTP calls). Falls back
    to binding 0 when no port outside the range is free."""
    low, high = _ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((10_000, low - 1), (high + 1, 65_535)) if hi - lo >= 1000]
    for _ in range(64) if spans else ():
        lo, hi = _PORT_PICKS.choice(spans)
        port = _PORT_PICKS.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_PORT_PICKS = random.SystemRandom()
"""Not the `random` module's state, which a seeded process shares with its seeded siblings."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49_152, 65_535


def die_with_parent() -> None:
    """In a child before it runs: a process group of its own, and SIGKILL when its parent dies."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def log_tail(log_path: Path | None, num_lines: int = 30) -> str:
    """The last lines of a child's log file, or "(no log)"."""
    if log_path is None or not log_path.exists():
        return "(no log)"
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-num_lines:])


class ChildProcess:
    """A started child: its Popen, name and log file."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path | None) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_lines: int = 30) -> str:
        return log_tail(self.log_path, num_lines)

    def signal(self, signum: int) -> None:
        """Signal the child's whole process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group, then SIGKILL what is left after `timeout_s`; returns the exit code."""
        if self.is_alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait()
        # Reap grandchildren that ignored SIGTERM.
        self.signal(signal.SIGKILL)
        return self.popen.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the child exits (subprocess.TimeoutExpired after `timeout_s`)."""
        return self.popen.wait(timeout_s)

    @property
    def placement(self) -> dict[str, str]:
        """Where the process runs, for engines.json: nothing to add on this machine."""
        return {}


def stop_all(stops: Sequence[Callable[[], object]]) -> None:
    """Call every stop at once, one thread each, and return when all have returned: stopping
    N processes takes as long as the slowest stop, not their sum (each stop is bounded:
    SIGTERM, then SIGKILL after its timeout). The first error is raised after all returned."""
    if not stops:
        return
    with concurrent.futures.ThreadPoolExecutor(len(stops), thread_name_prefix="stop") as pool:
        futures = [pool.submit(stop) for stop in stops]
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:
        raise errors[0]


class ProcessHandle(Protocol):
    """What the launcher and the engine fleet use of a started process: a `ChildProcess`
    here, or a process that a Ray actor started on its node (`streamrl.launch.ray`)."""

    name: str
    log_path: Path | None

    @property
    def pid(self) -> int: ...
    @property
    def placement(self) -> dict[str, str]: ...
    def poll(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def log_tail(self, num_lines: int = 30) -> str: ...
    def stop(self, timeout_s: float = 10.0) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout_s: float | None = None) -> int: ...


class Spawner(Protocol):
    """Where component processes run: here (`LocalSpawner`) or in Ray actors
    (`streamrl.launch.ray.spawner.RaySpawner`). The handles it returns act like `ChildProcess`."""

    name: str
    """The launcher's name, `local` or `ray` (recorded in engines.json)."""

    def reachable(self, host: str) -> str:
        """The address to bind on this machine for something configured at `host` that
        other components must reach (buffer, router, weight-update master, learner
        rendezvous)."""
        ...

    def placement_here(self) -> dict[str, str]:
        """Where this process runs, as `ProcessHandle.placement` gives it (empty: here)."""
        ...

    def address(self, name: str, host: str) -> tuple[str, int]:
        """Host and free port for the server process `name` (configured at `host`)."""
        ...

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ProcessHandle:
        """Start `argv` as the process `name`; a restart spawns the same name again."""
        ...

    def close(self) -> None:
        """Stop everything started through this spawner and release what it holds."""
        ...


class LocalSpawner:
    """Every process a child of this one (PDEATHSIG, own process group, log in `log_path`)."""

    name = "local"

    def reachable(self, host: str) -> str:
        return host

    def placement_here(self) -> dict[str, str]:
        return {}

    def address(self, name: str, host: str) -> tuple[str, int]:
        return host, free_port(host)

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ChildProcess:
        return spawn(name, argv, log_path=log_path, env=env)

    def close(self) -> None:
        """Nothing held: the job stops its own children."""


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ChildProcess:
    """Start `argv` in its own process group, killed if this process dies."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stdout = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    else:
        stdout = subprocess.DEVNULL
    try:
        popen = subprocess.Popen(
            list(argv),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            preexec_fn=die_with_parent,
        )
    finally:
        if log_path is not None:
            stdout.close()
    return ChildProcess(name, popen, log_path)


def streamrl_argv(*args: str) -> list[str]:
    """argv that runs `streamrl ARGS` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "streamrl", *args]


class ProcessDied(RuntimeError):
    pass


def wait_http_ready(
    url: str,
    *,
    timeout_s: float,
    process: ProcessHandle | None = None,
    path: str = "/health",
) -> None:
    """Poll `url + path` until it answers 200; fail early with the log tail if `process` dies.

    Polls with an interval growing to 0.2 s (readiness, not a fixed sleep): a refused
    connection costs next to nothing, and every poll skipped is startup time lost. One
    client for all polls: building an httpx client (its TLS context) costs ~35 ms of CPU."""
    import httpx  # here: an engine imports this module for `no_full_collections` alone

    deadline = time.monotonic() + timeout_s
    delay = 0.05
    last_error = ""
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            if process is not None and not process.is_alive():
                raise ProcessDied(
                    f"{process.name} exited with code {process.poll()} before it was ready; "
                    f"last lines of {process.log_path}:\n{process.log_tail()}"
                )
            try:
                response = http.get(url + path)
                if response.status_code == 200 and (process is None or process.is_alive()):
                    return  # (a 200 after `process` died came from whoever took its port)
                last_error = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last_error = type(exc).__name__
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)
    tail = f"; last lines of its log:\n{process.log_tail()}" if process is not None else ""
    raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f} s ({last_error}){tail}")


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """No automatic full garbage collection inside: for a process's start-up, whose imports
    and model make objects that live as long as the process. Each full collection walks every
    object alive, and a start-up makes several while their number grows: 0.2 CPU-seconds of
    an engine's start, 0.7 of a run's trainer (CPU, tiny model). Young objects are collected
    as before; a cycle that outlives them waits for the first full collection after."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 2**30)  # full: after this many middle collections
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)
