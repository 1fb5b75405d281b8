"""`streamrl bench collective`: the link's peak broadcast and all-gather bandwidth, two processes.

The reference for `weight-sync`'s GB/s: two ranks (`streamrl bench
collective-worker`), one per GPU with NCCL or two CPU processes with gloo, time
`broadcast` (rank 0 to rank 1) and `all_gather` over message sizes. Reported per
size, in GiB/s (2^30 bytes):

- broadcast algbw = message bytes / time;
- all_gather algbw = output bytes / time, busbw = algbw * (n - 1) / n (NCCL-tests'
  convention; n = 2 ranks, so busbw = algbw / 2).

`--isolate` gives each rank only its own GPU (CUDA_VISIBLE_DEVICES=<gpu>), the way
`streamrl run` starts engines; without it both ranks see both GPUs. Comparing the
two shows whether NCCL keeps its peer-to-peer path when devices are hidden.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from streamrl.bench.results import write_result

GIB = 2**30
DEFAULT_SIZES_MB = {"nccl": "1,16,256,1024", "gloo": "1,16,128"}


def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def measure_peak(
    backend: str,
    *,
    sizes_mb: str = "",
    gpus: tuple[int, int] = (0, 1),
    iterations: int = 5,
    isolate: bool = False,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Run two worker processes and return rank 0's measurements."""
    import tempfile

    from streamrl.process import free_port, spawn, streamrl_argv

    sizes = sizes_mb or DEFAULT_SIZES_MB[backend]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="streamrl-collective-") as tmp:
        out = Path(tmp) / "rank0.json"
        children = []
        for rank in range(2):
            env = {}
            if backend == "nccl":
                env["STREAMRL_BENCH_GPU"] = str(gpus[rank])
                if isolate:
                    env["CUDA_VISIBLE_DEVICES"] = str(gpus[rank])
                    env["STREAMRL_BENCH_GPU"] = "0"
            argv = streamrl_argv(
                "bench",
                "collective-worker",
                "--rank",
                str(rank),
                "--port",
                str(port),
                "--backend",
                backend,
                "--sizes-mb",
                sizes,
                "--iterations",
                str(iterations),
                "--out",
                str(out) if rank == 0 else "",
            )
            log_path = (log_dir or Path(tmp)) / f"collective-rank{rank}.log"
            children.append(spawn(f"collective-{rank}", argv, env=env, log_path=log_path))
        try:
            codes = [child.popen.wait(600) for child in children]
        finally:
            for child in children:
                child.stop()
        if any(codes) or not out.exists():
            tails = "\n".join(child.log_tail() for child in children)
            raise RuntimeError(f"collective workers failed ({codes}):\n{tails}")
        result = json.loads(out.read_text())
    result.update(backend=backend, isolate=isolate, gpus=list(gpus) if backend == "nccl" else [])
    return result


def worker_command(args: argparse.Namespace) -> int:
    """One rank: join a 2-rank group, time each collective at each size, rank 0 writes JSON."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("STREAMRL_BENCH_GPU", args.rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        rows = [
            _time_size(int(float(mb) * 2**20), device, args.iterations)
            for mb in args.sizes_mb.split(",")
        ]
    finally:
        dist.destroy_process_group()
    if args.out:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        Path(args.out).write_text(json.dumps({"device": name, "sizes": rows}, indent=2))
    return 0


def _time_size(num_bytes: int, device, iterations: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    numel = num_bytes // 2  # bfloat16
    message = torch.ones(numel, dtype=torch.bfloat16, device=device)
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device=device)
    gathered = torch.empty(numel // world * world, dtype=torch.bfloat16, device=device)

    def timed(call) -> float:
        call()  # warm-up (NCCL sets up channels on first use)
        _sync(device)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iterations):
            call()
        _sync(device)
        return (time.perf_counter() - started) / iterations

    broadcast_s = timed(lambda: dist.broadcast(message, src=0))
    gather_s = timed(lambda: dist.all_gather_into_tensor(gathered, shard))
    gather_algbw = gathered.numel() * 2 / gather_s / GIB
    return {
        "bytes": num_bytes,
        "broadcast_s": broadcast_s,
        "broadcast_gib_per_s": num_bytes / broadcast_s / GIB,
        "all_gather_s": gather_s,
        "all_gather_algbw_gib_per_s": gather_algbw,
        "all_gather_busbw_gib_per_s": gather_algbw * (world - 1) / world,
    }


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib_per_s(result: dict[str, Any]) -> float:
    """The best broadcast bandwidth over sizes (the link's usable peak for one sender)."""
    return max(row["broadcast_gib_per_s"] for row in result["sizes"])


def collective_command(args: argparse.Namespace) -> int:
    backend = resolve_backend(args.backend)
    gpus = tuple(int(g) for g in args.gpus.split(","))[:2]
    runs = [measure_peak(backend, sizes_mb=args.sizes_mb, gpus=gpus, iterations=args.iterations)]
    if backend == "nccl":
        runs.append(
            measure_peak(
                backend, sizes_mb=args.sizes_mb, gpus=gpus, iterations=args.iterations, isolate=True
            )
        )
    for run in runs:
        largest = run["sizes"][-1]
        print(
            f"collective ({backend}{', isolated GPUs' if run['isolate'] else ''}): broadcast "
            f"{largest['broadcast_gib_per_s']:.1f} GiB/s, all_gather busbw "
            f"{largest['all_gather_busbw_gib_per_s']:.1f} GiB/s at "
            f"{largest['bytes'] / 2**20:.0f} MiB",
            file=sys.stderr,
        )
    print(
        f"collective: peak broadcast {max(peak_gib_per_s(r) for r in runs):.2f} GiB/s ({backend})"
    )
    if args.json:
        import torch  # noqa: F401 - machine_info reports the GPUs torch sees

        write_result(
            args.json,
            bench="collective",
            config={
                "backend": backend,
                "sizes_mb": args.sizes_mb or DEFAULT_SIZES_MB[backend],
                "iterations": args.iterations,
            },
            result={"runs": runs},
            plot=plot_collective,
        )
    return 0


def plot_collective(result: dict[str, Any], ax) -> None:
    for run in result["runs"]:
        sizes = [row["bytes"] / 2**20 for row in run["sizes"]]
        suffix = " (isolated GPUs)" if run["isolate"] else ""
        ax.plot(
            sizes,
            [row["broadcast_gib_per_s"] for row in run["sizes"]],
            "o-",
            label=f"broadcast{suffix}",
        )
        ax.plot(
            sizes,
            [row["all_gather_busbw_gib_per_s"] for row in run["sizes"]],
            "s--",
            label=f"all_gather busbw{suffix}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("GiB/s")
    ax.set_title(f"Two-rank collectives ({result['runs'][0]['backend']})")
    ax.legend(fontsize=8)
