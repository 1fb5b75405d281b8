"""`streamrl bench staleness`: effective training throughput and learning against eta.

For each max_staleness eta (and each off-policy correction asked for), the same
config runs `--steps` steps in its own output directory under the work dir,
each in its own process (`runs.run_observed`). Reported per run:

- effective training throughput: response tokens trained per second over the
  window (steps 2..N by default, see `streamrl.bench.runs`), AReaL's measure;
- generation throughput: tokens the engines generated per second in that window
  (engine-side counter, so it includes groups generated but not yet trained);
- learner idle share (waiting for a batch) and engine idle share (engine thread
  not stepping: nothing to run, or paused for a weight update);
- the staleness histogram of trained groups and the reward curve (mean reward of
  each trained batch against samples trained).

eta = 0 runs once, with the first correction: with no stale tokens every
correction is the same loss, so it is the shared on-policy baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.bench.results import write_result
from streamrl.bench.runs import RunSpec, run_observed, write_run_config

CORRECTION_OVERRIDES = {
    "decoupled_ppo": ["algorithm.off_policy_correction='decoupled_ppo'"],
    "tis": ["algorithm.off_policy_correction='tis'"],
    "none": ["algorithm.off_policy_correction='none'", "algorithm.allow_uncorrected_async=true"],
}


def parse_int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def run_overrides(work_dir: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    """Overrides every bench run gets: its own output dir, the step count, quiet logging."""
    return [
        *extra,
        f"train.steps={steps}",
        f"train.output_dir='{work_dir / name}'",
        "train.save_interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


def final_reward(curve: list[dict[str, Any]], fraction: float = 0.25) -> float:
    """Mean batch reward over the last `fraction` of steps (at least one)."""
    tail = curve[-max(1, round(len(curve) * fraction)) :]
    return sum(point["reward_mean"] for point in tail) / len(tail)


def staleness_command(args: argparse.Namespace) -> int:
    with GpuMonitor() as gpus:
        return _staleness(args, gpus)


def _staleness(args: argparse.Namespace, gpus: GpuMonitor) -> int:
    etas = parse_int_list(args.eta)
    corrections = [c.strip() for c in args.corrections.split(",") if c.strip()]
    unknown = [c for c in corrections if c not in CORRECTION_OVERRIDES]
    if unknown:
        print(
            f"error: unknown correction(s) {unknown}; use {list(CORRECTION_OVERRIDES)}",
            file=sys.stderr,
        )
        return 2
    work_dir = Path(args.work_dir).resolve()
    runs = []
    for correction in corrections:
        for eta in etas:
            if eta == 0 and correction != corrections[0]:
                continue  # the shared on-policy baseline ran already
            name = f"eta{eta}-{correction}"
            overrides = run_overrides(
                work_dir,
                name,
                args.steps,
                [
                    *args.overrides,
                    f"buffer.max_staleness={eta}",
                    "train.mode='async'",
                    *CORRECTION_OVERRIDES[correction],
                ],
            )
            config_path = write_run_config(Path(args.config), overrides, work_dir / f"{name}.toml")
            result = run_observed(
                RunSpec(name, config_path, work_dir / name),
                timeout_s=args.run_timeout_s,
                log_level=args.run_log_level,
                gpus=gpus,
            )
            result.update(
                eta=eta,
                correction=correction,
                final_reward=final_reward(result["reward_curve"]),
                mean_reward=final_reward(result["reward_curve"], fraction=1.0),
            )
            runs.append(result)
            print(_line(result), file=sys.stderr, flush=True)
            if args.json:  # after every run, so that a part cut short keeps what it measured
                _write(args, work_dir, etas, corrections, runs)
    summary = {"runs": runs, "baseline": _baseline_throughput(runs)}
    best = max(runs, key=lambda r: r["effective_tokens_per_s"])
    baseline = summary["baseline"]
    print(
        f"staleness: best {best['effective_tokens_per_s']:,.0f} trained tokens/s at eta "
        f"{best['eta']} ({best['correction']}); "
        + (f"eta 0: {baseline:,.0f}" if baseline is not None else "no eta 0 run")
    )
    return 0


def _write(args, work_dir: Path, etas, corrections, runs) -> None:
    import torch  # noqa: F401 - machine_info reports the GPUs torch sees

    write_result(
        args.json,
        bench="staleness",
        config={
            "config_file": args.config,
            "etas": etas,
            "corrections": corrections,
            "steps": args.steps,
            "overrides": args.overrides,
            "resolved": _resolved(work_dir / f"{runs[0]['name']}.toml"),
        },
        result={"runs": runs, "baseline": _baseline_throughput(runs)},
        plot=plot_staleness,
        num_panels=(2, 2),
    )


def _baseline_throughput(runs: list[dict[str, Any]]) -> float | None:
    """The on-policy (eta 0) run's throughput; None when the sweep left eta 0 out."""
    zero = [r["effective_tokens_per_s"] for r in runs if r["eta"] == 0]
    return zero[0] if zero else None


