"""The plot of `streamrl bench staleness`: eight panels, each setting (eta, correction) one
colour and line style, means over seeds with their min-max band where there are several.

    throughput per setting     idle and busy shares     staleness histogram   auto's bound
    reward vs samples trained  reward vs time           mismatch KL per step  importance ESS
"""

from __future__ import annotations

import statistics
from typing import Any

NUM_PANELS = (2, 4)

REASON_MARKERS = {1: "^", -1: "v"}
"""Markers of the auto bound's changes: raised, lowered."""


def eta_order(eta) -> float:
    """Fixed bounds in order, `auto` after them."""
    return float("inf") if eta == "auto" else float(eta)


def group_settings(runs: list[dict[str, Any]]) -> dict[tuple[Any, str], list[dict[str, Any]]]:
    """Runs by (eta, correction), fixed bounds in order then `auto`, first correction first."""
    corrections = list(dict.fromkeys(r["correction"] for r in runs))
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for run in sorted(
        runs, key=lambda r: (corrections.index(r["correction"]), eta_order(r["eta"]))
    ):
        groups.setdefault((run["eta"], run["correction"]), []).append(run)
    return groups


def plot_staleness(result: dict[str, Any], axes) -> None:
    settings = group_settings(result["runs"])
    corrections = list(dict.fromkeys(correction for _, correction in settings))
    styles = {c: s for c, s in zip(corrections, ["-", "--", ":"], strict=False)}
    etas = sorted({eta for eta, _ in settings}, key=eta_order)
    colors = {eta: f"C{i}" for i, eta in enumerate(etas)}

    def label(key) -> str:
        eta, correction = key
        return f"eta {eta}" + (f", {correction}" if len(corrections) > 1 and eta != 0 else "")

    def draw(key) -> dict[str, Any]:
        return {"color": colors[key[0]], "linestyle": styles[key[1]], "label": label(key)}

    throughput, shares, histogram, bound, by_samples, by_time, kl, ess = axes
    _throughput(throughput, settings, corrections, etas)
    _shares(shares, settings, corrections[0], etas)
    _histogram(histogram, settings, corrections[0], colors)
    _bounds(bound, settings, colors)
    for key, members in settings.items():
        _curve(by_samples, members, "samples_trained", "reward_mean", draw(key))
        _curve(by_time, members, "time_s", "reward_mean", draw(key))
        _curve(kl, members, "step", "mismatch_kl", draw(key))
        _curve(ess, members, "step", "importance_ess", draw(key))
    for ax, x_label, y_label, title in (
        (by_samples, "samples trained", "mean reward of the trained batch", "Learning at equal samples"),
        (by_time, "seconds since the run started", "mean reward of the trained batch", "Learning against time"),
        (kl, "step", "nats per token", "Behaviour-to-proximal KL (train/mismatch_kl)"),
        (ess, "step", "normalised ESS", "Importance weights' effective sample size"),
    ):  # fmt: skip
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _throughput(ax, settings, corrections, etas) -> None:
    x = {eta: i for i, eta in enumerate(etas)}
    for correction in corrections:
        keys = [key for key in settings if key[1] == correction]
        values = [[r["effective_tokens_per_s"] for r in settings[key]] for key in keys]
        ax.errorbar(
            [x[key[0]] for key in keys],
            [_mean(v) for v in values],
            yerr=[
                [_mean(v) - min(v) for v in values],
                [max(v) - _mean(v) for v in values],
            ],
            fmt="o-" if correction == corrections[0] else "^:",
            capsize=3,
            label=f"trained, {correction}",
        )
    first = [key for key in settings if key[1] == corrections[0]]
    generated = [
        _mean([r.get("generated_tokens_per_s") or 0.0 for r in settings[k]]) for k in first
    ]
    ax.plot([x[k[0]] for k in first], generated, "s--", label="generated (engines)")
    ax.set_xticks(range(len(etas)), [str(e) for e in etas])
    ax.set_xlabel("max staleness eta")
    ax.set_ylabel("tokens per second")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput (mean over seeds, min-max)")
    ax.legend(fontsize=8)


