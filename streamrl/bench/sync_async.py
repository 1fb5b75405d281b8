"""`streamrl bench sync-vs-async`: the same config synchronous and asynchronous, and each stage alone.

    1. async run (eta from --eta or the config, at least 1), recording the batches it trains
    2. sync run (train.mode = "sync": generation and training alternate)
    3. generation alone (`stages.generation_only`), as many groups as the async run started
    4. training alone (`stages.replay` of the recorded batches, in a child process)

Reported: each run's effective training throughput (see `streamrl.bench.runs` for
the window), async / sync speedup, and pipeline efficiency =
async throughput / min(generation alone, training alone), all in response tokens
trained per second. A perfect pipeline hides the faster stage behind the slower one
(efficiency 1); weight updates, the learner's waits and the two stages competing for
the same devices lower it. The ideal sync throughput, 1 / (1/gen + 1/train), is
given for comparison.

Where `nvidia-smi` exists, every phase also reports each GPU's busy share over its
window (`gpu_monitor`). When learner and engines share a GPU, their kernels take
turns on it, and the stages' busy shares alone give the most both can reach
together: `shared_gpu_bound_tokens_per_s` (`gpu_monitor.shared_device_bound`),
with the async run's share of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from streamrl.bench.gpu_monitor import GpuMonitor, shared_device_bound
from streamrl.bench.results import write_result
from streamrl.bench.runs import BenchError, RunSpec, run_observed, write_run_config
from streamrl.bench.staleness import run_overrides


def sync_async_command(args: argparse.Namespace) -> int:
    with GpuMonitor() as gpus:
        return _sync_async(args, gpus)


def _sync_async(args: argparse.Namespace, gpus: GpuMonitor) -> int:
    from streamrl.config import load_config

    work_dir = Path(args.work_dir).resolve()
    base = load_config(args.config, args.overrides)
    eta = args.eta if args.eta >= 0 else max(base.buffer.start_staleness, 1)
    record_path = work_dir / "async-groups.msgpack"
    result: dict[str, Any] = {"eta": eta, "runs": {}, "speedup": None}
    runs = result["runs"]
    for mode in ("async", "sync"):
        overrides = run_overrides(
            work_dir,
            mode,
            args.steps,
            [*args.overrides, f"train.mode='{mode}'", f"buffer.max_staleness={eta}"],
        )
        config_path = write_run_config(Path(args.config), overrides, work_dir / f"{mode}.toml")
        spec = RunSpec(
            mode, config_path, work_dir / mode, record_path=record_path if mode == "async" else None
        )
        runs[mode] = run_observed(
            spec, timeout_s=args.run_timeout_s, log_level=args.run_log_level, gpus=gpus
        )
        print(
            f"  {mode}: {runs[mode]['effective_tokens_per_s']:,.1f} trained tok/s, "
            f"learner idle {runs[mode]['learner_idle_frac']:.0%}",
            file=sys.stderr,
            flush=True,
        )
        _save(args, work_dir, result)  # after every phase: a part cut short keeps what it has

    async_tps = runs["async"]["effective_tokens_per_s"]
    sync_tps = runs["sync"]["effective_tokens_per_s"]
    result["speedup"] = async_tps / sync_tps if sync_tps else None
    if not args.skip_stages:
        cfg = load_config(work_dir / "async.toml")
        model_path = _initial_model(work_dir / "async", cfg)
        generation = result["generation_alone"] = _generation_alone(
            cfg, work_dir, model_path, eta, args, gpus
        )
        _save(args, work_dir, result)
        training = result["training_alone"] = _training_alone(
            work_dir, model_path, record_path, args
        )
        training["gpu_busy"] = gpus.busy(*training["window_monotonic"])
        slowest = min(generation["trainable_tokens_per_s"], training["trained_tokens_per_s"])
        result.update(
            bottleneck_tokens_per_s=slowest,
            pipeline_efficiency=async_tps / slowest if slowest else None,
            ideal_sync_tokens_per_s=1.0
            / (1.0 / generation["trainable_tokens_per_s"] + 1.0 / training["trained_tokens_per_s"]),
        )
        result.update(_shared_gpu_bound(cfg, generation, training, async_tps))
    _save(args, work_dir, result)
    print(_summary_line(result))
    return 0


def _save(args: argparse.Namespace, work_dir: Path, result: dict[str, Any]) -> None:
    if not args.json:
        return
    import torch  # noqa: F401 - machine_info reports the GPUs torch sees

    write_result(
        args.json,
        bench="sync-vs-async",
        config={
            "config_file": args.config,
            "eta": result["eta"],
            "steps": args.steps,
            "overrides": args.overrides,
            "resolved": (work_dir / "async.toml").read_text(),
        },
        result=result,
        plot=plot_sync_async,
        num_panels=2,
    )


def _shared_gpu_bound(cfg, generation, training, async_tps: float) -> dict[str, Any]:
    """The time-slicing bound when learner and engines share exactly one GPU (else {})."""
    shared = cfg.learner_gpu_ids & cfg.engine_gpu_ids
    if len(shared) != 1 or cfg.engine.device == "cpu":
        return {}
    (gpu,) = shared
    generation_busy = generation.get("gpu_busy", {}).get(gpu)
    training_busy = training.get("gpu_busy", {}).get(gpu)
    if not generation_busy or not training_busy:
        return {}  # no nvidia-smi readings for that GPU
    bound = shared_device_bound(
        generation["trainable_tokens_per_s"],
        generation_busy,
        training["trained_tokens_per_s"],
        training_busy,
    )
    return {
        "shared_gpu": gpu,
        "shared_gpu_bound_tokens_per_s": bound,
        "async_share_of_shared_gpu_bound": async_tps / bound,
    }


def _initial_model(run_dir: Path, cfg) -> str:
    """The weights the async run started from (its `initial_model` for random models)."""
    initial = run_dir / "initial_model"
    return str(initial) if (initial / "config.json").exists() else cfg.model.path


def _generation_alone(
    cfg, work_dir: Path, model_path: str, eta: int, args, gpus: GpuMonitor
) -> dict[str, Any]:
    from streamrl.bench.phases import generation_only

    num_groups = args.steps * cfg.rollout.batch_size
    result = generation_only(
        cfg,
        run_dir=work_dir / "generation-alone",
        model_path=model_path,
        num_groups=num_groups,
        window=(eta + 1) * cfg.rollout.batch_size,
        timeout_s=args.run_timeout_s,
        gpus=gpus,
    )
    print(
        f"  generation alone: {result['trainable_tokens_per_s']:,.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _training_alone(work_dir: Path, model_path: str, record_path: Path, args) -> dict[str, Any]:
    from streamrl.process import spawn, streamrl_argv

    out = work_dir / "training-alone.json"
    out.unlink(missing_ok=True)
    child = spawn(
        "replay",
        streamrl_argv(
            "--log-level",
            args.run_log_level,
            "bench",
            "replay",
            str(work_dir / "async.toml"),
            "--groups",
            str(record_path),
            "--model",
            model_path,
            "--out",
            str(out),
        ),
        log_path=work_dir / "training-alone.log",
    )
    try:
        code = child.popen.wait(args.run_timeout_s)
    finally:
        child.stop()
    if code != 0 or not out.exists():
        raise BenchError(f"training alone failed (code {code}):\n{child.log_tail(40)}")
    result = json.loads(out.read_text())
    print(
        f"  training alone: {result['trained_tokens_per_s']:,.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _summary_line(result: dict[str, Any]) -> str:
    runs = result["runs"]
    line = (
        f"sync-vs-async (eta {result['eta']}): async {runs['async']['effective_tokens_per_s']:,.1f}"
        f" vs sync {runs['sync']['effective_tokens_per_s']:,.1f} trained tok/s "
        f"= {result['speedup']:.2f}x"
    )
    if "pipeline_efficiency" in result:
        line += (
            f"; generation alone {result['generation_alone']['trainable_tokens_per_s']:,.1f},"
            f" training alone {result['training_alone']['trained_tokens_per_s']:,.1f}; "
            f"pipeline efficiency {result['pipeline_efficiency']:.2f}"
        )
    if "shared_gpu_bound_tokens_per_s" in result:
        line += (
            f"; shared GPU {result['shared_gpu']}: bound {result['shared_gpu_bound_tokens_per_s']:,.1f}"
            f" tok/s, async at {result['async_share_of_shared_gpu_bound']:.2f} of it"
        )
    return line


def plot_sync_async(result: dict[str, Any], axes) -> None:
    bars_ax, time_ax = axes
    runs = result["runs"]
    bars = [
        ("sync", runs.get("sync", {}).get("effective_tokens_per_s"), "tab:gray"),
        (f"async (eta {result['eta']})", runs.get("async", {}).get("effective_tokens_per_s"),
         "tab:blue"),
        ("generation\nalone", result.get("generation_alone", {}).get("trainable_tokens_per_s"),
         "tab:green"),
        ("training\nalone", result.get("training_alone", {}).get("trained_tokens_per_s"),
         "tab:orange"),
    ]  # fmt: skip
    bars = [bar for bar in bars if bar[1] is not None]
    labels = [label for label, _, _ in bars]
    values = [value for _, value, _ in bars]
    colors = [color for _, _, color in bars]
    bars_ax.bar(labels, values, color=colors)
    for x, value in enumerate(values):
        bars_ax.annotate(f"{value:,.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    lines = [
        ("ideal_sync_tokens_per_s", "tab:gray", ":", "ideal sync 1/(1/gen+1/train)"),
        ("bottleneck_tokens_per_s", "tab:red", "--", "ideal async min(gen, train)"),
        ("shared_gpu_bound_tokens_per_s", "tab:purple", "-.",
         "one GPU, time-sliced: bound from busy shares"),
    ]  # fmt: skip
    drawn = [line for line in lines if result.get(line[0]) is not None]
    for key, color, style, label in drawn:
        bars_ax.axhline(result[key], color=color, linestyle=style, label=label)
    if drawn:
        bars_ax.legend(fontsize=8)
    title = (
        "partial result" if result["speedup"] is None else f"async/sync {result['speedup']:.2f}x"
    )
    if result.get("pipeline_efficiency") is not None:
        title += f", pipeline efficiency {result['pipeline_efficiency']:.2f}"
    bars_ax.set_title(title)
    bars_ax.set_ylabel("response tokens trained per second")

    for name, color in (("sync", "tab:gray"), ("async", "tab:blue")):
        if name not in runs:
            continue
        run = runs[name]
        names = ["learner idle", "learner training", "engine idle"]
        shares = [
            run["learner_idle_frac"],
            run["learner_train_frac"],
            run.get("engine_idle_frac") or 0.0,
        ]
        if run.get("gpu_busy"):  # the mean over GPUs, from nvidia-smi
            names.append("GPU busy")
            shares.append(sum(run["gpu_busy"].values()) / len(run["gpu_busy"]))
        offset = -0.2 if name == "sync" else 0.2
        time_ax.bar(
            [i + offset for i in range(len(names))], shares, width=0.4, color=color, label=name
        )
        time_ax.set_xticks(range(len(names)), names)
    time_ax.set_ylim(0, 1.05)
    time_ax.set_ylabel("share of the window")
    time_ax.set_title("Where the time goes")
    time_ax.legend(fontsize=8)
