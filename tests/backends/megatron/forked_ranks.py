"""Rank processes forked from a server that imported torch and Megatron once.

A Megatron test rank started as `python FILE worker ...` spends about 5 CPU-s importing torch,
megatron-core, transformers and streamrl's backend before it joins its rendezvous; a test
session starts about twenty of them. `spawn` (the `spawn_fn` of `start_ranks`) forks each rank
instead from multiprocessing's forkserver, one per test process, which loads those modules when
it starts (`PRELOAD`). A forked rank is still its own process: it runs the script as
`__main__` with the same argv, environment and log file, joins the gloo rendezvous over TCP and
exits with the script's exit code; `ForkedRank` is its `ProcessHandle`.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]

PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.auto.configuration_auto",  # what AutoConfig imports (0.5 s)
    "megatron.core",
    "megatron.core.models.gpt",
    "streamrl.backends.megatron.backend",
    "streamrl.backends.rendezvous",
    "pytest",
]
"""What every rank imports; the forkserver imports them once (a module missing is skipped)."""

SERVER_ENV = {
    "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO_ROOT)]),
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
}
"""The forkserver's environment over this process's: this checkout's streamrl first on its
sys.path, as in a rank started with `PYTHONPATH`; one OpenMP thread from torch's load on."""


@functools.cache
def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once per process) with `SERVER_ENV`."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = {key: os.environ.get(key) for key in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    return context


def _run_script(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked rank: become what `subprocess` would have started for `argv`
    (`python SCRIPT ARGS...`): its own process group, killed with the forkserver, output in
    `log_path`, `env` over the environment, then the script run as `__main__`."""
    import runpy

    from streamrl.process import die_with_parent

    die_with_parent()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.update(env)
    script = argv[1]
    sys.argv = list(argv[1:])
    sys.path[:0] = [str(Path(script).parent), str(REPO_ROOT)]
    runpy.run_path(script, run_name="__main__")


class ForkedRank:
    """A rank forked by `spawn`: what `streamrl.process.ChildProcess` offers, on a
    multiprocessing Process."""

    def __init__(self, name: str, process: multiprocessing.process.BaseProcess, log_path: Path):
        self.name = name
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def placement(self) -> dict[str, str]:
        return {}

    def poll(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def log_tail(self, num_lines: int = 30) -> str:
        from streamrl.process import log_tail

        return log_tail(self.log_path, num_lines)

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired while still running after `timeout_s`."""
        self.process.join(timeout_s)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.name, timeout_s)
        return self.process.exitcode

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the rank's process group, SIGKILL what is left after `timeout_s`."""
        if self.is_alive():
            self._signal_group(signal.SIGTERM)
            self.process.join(timeout_s)
        self._signal_group(signal.SIGKILL)
        self.process.join()
        return self.process.exitcode

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        self.process.join()


def spawn(
    name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None
) -> ForkedRank:
    """Fork `argv` (`sys.executable SCRIPT ARGS...`) from the forkserver as the rank `name`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = _context().Process(
        target=_run_script, args=(list(argv), dict(env or {}), str(log_path)), name=name
    )
    process.start()
    return ForkedRank(name, process, log_path)