def _shares(ax, settings, correction, etas) -> None:
    keys = [key for key in settings if key[1] == correction]
    shares = [
        ("learner idle", [_mean([r["learner_idle_frac"] for r in settings[k]]) for k in keys]),
        (
            "engine idle",
            [_mean([r.get("engine_idle_frac") or 0.0 for r in settings[k]]) for k in keys],
        ),
    ]
    if all(r.get("gpu_busy") for k in keys for r in settings[k]):  # nvidia-smi's busy share
        shares.append(
            (
                "GPU busy",
                [_mean([_mean(list(r["gpu_busy"].values())) for r in settings[k]]) for k in keys],
            )
        )
    width = 0.8 / len(shares)
    positions = list(range(len(keys)))
    for index, (name, values) in enumerate(shares):
        offset = (index - (len(shares) - 1) / 2) * width
        ax.bar([i + offset for i in positions], [100 * v for v in values], width=width, label=name)
    ax.set_xticks(positions, [str(k[0]) for k in keys])
    ax.set_xlabel("max staleness eta")
    ax.set_ylabel("% of the window")
    ax.set_ylim(0, 100)
    ax.set_title(f"Idle and busy time ({correction})")
    ax.legend(fontsize=8)


def _histogram(ax, settings, correction, colors) -> None:
    keys = [key for key in settings if key[1] == correction]
    bar = 0.8 / max(len(keys), 1)
    top = 0
    for index, key in enumerate(keys):
        counts: dict[int, int] = {}
        for run in settings[key]:
            for k, v in run["staleness_histogram"].items():
                counts[int(k)] = counts.get(int(k), 0) + v
        total = sum(counts.values()) or 1
        top = max(top, *counts) if counts else top
        offset = (index - (len(keys) - 1) / 2) * bar
        ax.bar(
            [k + offset for k in sorted(counts)],
            [counts[k] / total for k in sorted(counts)],
            width=bar,
            color=colors[key[0]],
            label=f"eta {key[0]}",
        )
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness of trained groups (versions)")
    ax.set_ylabel("share of trained groups")
    ax.set_title("Staleness distribution")
    ax.legend(fontsize=8)


def _fading(index: int, count: int) -> float:
    """Opacity of the index-th of `count` lines drawn over one another: 1.0 down to 0.25."""
    return 1.0 - 0.75 * index / max(count - 1, 1)


def _bounds(ax, settings, colors) -> None:
    """Each auto run's bound per step, its raises and lowerings marked; fixed bounds dotted."""
    for (eta, correction), members in settings.items():
        if eta != "auto":
            ax.axhline(eta, color=colors[eta], linestyle=":", linewidth=0.8)
            continue
        for index, run in enumerate(members):
            points = [p for p in run["reward_curve"] if p.get("bound") is not None]
            name = f"auto, {correction}" + (
                f", seed {run['seed']}" if run.get("seed") is not None else ""
            )
            ax.step([p["step"] for p in points], [p["bound"] for p in points], where="post",
                    color=colors[eta], alpha=_fading(index, len(members)), label=name)  # fmt: skip
            for change, marker in REASON_MARKERS.items():
                marked = [p for p in points if p.get("auto_change") == change]
                ax.plot([p["step"] for p in marked], [p["bound"] for p in marked], marker,
                        color="black", markersize=6, linestyle="none")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("staleness bound in force")
    ax.set_title("auto: bound per step (^ raised: learner waits; v lowered)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _curve(ax, members, x_key: str, y_key: str, style: dict[str, Any]) -> None:
    """The mean over seeds at each step index (x: the mean of `x_key` there), with the
    seeds' min-max band when there are several; steps without the value are left out."""
    length = min(len(r["reward_curve"]) for r in members)
    xs, means, lows, highs = [], [], [], []
    for i in range(length):
        points = [r["reward_curve"][i] for r in members]
        values = [p.get(y_key) for p in points]
        if any(v is None for v in values):
            continue
        xs.append(_mean([p[x_key] for p in points]))
        means.append(_mean(values))
        lows.append(min(values))
        highs.append(max(values))
    if not xs:
        return
    ax.plot(xs, means, linewidth=1.2, **style)
    if len(members) > 1:
        ax.fill_between(xs, lows, highs, color=style["color"], alpha=0.12)
