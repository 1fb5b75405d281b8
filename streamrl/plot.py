"""`streamrl plot RUN_DIR`: the reward curve of a run (and its eval points) as a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from streamrl.metrics import read_metrics


def plot_run(run_dir: Path, out: Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "kind" not in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(
        [r["step"] for r in steps],
        [r["reward_mean"] for r in steps],
        marker="o",
        label="train reward (mean of the step's samples)",
    )
    for name in sorted({r["dataset"] for r in evals}):
        points = [r for r in evals if r["dataset"] == name]
        ax.plot(
            [r["version"] for r in points],
            [r[f"eval/{name}/reward_mean"] for r in points],
            marker="s",
            linestyle="--",
            label=f"eval {name} (at version = step)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    minutes = steps[-1]["time"] / 60 if steps else 0
    ax.set_title(title or f"{run_dir.name}: {len(steps)} steps in {minutes:.1f} min")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_command(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "reward.png"
    print(plot_run(run_dir, out, title=args.title))
    return 0
