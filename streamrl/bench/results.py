"""Benchmark results: one JSON (commit, config, machine, command, result) and one PNG plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, memory, GPUs and library versions."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as handle:
            names = [
                line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")
            ]
        info["cpu"] = names[0] if names else platform.processor()
        with open("/proc/meminfo") as handle:
            info["memory_gib"] = round(int(handle.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["packages"] = package_versions()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


RECORDED_PACKAGES = (
    "torch", "transformers", "megatron-core", "sglang", "sglang-router", "msgspec", "pyzmq",
)  # fmt: skip


def package_versions() -> dict[str, str]:
    """The installed version of each package a result depends on (absent: not installed)."""
    from importlib import metadata

    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_commit() -> str:
    """HEAD (with `-dirty` for uncommitted changes), or `STREAMRL_COMMIT` when set: a copy
    of the tree on another machine may carry a stale `.git`."""
    if os.environ.get("STREAMRL_COMMIT"):
        return os.environ["STREAMRL_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("STREAMRL_COMMIT", "unknown")


def write_result(
    path: str | Path,
    *,
    bench: str,
    config: dict[str, Any],
    result: dict[str, Any],
    plot: Callable[[dict[str, Any], Any], None] | None = None,
    num_panels: int | tuple[int, int] = 1,
) -> Path:
    """Write `path` (JSON) and, with `plot`, the PNG beside it; returns the JSON path.

    `plot(result, ax)` draws on one axes; with `num_panels` > 1 (side by side) or
    (rows, columns) it gets a flat list of that many axes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": bench,
        "commit": git_commit(),
        "command": " ".join(["streamrl", *sys.argv[1:]]) if sys.argv else "",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": config,
        "result": result,
    }
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows, columns = num_panels if isinstance(num_panels, tuple) else (1, num_panels)
        width = 7.0 if rows * columns == 1 else 6.5 * columns
        fig, axes = plt.subplots(rows, columns, figsize=(width, 4.5 * rows), squeeze=False)
        flat = [ax for row in axes for ax in row]
        plot(result, flat if len(flat) > 1 else flat[0])
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return path
