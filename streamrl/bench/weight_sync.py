"""`streamrl bench weight-sync`: what one weight update costs, for 1..N real engines.

For each LoRA rank r of `--lora-rank` (0, the default, is the full weights; r > 0 publishes
random rank-r adapters of `--lora-targets`, which the engines merge into their base
weights, as a LoRA run's updates do) and each engine count n: start n embedded engines
(`streamrl engine serve` processes, on GPUs 1..n with NCCL or on the CPU with gloo)
holding a random model of `--shape`; hold the same shape's weights in this process (the
learner's side, on `--learner-gpu` or the CPU); publish `1 + --repeats` versions
through the real `WeightPublisher` over the weight-update group, one after the
other. The first publish builds the group (its rendezvous is reported apart);
the others are timed:

- publish latency: `publish(v)` called until `on_published(v)` (every engine
  serves v);
- learner stall: until `publish` returns (snapshot of the weights into staging
  buckets, plus waiting for a previous broadcast: none here);
- engine pause: how long generation stood still: pause_generation until
  continue_generation (the whole broadcast and the in-place copy happen inside it);
  by reference (`--backend ipc`) to embedded engines, which are handed the update
  staged while they generate and load it at one step boundary with no pause call,
  the time that load took on the engine's thread, as the engine measured it;
- staging: by reference, handing the buckets over before any pause (the engine maps
  them and checks their digest, names and shapes);
- GB/s: bytes / (staging + broadcast time) (per receiver: a broadcast sends every
  byte to each).

With `--load-requests K`, K requests per engine keep generating during the
publishes, so the pause also waits for a step boundary. `--peak` adds the
link's two-rank broadcast peak (`streamrl bench collective`) to the result.
Engines on a GPU decode with CUDA graphs and compiled kernels, as in a run
(`--no-cuda-graphs`: eager, which starts faster but holds the GIL through each step, so
the engine's HTTP thread, which stages and loads the update, waits longer for it).
NCCL refuses two ranks on one GPU, so with NCCL n <= number of GPUs - 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from streamrl.bench.results import write_result

GB = 1e9


def parse_counts(text: str) -> list[int]:
    """'1..4' -> [1, 2, 3, 4]; '1,2,4' -> [1, 2, 4]."""
    if ".." in text:
        low, high = (int(part) for part in text.split(".."))
        return list(range(low, high + 1))
    return [int(part) for part in text.split(",") if part.strip()]


def weight_sync_command(args: argparse.Namespace) -> int:
    import torch

    from streamrl.models import save_random_model
    from streamrl.models.devices import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    learner_device = torch.device("cuda", args.learner_gpu) if device.type == "cuda" else device
    backend = (
        args.backend if args.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    )
    counts = parse_counts(args.engines)
    if args.engine_gpus:
        engine_gpus = [int(g) for g in args.engine_gpus.split(",")]
    elif device.type != "cuda":
        engine_gpus = []
    elif backend == "ipc":  # engines on the learner's own GPU
        engine_gpus = [args.learner_gpu] * max(counts)
    else:
        engine_gpus = [g for g in range(torch.cuda.device_count()) if g != args.learner_gpu]
    if backend == "nccl" and max(counts) > len(engine_gpus):
        print(
            f"error: NCCL needs one GPU per engine apart from the learner's; "
            f"{len(engine_gpus)} available for --engines {args.engines}",
            file=sys.stderr,
        )
        return 2
    work_dir = Path(args.work_dir).resolve()
    model_dir = work_dir / f"{args.shape}-model"
    if not (model_dir / "config.json").exists():
        save_random_model(args.shape, model_dir, seed=0)
    if learner_device.type == "cuda":
        torch.cuda.set_device(learner_device)
    full_weights = _learner_weights(model_dir, learner_device, dtype)
    full_bytes = sum(t.numel() * t.element_size() for _, t in full_weights)
    lora_ranks = [int(part) for part in args.lora_rank.split(",") if part.strip()]
    targets = tuple(part for part in args.lora_targets.split(",") if part.strip())
    setup = {
        "shape": args.shape,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "bucket_mb": args.bucket_mb,
        "flattened": not args.per_tensor,
        "pause_mode": args.pause_mode,
        "cuda_graphs": args.cuda_graphs,
        "repeats": args.repeats,
        "load_requests": args.load_requests,
        "learner_device": str(learner_device),
        "engine_gpus": engine_gpus,
        "num_tensors": len(full_weights),
        "bytes": full_bytes,
        "lora_ranks": lora_ranks,
        "lora_targets": list(targets),
    }
    rows = []
    for rank in lora_ranks:
        weights = full_weights if rank == 0 else adapter_weights(full_weights, rank, targets)
        num_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        for count in counts:
            row = anyio.run(_measure, args, setup, model_dir, weights, count, work_dir, num_bytes)
            row.update(lora_rank=rank, bytes=num_bytes, num_tensors=len(weights))
            rows.append(row)
            what = f"rank-{rank} adapters" if rank else "full weights"
            print(
                f"  {what}, {num_bytes / 1e6:,.1f} MB, {count} engine(s): publish "
                f"{row['publish_s_mean'] * 1e3:,.1f} ms, stall "
                f"{row['learner_stall_s_mean'] * 1e3:,.1f} ms, pause "
                f"{row['engine_pause_s_mean'] * 1e3:,.1f} ms, {row['gb_per_s_mean']:.2f} GB/s"
                + _parts_line("staging", row["staging_parts_mean"])
                + _parts_line("send", row["send_parts_mean"]),
                file=sys.stderr,
                flush=True,
            )
    result: dict[str, Any] = {"setup": setup, "engines": rows}
    if args.peak or args.peak_from:
        from streamrl.bench.collective import measure_peak, peak_gib_per_s

        if args.peak_from:
            peaks = json.loads(Path(args.peak_from).read_text())["result"]["runs"]
        else:
            gpus = (args.learner_gpu, engine_gpus[0]) if backend == "nccl" else (0, 1)
            peaks = [measure_peak(backend, gpus=gpus, log_dir=work_dir)]
        result["peak"] = peaks
        result["peak_broadcast_gb_per_s"] = max(peak_gib_per_s(p) for p in peaks) * 2**30 / GB
    last = rows[-1]
    line = (
        f"weight-sync ({args.shape}, {last['bytes'] / GB:.3f} GB, {backend}): "
        f"{last['gb_per_s_mean']:.2f} GB/s to {last['num_engines']} engine(s), "
        f"pause {last['engine_pause_s_mean'] * 1e3:,.0f} ms, "
        f"stall {last['learner_stall_s_mean'] * 1e3:,.0f} ms"
    )
    if len(lora_ranks) > 1 or lora_ranks != [0]:
        line += "; publish " + ", ".join(
            f"{'full' if row['lora_rank'] == 0 else 'rank ' + str(row['lora_rank'])} "
            f"{row['publish_s_mean'] * 1e3:,.1f} ms ({row['bytes'] / 1e6:,.1f} MB)"
            for row in rows
            if row["num_engines"] == last["num_engines"]
        )
    if "peak_broadcast_gb_per_s" in result:
        line += f"; link peak {result['peak_broadcast_gb_per_s']:.2f} GB/s"
    print(line)
    if args.json:
        write_result(
            args.json,
            bench="weight-sync",
            config=setup,
            result=result,
            plot=plot_weight_sync,
            num_panels=2,
        )
    return 0


def adapter_weights(
    full: list[tuple[str, Any]], rank: int, targets: tuple[str, ...], *, seed: int = 0
) -> list[tuple[str, Any]]:
    """Random rank-`rank` LoRA adapters of the `targets` linears of `full` (HF names), as a
    LoRA learner publishes them (`streamrl.weights.adapters`): what the engines merge."""
    import torch

    from streamrl.weights.adapters import LORA_A, LORA_B

    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in full:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        rows, cols = tensor.shape
        for suffix, shape in ((LORA_A, (rank, cols)), (LORA_B, (rows, rank))):
            values = torch.randn(shape, generator=generator) * 0.01
            out.append((module + suffix, values.to(device=tensor.device, dtype=tensor.dtype)))
    if not out:
        raise ValueError(f"--lora-targets {','.join(targets)} match no linear of the model")
    return out


def _learner_weights(model_dir: Path, device, dtype) -> list[tuple[str, Any]]:
    """The model's parameters under HF names (a tied head once, as the embedding), as a
    learner backend's `hf_weights` yields them."""
    from streamrl.models import load_causal_lm

    model = load_causal_lm(str(model_dir), device=str(device), dtype=dtype)
    return [(name, parameter.detach()) for name, parameter in model.named_parameters()]


