"""Plot a guess-the-number run: reward per training step and episode lengths.

    python examples/guess_number/plot.py runs/guess_number docs/guess_number_reward.png

Reads `metrics.jsonl` from the run directory and the episode log
(`rollout.generate_kwargs.episode_log`, by default `episodes.jsonl` beside the
metrics); prints the numbers it plots.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def moving_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(values))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--episodes", type=Path, help="episode log (default RUN_DIR/episodes.jsonl)"
    )
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in read_jsonl(args.run_dir / "metrics.jsonl") if "kind" not in r]
    episodes = read_jsonl(args.episodes or args.run_dir / "episodes.jsonl")
    x = [r["step"] for r in steps]
    rewards = [r["reward_mean"] for r in steps]
    smooth = moving_mean(rewards, args.window)
    by_version = collections.defaultdict(list)
    for episode in episodes:
        if episode["oldest_version"] is not None:
            by_version[episode["oldest_version"]].append(episode["reward"])
    versions = sorted(by_version)
    turns = collections.Counter(e["num_turns"] for e in episodes)

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    left.plot(x, rewards, "o", alpha=0.4, label="trained group (4 episodes)")
    left.plot(x, smooth, "-", label=f"moving mean ({args.window} steps)")
    left.set(xlabel="training step", ylabel="episode reward", title="Reward per step")
    left.legend()
    middle.plot(versions, [sum(by_version[v]) / len(by_version[v]) for v in versions], "o-")
    middle.set(
        xlabel="weight version of the episode's oldest token",
        ylabel="mean episode reward",
        title=f"All {len(episodes)} generated episodes",
    )
    right.bar(list(turns), [turns[t] for t in turns])
    right.set_xticks(range(1, max(turns, default=1) + 1))
    right.set(xlabel="model turns per episode", ylabel="episodes", title="Episode length")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)

    k = max(1, len(rewards) // 4)
    print(
        f"steps: {len(steps)}; reward mean of the first {k} steps {sum(rewards[:k]) / k:.3f}, "
        f"of the last {k} steps {sum(rewards[-k:]) / k:.3f}"
    )
    print("reward per step:", " ".join(f"{r:.3f}" for r in rewards))
    print(
        "episode reward by version:",
        " ".join(
            f"v{v}:{sum(by_version[v]) / len(by_version[v]):.3f}(n={len(by_version[v])})"
            for v in versions
        ),
    )
    print(
        "episode turns:",
        dict(sorted(turns.items())),
        f"({sum(c for t, c in turns.items() if t >= 10)} of {len(episodes)} with >= 10 turns)",
    )
    print("end reasons:", dict(collections.Counter(e["end_reason"] for e in episodes)))
    spans = collections.Counter(
        e["newest_version"] - e["oldest_version"] + 1
        for e in episodes
        if e["oldest_version"] is not None
    )
    print("versions spanned per episode:", dict(sorted(spans.items())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
