"""One JSON of a `streamrl run` for issue 27's targets: python bench/gpu/fullsize_report.py
RUN_DIR --json OUT.json [--peak-flops 989e12].

From the run's metrics.jsonl, summary.json and config.toml: steps, trained and generated
tokens/s (the run's cumulative rates at its last step), learner MFU per step counting trained
tokens only (6 N x `train/trained_tokens` / `train_s` / peak, N the model's parameters,
`train_s` the whole step including its proximal and reference passes; the first step, which
compiles, is left out of the median), the engine pause of each weight update, the response
lengths, each engine's weight version per step as the publisher recorded it, and the measured
peak memory of each process (summary.json `memory`; a run killed outright has no
summary: the rest is still reported). The planner's side is
`streamrl check CONFIG --against RUN_DIR --json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

H200_BF16_DENSE_FLOPS = 989e12


def report(run_dir: Path, peak_flops: float) -> dict:
    from streamrl.config import load_config
    from streamrl.metrics import read_metrics
    from streamrl.planner.fit import shape_of

    cfg = load_config(run_dir / "config.toml", [])
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "kind" not in r]
    summary_file = run_dir / "summary.json"  # absent where the run was killed outright
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    num_parameters = shape_of(cfg.model.path).num_parameters()
    mfu = [
        6 * num_parameters * r["train/trained_tokens"] / r["train_s"] / peak_flops
        for r in steps
        if r.get("train_s") and r.get("train/trained_tokens")
    ]
    pauses = [r["weights/engine_pause_s"] for r in steps if "weights/engine_pause_s" in r]
    last = steps[-1] if steps else {}
    padding = {
        key: [r[key] for r in steps if key in r]
        for key in sorted({k for r in steps for k in r if "pack" in k or "token_efficiency" in k})
    }
    return {
        "run_dir": str(run_dir),
        "model": cfg.model.path,
        "num_parameters": num_parameters,
        "steps": len(steps),
        "error": summary.get("error"),
        "trained_tokens_per_s": last.get("throughput/trained_tokens_per_s"),
        "generated_tokens_per_s": last.get("throughput/generated_tokens_per_s"),
        "mfu_6n_trained_tokens": {
            "per_step": [round(m, 4) for m in mfu],
            "median_after_first": round(statistics.median(mfu[1:]), 4) if len(mfu) > 1 else None,
            "peak_flops": peak_flops,
        },
        "train_s": [r.get("train_s") for r in steps],
        "learner_idle_s": [r.get("learner_idle_s") for r in steps],
        "train_phases_s": {  # the step's passes (streamrl.backends.step), where recorded
            key: [r.get(key) for r in steps]
            for key in sorted({k for r in steps for k in r if _is_phase(k)})
        },
        "engine_pause_s": {
            "per_update": pauses,
            "median": statistics.median(pauses) if pauses else None,
        },
        "response_len_generated_mean": [r.get("response_len_generated_mean") for r in steps],
        "staleness_max": max((r["staleness_max"] for r in steps), default=None),
        "weights_version_per_step": [r.get("weights/version") for r in steps],
        "weights_num_engines": [r.get("weights/num_engines") for r in steps],
        "engine_versions_at_end": summary.get("engine_versions"),
        "packing": padding,  # per step: the learner's samples' tokens / computed tokens
        "token_efficiency_overall": _token_efficiency(steps),
        "memory": summary.get("memory"),
        "colocate": {
            key: [r[key] for r in steps if key in r]
            for key in sorted({k for r in steps for k in r if k.startswith("colocate/")})
        },
    }


def _is_phase(key: str) -> bool:
    return key.startswith("train/") and key.endswith("_s")


def _token_efficiency(steps: list[dict]) -> float | None:
    """Trained tokens over computed tokens summed over the run (each step's computed tokens
    are its trained tokens / `train/token_efficiency`)."""
    rows = [r for r in steps if r.get("train/token_efficiency") and r.get("train/trained_tokens")]
    if not rows:
        return None
    trained = sum(r["train/trained_tokens"] for r in rows)
    computed = sum(r["train/trained_tokens"] / r["train/token_efficiency"] for r in rows)
    return round(trained / computed, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_FLOPS)
    args = parser.parse_args()
    result = report(args.run_dir, args.peak_flops)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    mfu = result["mfu_6n_trained_tokens"]["median_after_first"]
    print(
        f"fullsize_report: {result['steps']} steps, MFU (6N, trained tokens) {mfu}, "
        f"trained {result['trained_tokens_per_s']} tok/s, generated "
        f"{result['generated_tokens_per_s']} tok/s, pause median "
        f"{result['engine_pause_s']['median']} s"
    )


if __name__ == "__main__":
    main()
