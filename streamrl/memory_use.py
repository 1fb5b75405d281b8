"""Measured peak memory of a run's processes, for `summary.json` and `streamrl check --against`.

    watch = MemoryWatch(lambda: {"learner rank 0": os.getpid(), "engine 0": 4242})
    watch.start()                    # samples every interval_s in a thread
    ...
    watch.stop(); watch.peaks()      # {"engine 0": {"pid": 4242, "gpu_peak_bytes": ...,
                                     #               "host_peak_bytes": ...}, ...}

Two sources, each absent (None) where the machine cannot say, never guessed:
- GPU: `nvidia-smi --query-compute-apps=pid,used_memory` (what each process holds on its
  GPUs: torch's reserved pool plus the CUDA context, kernels and NCCL), summed over a
  process and its descendants (SGLang's memory sits in its scheduler child), sampled every
  `interval_s`: a peak shorter than that can be missed. No nvidia-smi, or no process of
  the tree listed: None. Every listed pid's own peak is kept too (`gpu_by_pid`), for
  machines whose nvidia-smi reports pids of another namespace.
- host: `VmHWM` of /proc/PID/status (the kernel's own peak resident set), summed over the
  process tree as last seen.

A process measures its own allocator with `torch_peaks` (torch.cuda.max_memory_allocated
and max_memory_reserved, None without CUDA), which the learner and the embedded engine
report beside these.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 2**20
PROC = Path("/proc")


def children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process /proc lists (empty where there is no /proc)."""
    tree: dict[int, list[int]] = {}
    if not PROC.is_dir():
        return tree
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after it
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2:
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def process_tree(pid: int, tree: dict[int, list[int]]) -> list[int]:
    """`pid` and every descendant of it in `tree` (`children_of`)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.append(current)
        todo.extend(tree.get(current, ()))
    return found


def host_peak_bytes(pid: int) -> int | None:
    """The process's peak resident set (`VmHWM`), None where /proc does not say."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def gpu_used_by_pid(executable: str = "nvidia-smi") -> dict[int, int] | None:
    """Bytes each compute process holds on the GPUs now (a pid on several GPUs summed);
    None without nvidia-smi or when it fails."""
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        result = subprocess.run(
            [path, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    used: dict[int, int] = {}
    for line in result.stdout.splitlines():
        pid, _, mib = line.partition(",")
        try:
            used[int(pid)] = used.get(int(pid), 0) + int(float(mib)) * MIB
        except ValueError:
            continue  # "[N/A]" or a partial line
    return used


def torch_peaks(device: Any = None) -> dict[str, int | None]:
    """This process's allocator peaks on its CUDA device: `torch_max_allocated_bytes`
    (tensors) and `torch_max_reserved_bytes` (the caching allocator's pool), None without
    CUDA, off it (`device` on the CPU) or where torch was never imported (nothing of it
    could be on a GPU)."""
    torch = sys.modules.get("torch")
    absent = {"torch_max_allocated_bytes": None, "torch_max_reserved_bytes": None}
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return absent
    if device is not None and torch.device(device).type != "cuda":
        return absent
    return {
        "torch_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "torch_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


class MemoryWatch:
    """Peaks of named processes, sampled every `interval_s` in a daemon thread (see the
    module docstring). `processes()` names the pids to watch now (an engine restarted has a
    new pid; its peak is kept over both); each is measured with its descendants unless
    named in `without_children`."""

    def __init__(
        self,
        processes: Callable[[], dict[str, int]],
        *,
        interval_s: float = 1.0,
        without_children: frozenset[str] = frozenset(),
    ) -> None:
        """`without_children`: names measured as their process alone (the trainer, whose
        children are the engines and the rollout)."""
        self.processes = processes
        self.without_children = without_children
        self.interval_s = interval_s
        self.gpu_peaks: dict[str, int | None] = {}
        self.host_peaks: dict[str, int | None] = {}
        self.pids: dict[str, int] = {}
        self.gpu_by_pid: dict[int, int] = {}
        self.has_gpu_source = shutil.which("nvidia-smi") is not None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MemoryWatch:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="memory-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sample()

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One reading of every watched process (a process that is gone keeps its peak)."""
        try:
            named = dict(self.processes())
        except Exception:  # a spawner shutting down: the next reading will tell
            return
        gpu = gpu_used_by_pid() if self.has_gpu_source else None
        tree = children_of()
        for pid, used in (gpu or {}).items():
            self.gpu_by_pid[pid] = max(self.gpu_by_pid.get(pid, 0), used)
        for name, pid in named.items():
            self.pids[name] = pid
            members = [pid] if name in self.without_children else process_tree(pid, tree)
            if gpu is not None:
                held = [gpu[member] for member in members if member in gpu]
                if held:
                    self.gpu_peaks[name] = max(self.gpu_peaks.get(name) or 0, sum(held))
            self.gpu_peaks.setdefault(name, None)
            hosts = [host_peak_bytes(member) for member in members]
            if any(value is not None for value in hosts):
                total = sum(value for value in hosts if value is not None)
                self.host_peaks[name] = max(self.host_peaks.get(name) or 0, total)
            self.host_peaks.setdefault(name, None)

    def peaks(self) -> dict[str, dict[str, Any]]:
        """Per watched process: its pid, `gpu_peak_bytes` and `host_peak_bytes` (None: not
        measured)."""
        return {
            name: {
                "pid": pid,
                "gpu_peak_bytes": self.gpu_peaks.get(name),
                "host_peak_bytes": self.host_peaks.get(name),
            }
            for name, pid in self.pids.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """What a run's summary records under `memory` (besides each process's torch peaks)."""
        return {
            "processes": self.peaks(),
            "gpu_source": "nvidia-smi" if self.has_gpu_source else None,
            "gpu_by_pid": {str(pid): used for pid, used in sorted(self.gpu_by_pid.items())},
            "interval_s": self.interval_s,
        }


def measured_peak(process: dict[str, Any]) -> tuple[int | None, str]:
    """(bytes, how) of one process's entry in a summary's `memory.processes`: the measure
    docs/memory.md holds the planner to. With torch's and nvidia-smi's figures both: the
    tensors' peak plus what the process holds outside its allocator's pool
    (`torch_max_allocated_bytes` + `gpu_peak_bytes` - `torch_max_reserved_bytes`); with
    nvidia-smi's alone (SGLang): `gpu_peak_bytes`; neither: (None, why)."""
    gpu = process.get("gpu_peak_bytes")
    allocated = process.get("torch_max_allocated_bytes")
    reserved = process.get("torch_max_reserved_bytes")
    if gpu is not None and allocated is not None and reserved is not None:
        return allocated + max(gpu - reserved, 0), "torch allocated + (nvidia-smi - reserved)"
    if gpu is not None:
        return gpu, "nvidia-smi"
    return None, "not measured (no nvidia-smi figure for the process)"
