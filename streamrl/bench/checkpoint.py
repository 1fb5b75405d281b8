"""`streamrl bench checkpoint`: what a checkpoint of the whole async state costs a running run.

    1. the config without checkpoints (`train.save_interval = 0`)
    2. the same config with a checkpoint every `--every` steps

Each checkpoint record of run 2 (`kind = "checkpoint"` in metrics.jsonl) gives:

    snapshot_s       the learner's request to the rollout's answer (the cut)
    rollout_pause_s  how long generation was held for it: every engine request aborted,
                     every call parked, the tokens read (then they go on from them)
    staging_s        the learner's copy of its weights and optimizer state
                     (`train.checkpoint_staging`)
    wait_previous_s  how long the learner waited for the previous checkpoint's write
    stall_s          all the learner stopped for: the wait, the cut and the copy
    write_s          the copy, async state and rng written in the background (training
                     and generation go on meanwhile)
    bytes            the checkpoint's size; async_state_bytes its async part alone

and the two runs' effective training throughput (`streamrl.bench.runs` for the
window) give what checkpoints cost overall: overhead = 1 - with / without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.bench.results import write_result
from streamrl.bench.runs import BenchError, RunSpec, run_observed, write_run_config
from streamrl.bench.staleness import run_overrides

RECORD_KEYS = (
    "snapshot_s",
    "rollout_pause_s",
    "staging_s",
    "wait_previous_s",
    "stall_s",
    "write_s",
    "bytes",
    "async_state_bytes",
    "buffered_groups",
    "in_flight_groups",
    "in_flight_samples",
    "in_flight_tokens",
)


def checkpoint_command(args: argparse.Namespace) -> int:
    if args.every < 1:
        raise SystemExit("bench checkpoint: --every must be at least 1")
    if args.steps < 2 * args.every:
        raise SystemExit(
            f"bench checkpoint: --steps {args.steps} leaves fewer than two checkpoints "
            f"at --every {args.every}"
        )
    with GpuMonitor() as gpus:
        return _checkpoint(args, gpus)


def _checkpoint(args: argparse.Namespace, gpus: GpuMonitor) -> int:
    work_dir = Path(args.work_dir).resolve()
    result: dict[str, Any] = {"every": args.every, "runs": {}}
    for name, interval in (("without", 0), ("with", args.every)):
        overrides = run_overrides(work_dir, name, args.steps, args.overrides)
        overrides.append(f"train.save_interval={interval}")  # after run_overrides' 0
        config_path = write_run_config(Path(args.config), overrides, work_dir / f"{name}.toml")
        spec = RunSpec(name, config_path, work_dir / name)
        run = run_observed(
            spec, timeout_s=args.run_timeout_s, log_level=args.run_log_level, gpus=gpus
        )
        run.pop("engine_readings", None)
        result["runs"][name] = run
        print(
            f"  {name} checkpoints: {run['effective_tokens_per_s']:,.1f} trained tok/s",
            file=sys.stderr,
            flush=True,
        )
    records = checkpoint_records(work_dir / "with")
    if not records:
        raise BenchError(f"the run with checkpoints wrote none ({work_dir / 'with'})")
    result["checkpoints"] = records
    result["summary"] = summarize_records(records)
    without = result["runs"]["without"]["effective_tokens_per_s"]
    with_ = result["runs"]["with"]["effective_tokens_per_s"]
    result["throughput_overhead"] = 1.0 - with_ / without if without else None
    _print(result)
    if args.json:
        write_result(
            args.json,
            bench="checkpoint",
            config={"config": args.config, "overrides": args.overrides, "steps": args.steps},
            result=result,
            plot=_plot,
            num_panels=2,
        )
    return 0


def checkpoint_records(run_dir: Path) -> list[dict[str, Any]]:
    """The `kind = "checkpoint"` records of a run, their `checkpoint/` keys unprefixed."""
    from streamrl.metrics import read_metrics

    return [
        {"step": r["step"], **{k: r.get(f"checkpoint/{k}") for k in RECORD_KEYS}}
        | {"complete": bool(r.get("checkpoint/complete"))}
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r.get("kind") == "checkpoint"
    ]


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max of each timing, the sizes, and how many cuts were complete."""
    out: dict[str, Any] = {"count": len(records), "complete": sum(r["complete"] for r in records)}
    keys = ("snapshot_s", "rollout_pause_s", "staging_s", "wait_previous_s", "stall_s", "write_s")
    for key in (*keys, "bytes", "in_flight_samples"):
        values = [r[key] for r in records if r[key] is not None]
        if values:
            out[key] = {"median": statistics.median(values), "max": max(values)}
    return out


def _print(result: dict[str, Any]) -> None:
    summary = result["summary"]
    ms = lambda key: 1000 * summary.get(key, {"median": 0.0})["median"]  # noqa: E731
    print(
        f"{summary['count']} checkpoints ({summary['complete']} complete cuts): "
        f"snapshot {ms('snapshot_s'):.1f} ms, generation held {ms('rollout_pause_s'):.1f} ms, "
        f"learner stalled {ms('stall_s'):.1f} ms (copy {ms('staging_s'):.1f} ms), "
        f"background write {ms('write_s'):.0f} ms, "
        f"{summary['bytes']['median'] / 2**20:.1f} MiB (medians); "
        f"throughput overhead {100 * (result['throughput_overhead'] or 0):.1f}%",
        file=sys.stderr,
    )
    print(json.dumps(summary, indent=2))


def _plot(result: dict[str, Any], axes) -> None:
    left, right = axes
    records = result["checkpoints"]
    steps = [r["step"] for r in records]
    width = 0.27
    for offset, key in ((-width, "snapshot_s"), (0.0, "stall_s"), (width, "write_s")):
        left.bar(
            [i + offset for i in range(len(steps))],
            [1000 * (r[key] or 0.0) for r in records],
            width,
            label=key,
        )
    left.set_xticks(range(len(steps)), [str(s) for s in steps])
    left.set_xlabel("checkpoint at step")
    left.set_ylabel("ms")
    left.set_yscale("log")
    left.set_title("each checkpoint")
    left.legend()
    runs = result["runs"]
    names = list(runs)
    right.bar(names, [runs[n]["effective_tokens_per_s"] for n in names])
    right.set_ylabel("trained tokens / s")
    overhead = result["throughput_overhead"]
    right.set_title(
        f"throughput without / with checkpoints (overhead {100 * (overhead or 0):.1f}%)"
    )