async def _measure(
    args, setup, model_dir, weights, count: int, work_dir: Path, num_bytes: int
) -> dict[str, Any]:
    from streamrl.fleet.client import EngineClient
    from streamrl.publish.factory import tensor_transport
    from streamrl.publish.publisher import WeightPublisher

    engines = _start_engines(args, setup, model_dir, count, work_dir)
    clients = [EngineClient(url) for url, _ in engines]
    landed: dict[int, float] = {}
    landed_event = anyio.Event()

    async def on_published(version: int) -> None:
        nonlocal landed_event
        landed[version] = time.perf_counter()
        landed_event.set()
        landed_event = anyio.Event()

    publisher = WeightPublisher(
        weights=lambda: iter(weights),
        members=lambda: clients,
        on_published=on_published,
        transport=tensor_transport(
            setup["backend"], members=lambda: clients, flattened=not args.per_tensor
        ),
        bucket_bytes=args.bucket_mb * 2**20,
        pause_mode=args.pause_mode,
        staging_device=setup["learner_device"] if setup["backend"] != "gloo" else "cpu",
    )
    samples = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(publisher.run)
            for client in clients:
                for index in range(args.load_requests):
                    tg.start_soon(_keep_generating, client, index)
            tokens_before = sum([(await c.load())["generated_tokens"] for c in clients])
            for version in range(1, args.repeats + 2):
                started = time.perf_counter()
                event = landed_event
                await publisher.publish(version)
                while version not in landed:
                    await event.wait()
                    event = landed_event
                record = publisher.records[-1]
                if not record.ok:
                    raise RuntimeError(f"publish of version {version} failed (see the engine logs)")
                samples.append({"publish_s": landed[version] - started, **record.as_metrics()})
            versions = [await client.weight_version() for client in clients]
            tokens_during = sum([(await c.load())["generated_tokens"] for c in clients])
            tokens_during -= tokens_before
            tg.cancel_scope.cancel()
    finally:
        for client in clients:
            await client.aclose()
        _stop_engines(engines)
    if versions != [args.repeats + 1] * count:
        raise RuntimeError(f"engines report versions {versions}, expected {args.repeats + 1}")
    timed = samples[1:]

    def mean(key: str) -> float:
        return sum(sample[key] for sample in timed) / len(timed)

    def median(key: str) -> float:
        return statistics.median(sample[key] for sample in timed)

    def parts_mean(prefix: str) -> dict[str, float]:
        """The mean of every `prefix` metric that each timed publish has, by part name."""
        return {
            key.removeprefix(prefix): mean(key)
            for key in timed[0]
            if key.startswith(prefix) and all(key in sample for sample in timed)
        }

    return {
        "num_engines": count,
        "first_publish_s": samples[0]["publish_s"],
        "generated_tokens_during": tokens_during,
        "publish_s_mean": mean("publish_s"),
        "publish_s_min": min(sample["publish_s"] for sample in timed),
        "learner_stall_s_mean": mean("weights/learner_stall_s"),
        "snapshot_s_mean": mean("weights/snapshot_s"),
        "engine_pause_s_mean": mean("weights/engine_pause_s"),
        "staging_s_mean": mean("weights/staging_s"),
        "broadcast_s_mean": mean("weights/broadcast_s"),
        "gb_per_s_mean": num_bytes / (mean("weights/staging_s") + mean("weights/broadcast_s")) / GB,
        "staging_parts_mean": parts_mean("weights/staging/"),
        "send_parts_mean": parts_mean("weights/send/"),
        "median": {
            "publish_s": median("publish_s"),
            "learner_stall_s": median("weights/learner_stall_s"),
            "engine_pause_s": median("weights/engine_pause_s"),
            "staging_s": median("weights/staging_s"),
            "broadcast_s": median("weights/broadcast_s"),
            "gb_per_s": statistics.median(sample["weights/gb_per_s"] for sample in timed),
        },
        "samples": samples,
    }


