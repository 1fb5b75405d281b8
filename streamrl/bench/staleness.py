"""`streamrl bench staleness`: effective training throughput and learning against eta.

For each max_staleness eta (`auto` included: the learner's own bound,
`streamrl.actors.auto_staleness`), each off-policy correction asked for and each seed,
the same config runs `--steps` steps in its own output directory under the work dir,
each in its own process (`runs.run_observed`). Reported per run:

- effective training throughput: response tokens trained per second over the
  window (steps 2..N by default, see `streamrl.bench.runs`), AReaL's measure;
- generation throughput: tokens the engines generated per second in that window
  (engine-side counter, so it includes groups generated but not yet trained);
- learner idle share (waiting for a batch) and engine idle share (engine thread
  not stepping: nothing to run, or paused for a weight update);
- the staleness histogram of trained groups, the reward curve (mean reward of each
  trained batch against samples trained and against time) with each step's off-policy
  diagnostics and bound, and the run's evaluations.

Per setting (eta, correction) over its seeds (`settings` in the result): the mean, min,
max and standard deviation of the final reward, of each evaluation (per version) and of
the throughput; the final reward and each evaluation against eta 0's; and the
throughput against two references: the fastest fixed eta, and the fastest fixed eta whose
final reward is within `REWARD_TOLERANCE` of eta 0's (`best_fixed_eta_within_reward`: the
bound a user who wants eta 0's learning would pick by hand); and samples/s against the
fixed eta with the most. Trained tokens/s follow the answer lengths each run's policy
settles on; with a fixed number of samples per step, samples/s do not.

The final reward is the mean reward of the last quarter's trained batches: the reward of
the behaviour policies that generated them, which at eta lag the learner by up to eta
versions. An evaluation at version v is the reward of the policy after v steps, whatever
eta: "reward after the same number of trained samples" without that lag.

eta = 0 runs once per seed, with the first correction: with no stale tokens every
correction is the same loss, so it is the shared on-policy baseline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.bench.results import write_result
from streamrl.bench.runs import RunSpec, run_observed, write_run_config
from streamrl.bench.staleness_plot import NUM_PANELS, eta_order, group_settings, plot_staleness

CORRECTION_OVERRIDES = {
    "decoupled_ppo": ["algorithm.off_policy_correction='decoupled_ppo'"],
    "tis": ["algorithm.off_policy_correction='tis'"],
    "none": ["algorithm.off_policy_correction='none'", "algorithm.allow_uncorrected_async=true"],
}

AUTO = "auto"
REWARD_TOLERANCE = 0.02
"""A fixed eta whose final reward is at most this far below eta 0's learns as eta 0 does."""
Eta = int | str
"""A fixed bound, or `AUTO`."""


def parse_int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_etas(text: str) -> list[Eta]:
    """`0,1,auto` -> [0, 1, "auto"]; ValueError naming a part that is neither."""
    etas: list[Eta] = []
    for part in (p.strip() for p in text.split(",")):
        if part == AUTO:
            etas.append(AUTO)
        elif part.isdigit():
            etas.append(int(part))
        elif part:
            raise ValueError(f"--eta: {part!r} is neither a non-negative integer nor {AUTO!r}")
    return etas


def run_name(eta: Eta, correction: str, seed: int | None) -> str:
    return f"eta{eta}-{correction}" + ("" if seed is None else f"-s{seed}")


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
    try:
        etas = parse_etas(args.eta)
        seeds: list[int | None] = [*parse_int_list(args.seeds)] or [None]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    for seed in seeds:
        for correction in corrections:
            for eta in etas:
                if eta == 0 and correction != corrections[0]:
                    continue  # the shared on-policy baseline ran already
                result = _one_run(args, work_dir, gpus, eta=eta, correction=correction, seed=seed)
                runs.append(result)
                print(_line(result), file=sys.stderr, flush=True)
                if args.json:  # after every run, so that a part cut short keeps what it measured
                    _write(args, work_dir, etas, corrections, runs)
    sweep = summarize_sweep(runs)
    best = max(runs, key=lambda r: r["effective_tokens_per_s"])
    baseline = sweep["baseline"]
    print(
        f"staleness: best {best['effective_tokens_per_s']:,.0f} trained tokens/s at eta "
        f"{best['eta']} ({best['correction']}); "
        + (f"eta 0: {baseline:,.0f}" if baseline is not None else "no eta 0 run")
    )
    return 0


