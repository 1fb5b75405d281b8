"""Child processes that never outlive their parent, and readiness waits.

Every component process (engines, router, rollout, learner ranks) is started
through `spawn`: its own process group (so a whole tree can be signalled),
`PR_SET_PDEATHSIG` = SIGKILL on Linux (so a `kill -9` of the parent leaves no
orphan), output to a log file whose tail goes into error messages.

PDEATHSIG fires when the *thread* that forked the child exits, so spawn from
the main thread or another thread that lives as long as the child should
(never from a short-lived worker thread such as `anyio.to_thread`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

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
            preexec_fn=_die_with_parent,
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
    process: ChildProcess | None = None,
    path: str = "/health",
) -> None:
    """Poll `url + path` until it answers 200; fail early with the log tail if `process` dies.

    Polls with a growing interval (readiness, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    last_error = ""
    while time.monotonic() < deadline:
        if process is not None and not process.is_alive():
            raise ProcessDied(
                f"{process.name} exited with code {process.poll()} before it was ready; "
                f"last lines of {process.log_path}:\n{process.log_tail()}"
            )
        try:
            response = httpx.get(url + path, timeout=5.0)
            if response.status_code == 200:
                return
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last_error = type(exc).__name__
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    tail = f"; last lines of its log:\n{process.log_tail()}" if process is not None else ""
    raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f} s ({last_error}){tail}")