def _parts_line(what: str, parts: dict[str, float]) -> str:
    """'; staging: serialize 0.1 ms, request 30.2 ms, ...' (empty when nothing was measured)."""
    if not parts:
        return ""
    text = ", ".join(f"{key.removesuffix('_s')} {s * 1e3:,.1f} ms" for key, s in parts.items())
    return f"; {what}: {text}"


async def _keep_generating(client, index: int) -> None:
    """Keep one request in flight on `client` (load during the publishes)."""
    from streamrl.fleet.client import EngineError

    params = {"max_new_tokens": 64, "temperature": 1.0}
    while True:
        try:
            await client.generate([1, 2, 3, 4 + index], params)
        except EngineError:
            await anyio.sleep(0.05)


def _start_engines(args, setup, model_dir: Path, count: int, work_dir: Path):
    from streamrl.process import free_port, spawn, streamrl_argv, wait_http_ready

    engines = []
    for index in range(count):
        port = free_port()
        argv = streamrl_argv(
            "--log-level",
            "warning",
            "engine",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--device",
            setup["device"].split(":")[0],
            "--dtype",
            setup["dtype"],
            "--max-batch-size",
            "8",
            "--max-seq-len",
            "256",
            "--num-threads",
            "1",
            *(() if setup["cuda_graphs"] else ("--no-cuda-graphs", "--compile", "off")),
        )
        env = {}
        if setup["engine_gpus"]:
            env["CUDA_VISIBLE_DEVICES"] = str(setup["engine_gpus"][index])
        process = spawn(
            f"engine-{index}",
            argv,
            env=env,
            log_path=work_dir / "logs" / f"engines{count}-{index}.log",
        )
        engines.append((f"http://127.0.0.1:{port}", process))
    try:
        for url, process in engines:
            wait_http_ready(url, timeout_s=600, process=process)
    except BaseException:
        _stop_engines(engines)
        raise
    return engines