def _one_run(args, work_dir: Path, gpus: GpuMonitor, *, eta: Eta, correction: str, seed):
    label = f"{correction}+{args.tag}" if args.tag else correction
    name = run_name(eta, label, seed)
    bound = f"buffer.max_staleness='{AUTO}'" if eta == AUTO else f"buffer.max_staleness={eta}"
    overrides = run_overrides(
        work_dir,
        name,
        args.steps,
        [
            *args.overrides,
            bound,
            "train.mode='async'",
            *CORRECTION_OVERRIDES[correction],
            *([] if seed is None else [f"train.seed={seed}"]),
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
        correction=label,
        seed=seed,
        final_reward=final_reward(result["reward_curve"]),
        mean_reward=final_reward(result["reward_curve"], fraction=1.0),
    )
    return result


def _write(args, work_dir: Path, etas, corrections, runs) -> None:
    import torch  # noqa: F401 - machine_info reports the GPUs torch sees

    write_result(
        args.json,
        bench="staleness",
        config={
            "config_file": args.config,
            "etas": etas,
            "corrections": corrections,
            "seeds": parse_int_list(args.seeds),
            "tag": args.tag,
            "steps": args.steps,
            "overrides": args.overrides,
            "resolved": _resolved(work_dir / f"{runs[0]['name']}.toml"),
        },
        result=summarize_sweep(runs),
        plot=plot_staleness,
        num_panels=NUM_PANELS,
    )


# ---------------------------------------------------------------- over seeds


def summarize_sweep(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The result: every run, eta 0's throughput, and each setting over its seeds (see the
    module docstring)."""
    settings = [_setting(key, members) for key, members in group_settings(runs).items()]
    zero = next((s for s in settings if s["eta"] == 0), None)
    for setting in settings:
        setting["final_reward_vs_eta0"] = _relative(setting, zero, "final_reward")
        setting["eval_vs_eta0"] = _eval_vs(setting, zero)
    fixed = [s for s in settings if s["eta"] != AUTO]
    best = _fastest(fixed)
    learns_as_eta0 = [
        s
        for s in fixed
        if s["final_reward_vs_eta0"] is not None and s["final_reward_vs_eta0"] >= -REWARD_TOLERANCE
    ]
    best_within = _fastest(learns_as_eta0)
    most_samples = _fastest(fixed, "samples_per_s")
    for setting in settings:
        setting["samples_per_s_vs_best_fixed"] = _relative(setting, most_samples, "samples_per_s")
        setting["tokens_per_s_vs_best_fixed"] = _relative(setting, best, "effective_tokens_per_s")
        setting["tokens_per_s_vs_best_fixed_within_reward"] = _relative(
            setting, best_within, "effective_tokens_per_s"
        )
    return {
        "runs": runs,
        "baseline": _baseline_throughput(runs),
        "best_fixed_eta": _key(best),
        "best_fixed_eta_within_reward": _key(best_within),
        "settings": settings,
    }


def _eval_vs(setting: dict[str, Any], zero: dict[str, Any] | None) -> dict[str, float]:
    """Per evaluated version both have: the setting's mean evaluation over eta 0's, minus 1."""
    if zero is None or "eval_by_version" not in setting or "eval_by_version" not in zero:
        return {}
    ours, theirs = setting["eval_by_version"], zero["eval_by_version"]
    return {
        version: ours[version]["mean"] / theirs[version]["mean"] - 1
        for version in ours
        if version in theirs and theirs[version]["mean"]
    }


def _fastest(
    settings: list[dict[str, Any]], field: str = "effective_tokens_per_s"
) -> dict[str, Any] | None:
    return max(settings, key=lambda s: s[field]["mean"], default=None)


def _key(setting: dict[str, Any] | None) -> Eta | None:
    """A reference setting's eta (its correction too when that is not decoupled PPO)."""
    if setting is None:
        return None
    correction = setting["correction"]
    return setting["eta"] if correction == "decoupled_ppo" else f"{setting['eta']}:{correction}"


def _relative(setting: dict[str, Any], reference: dict[str, Any] | None, field: str):
    """setting's mean of `field` over the reference's, minus 1 (None without either)."""
    if reference is None or field not in setting or field not in reference:
        return None
    base = reference[field]["mean"]
    return setting[field]["mean"] / base - 1 if base else None


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min, max and (population) standard deviation."""
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.pstdev(values),
    }


def _setting(key: tuple[Eta, str], members: list[dict[str, Any]]) -> dict[str, Any]:
    eta, correction = key
    out: dict[str, Any] = {
        "eta": eta,
        "correction": correction,
        "seeds": [r.get("seed") for r in members],
        "final_reward": spread([r["final_reward"] for r in members]),
        "mean_reward": spread([r["mean_reward"] for r in members]),
        "effective_tokens_per_s": spread([r["effective_tokens_per_s"] for r in members]),
        "samples_per_s": spread([r["samples_per_s"] for r in members]),
    }
    evals = [r["evals"] for r in members if r.get("evals")]
    if evals:
        dataset = next(k for k in evals[0][0] if k not in ("version", "time_s"))
        out["eval_dataset"] = dataset
        out["eval_first"] = spread([e[0][dataset] for e in evals])
        out["eval_last"] = spread([e[-1][dataset] for e in evals])
        out["eval_last_version"] = spread([e[-1]["version"] for e in evals])
        # Per version that every seed reached (a run cut short has fewer evaluations).
        shared = set.intersection(*({e["version"] for e in seed} for seed in evals))
        out["eval_by_version"] = {
            str(version): spread([_at(seed, version)[dataset] for seed in evals])
            for version in sorted(shared)
        }
    bounds = [p["bound"] for r in members for p in r["reward_curve"] if p.get("bound") is not None]
    if eta == AUTO and bounds:
        out["auto_bound"] = spread(bounds)
    return out


def _at(evals: list[dict[str, Any]], version: int) -> dict[str, Any]:
    return next(e for e in evals if e["version"] == version)


def _baseline_throughput(runs: list[dict[str, Any]]) -> float | None:
    """The on-policy (eta 0) runs' mean throughput; None when the sweep left eta 0 out."""
    zero = [r["effective_tokens_per_s"] for r in runs if r["eta"] == 0]
    return statistics.fmean(zero) if zero else None


def _resolved(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _percent(value: float | None) -> str:
    return "  n/a" if value is None else f"{100 * value:4.0f}%"


def _line(run: dict[str, Any]) -> str:
    generated = run.get("generated_tokens_per_s")
    return (
        f"  {run['name']:<26} {run['effective_tokens_per_s']:>10,.1f} trained tok/s  "
        f"gen {generated or 0:>10,.1f} tok/s  learner idle {_percent(run['learner_idle_frac'])}  "
        f"engine idle {_percent(run.get('engine_idle_frac'))}  "
        f"reward {run['final_reward']:.3f}  staleness {run['staleness_histogram']}"
    )


# ---------------------------------------------------------------- merge


def merge_command(args: argparse.Namespace) -> int:
    """`streamrl bench merge --json OUT IN.json ...`: one staleness result from several parts
    (runs by name, a later file winning; with `--pool` every run), summarised over seeds
    again and re-plotted."""
    import json

    records = [json.loads(Path(path).read_text()) for path in args.inputs]
    kinds = {record["bench"] for record in records}
    if kinds != {"staleness"}:
        print(f"error: merge takes staleness results only, got {sorted(kinds)}", file=sys.stderr)
        return 2
    try:
        keep = {str(eta) for eta in parse_etas(args.eta)} if args.eta else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    by_name: dict[str, dict[str, Any]] = {}
    for path, record in zip(args.inputs, records, strict=True):
        for run in record["result"]["runs"]:
            if keep is not None and str(run["eta"]) not in keep:
                continue
            name = run["name"]
            if args.pool and name in by_name:
                run = {**run, "name": f"{name}@{Path(path).stem}"}
            by_name[run["name"]] = run
    if not by_name:
        print("error: no run left to merge", file=sys.stderr)
        return 2
    first_correction = records[0]["config"]["corrections"][0]
    runs = sorted(
        by_name.values(),
        key=lambda r: (
            r.get("seed") is not None,
            r.get("seed") or 0,
            r["correction"] != first_correction,
            eta_order(r["eta"]),
        ),
    )
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
    config["etas"] = sorted({r["eta"] for r in runs}, key=eta_order)
    config["corrections"] = list(dict.fromkeys(r["correction"] for r in runs))
    config["seeds"] = sorted({r["seed"] for r in runs if r.get("seed") is not None})
    write_result(
        args.json,
        bench="staleness",
        config=config,
        result=summarize_sweep(runs),
        plot=plot_staleness,
        num_panels=NUM_PANELS,
    )
    print(f"merge: {len(runs)} runs into {args.json}")
    return 0
