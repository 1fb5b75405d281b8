"""A small Python sandbox for agent tools: a fresh interpreter per call, with limits.

Each call runs `python -I -S -c CODE` in a new process in an empty temporary directory,
with an empty environment and resource limits set before it starts: CPU time
(`cpu_s`), address space (`memory_bytes`), file size (`max_file_bytes`), no core
files; a wall-clock deadline (`wall_s`) kills its whole process group. It answers the
captured stdout (or the error), cut at `max_output_chars`.

These are limits, not isolation: the code runs as this user and can read what this user
can read. Run agents whose tools execute model-written code inside a container or VM
when that matters.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 2
    memory_bytes: int = 256 << 20
    max_file_bytes: int = 1 << 20
    max_output_chars: int = 400


def _limit(limits: Limits):
    def apply() -> None:
        os.setsid()  # its own process group: a timeout kills everything it started
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, limits: Limits = Limits()) -> str:
    """Run `code`; its stdout, or "Error: ..." (the last line of its stderr, or the limit)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as workdir:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code],
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limit(limits),
        )
        try:
            out, err = process.communicate(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return f"Error: the code ran past {limits.wall_s:g} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever it left running
    if process.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"exit code {process.returncode}"
        if process.returncode < 0:
            reason = f"killed by signal {-process.returncode} (a resource limit)"
        return f"Error: {reason}"[: limits.max_output_chars]
    return out.decode(errors="replace")[: limits.max_output_chars]