def _stop_engines(engines) -> None:
    for _, process in engines:
        process.signal(signal.SIGTERM)
    for _, process in engines:
        process.stop(timeout_s=30)


def plot_weight_sync(result: dict[str, Any], axes) -> None:
    time_ax, rate_ax = axes
    all_rows = result["engines"]
    ranks = sorted({row.get("lora_rank", 0) for row in all_rows})
    for rank in ranks:  # one set of lines per LoRA rank (0: the full weights)
        rows = [row for row in all_rows if row.get("lora_rank", 0) == rank]
        counts = [row["num_engines"] for row in rows]
        suffix = f" (rank-{rank} adapters)" if rank else ""
        for key, label in (
            ("publish_s_mean", "publish latency"),
            ("engine_pause_s_mean", "engine pause"),
            ("staging_s_mean", "staging (before any pause)"),
            ("broadcast_s_mean", "broadcast"),
            ("learner_stall_s_mean", "learner stall"),
        ):
            time_ax.plot(counts, [row[key] * 1e3 for row in rows], "o-", label=label + suffix)
    rows = [row for row in all_rows if row.get("lora_rank", 0) == ranks[0]]
    counts = [row["num_engines"] for row in rows]
    time_ax.set_xticks(counts)
    time_ax.set_xlabel("engines")
    time_ax.set_ylabel("ms per update")
    setup = result["setup"]
    time_ax.set_title(
        f"{setup['shape']} ({setup['bytes'] / GB:.2f} GB {setup['dtype']}), {setup['backend']}"
    )
    time_ax.legend(fontsize=8)
    rate_ax.bar(
        [str(c) for c in counts],
        [row["gb_per_s_mean"] for row in rows],
        color="tab:blue",
        label="weight broadcast",
    )
    if "peak_broadcast_gb_per_s" in result:
        rate_ax.axhline(
            result["peak_broadcast_gb_per_s"],
            color="tab:red",
            linestyle="--",
            label=f"two-rank broadcast peak {result['peak_broadcast_gb_per_s']:.1f}",
        )
    rate_ax.set_xlabel("engines")
    rate_ax.set_ylabel("GB/s per receiver")
    rate_ax.set_title("Broadcast bandwidth")
    rate_ax.legend(fontsize=8)