def _resolved(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _percent(value: float | None) -> str:
    return "  n/a" if value is None else f"{100 * value:4.0f}%"


def _line(run: dict[str, Any]) -> str:
    generated = run.get("generated_tokens_per_s")
    return (
        f"  {run['name']:<22} {run['effective_tokens_per_s']:>10,.1f} trained tok/s  "
        f"gen {generated or 0:>10,.1f} tok/s  learner idle {_percent(run['learner_idle_frac'])}  "
        f"engine idle {_percent(run.get('engine_idle_frac'))}  "
        f"reward {run['final_reward']:.3f}  staleness {run['staleness_histogram']}"
    )


# ---------------------------------------------------------------- merge


def merge_command(args: argparse.Namespace) -> int:
    """`streamrl bench merge --json OUT IN.json ...`: one staleness result from several parts
    (runs by name; a later file wins), re-plotted."""
    import json

    records = [json.loads(Path(path).read_text()) for path in args.inputs]
    kinds = {record["bench"] for record in records}
    if kinds != {"staleness"}:
        print(f"error: merge takes staleness results only, got {sorted(kinds)}", file=sys.stderr)
        return 2
    by_name: dict[str, dict[str, Any]] = {}
    for record in records:
        for run in record["result"]["runs"]:
            by_name[run["name"]] = run
    runs = sorted(
        by_name.values(),
        key=lambda r: (r["correction"] != records[0]["config"]["corrections"][0], r["eta"]),
    )
    summary = {"runs": runs, "baseline": _baseline_throughput(runs)}
    config = dict(records[0]["config"])
    config["merged_from"] = [
        {
            "path": str(path),
            "commit": record["commit"],
            "command": record["command"],
            "time": record["time"],
        }
        for path, record in zip(args.inputs, records, strict=True)
    ]
    config["etas"] = sorted({r["eta"] for r in runs})
    config["corrections"] = list(dict.fromkeys(r["correction"] for r in runs))
    write_result(
        args.json,
        bench="staleness",
        config=config,
        result=summary,
        plot=plot_staleness,
        num_panels=(2, 2),
    )
    print(f"merge: {len(runs)} runs into {args.json}")
    return 0


# ---------------------------------------------------------------- plot


def plot_staleness(result: dict[str, Any], axes) -> None:
    runs = result["runs"]
    corrections = list(dict.fromkeys(r["correction"] for r in runs))
    throughput_ax, idle_ax, reward_ax, hist_ax = axes
    first = [r for r in runs if r["correction"] == corrections[0]]
    etas = [r["eta"] for r in first]
    colors = {eta: f"C{i}" for i, eta in enumerate(sorted({r["eta"] for r in runs}))}
    x = list(range(len(first)))

    throughput_ax.plot(
        x, [r["effective_tokens_per_s"] for r in first], "o-", label="trained (effective)"
    )
    throughput_ax.plot(
        x, [r.get("generated_tokens_per_s") or 0 for r in first], "s--", label="generated (engines)"
    )
    for correction in corrections[1:]:
        others = [r for r in runs if r["correction"] == correction]
        throughput_ax.plot(
            [etas.index(r["eta"]) for r in others if r["eta"] in etas],
            [r["effective_tokens_per_s"] for r in others if r["eta"] in etas],
            "^:",
            label=f"trained, {correction}",
        )
    throughput_ax.set_xticks(x, [str(e) for e in etas])
    throughput_ax.set_xlabel("max staleness eta")
    throughput_ax.set_ylabel("tokens per second")
    throughput_ax.set_ylim(bottom=0)
    throughput_ax.set_title(f"Throughput ({corrections[0]})")
    throughput_ax.legend(fontsize=8)

    shares = [
        ("learner idle", [r["learner_idle_frac"] for r in first]),
        ("engine idle", [r.get("engine_idle_frac") or 0.0 for r in first]),
    ]
    if all(r.get("gpu_busy") for r in first):  # GPU runs: nvidia-smi's busy share, mean of GPUs
        shares.append(
            ("GPU busy", [sum(r["gpu_busy"].values()) / len(r["gpu_busy"]) for r in first])
        )
    width = 0.8 / len(shares)
    for index, (label, values) in enumerate(shares):
        offset = (index - (len(shares) - 1) / 2) * width
        idle_ax.bar([i + offset for i in x], [100 * v for v in values], width=width, label=label)
    idle_ax.set_xticks(x, [str(e) for e in etas])
    idle_ax.set_xlabel("max staleness eta")
    idle_ax.set_ylabel("% of the window")
    idle_ax.set_ylim(0, 100)
    idle_ax.set_title("Idle time" if len(shares) == 2 else "Idle and busy time")
    idle_ax.legend(fontsize=8)

    styles = {c: s for c, s in zip(corrections, ["-", "--", ":"], strict=False)}
    for run in runs:
        curve = run["reward_curve"]
        label = f"eta {run['eta']}"
        if run["eta"] and len(corrections) > 1:
            label += f", {run['correction']}"
        reward_ax.plot(
            [p["samples_trained"] for p in curve],
            [p["reward_mean"] for p in curve],
            styles[run["correction"]],
            color=colors[run["eta"]],
            label=label,
            linewidth=1.2,
        )
    reward_ax.set_xlabel("samples trained")
    reward_ax.set_ylabel("mean reward of the trained batch")
    reward_ax.set_title("Learning at equal samples")
    reward_ax.legend(fontsize=7, ncol=2)

    bar = 0.8 / max(len(first), 1)
    for index, run in enumerate(first):
        histogram = {int(k): v for k, v in run["staleness_histogram"].items()}
        total = sum(histogram.values()) or 1
        keys = sorted(histogram)
        offset = (index - (len(first) - 1) / 2) * bar
        hist_ax.bar(
            [k + offset for k in keys],
            [histogram[k] / total for k in keys],
            width=bar,
            color=colors[run["eta"]],
            label=f"eta {run['eta']}",
        )
    top = max((int(k) for r in first for k in r["staleness_histogram"]), default=0)
    hist_ax.set_xticks(range(top + 1))
    hist_ax.set_xlabel("staleness of trained groups (versions)")
    hist_ax.set_ylabel("share of trained groups")
    hist_ax.set_title("Staleness distribution")
    hist_ax.legend(fontsize=8)
