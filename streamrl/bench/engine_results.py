"""What `streamrl bench engine` makes of its rounds: the median round per (engine, count),
the ratios between engines, the printed lines and the figure."""

from __future__ import annotations

import statistics
from typing import Any


def round_line(measured: dict[str, Any]) -> str:
    ttft = measured.get("ttft_s_median")
    line = f"{measured['tokens_per_s']:,.0f} tok/s over {measured['wall_s']:.2f} s"
    if ttft is not None:
        line += f", TTFT median {ttft * 1e3:.0f} ms"
    if measured.get("gpu_busy"):
        line += f", GPU busy {next(iter(measured['gpu_busy'].values())):.0%}"
    return line


STEADY_TOLERANCE = 0.05
"""The first measured round within this share of the last: the warm-up reached steady state."""


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median tokens/s and the spread of every round's, the median round's other figures
    (the middle one by tokens/s; the lower middle of an even count), and the steady check."""
    rates = [r["tokens_per_s"] for r in rounds]
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    median = ordered[(len(ordered) - 1) // 2]
    middle = statistics.median(rates)
    first_over_last = rates[0] / rates[-1] if rates[-1] else float("nan")
    return {
        "tokens_per_s": middle,
        "tokens_per_s_all": rates,
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "spread": (max(rates) - min(rates)) / middle if middle else float("nan"),
        "first_over_last": first_over_last,
        "steady": abs(first_over_last - 1) <= STEADY_TOLERANCE,
        "ttft_s_median": median.get("ttft_s_median"),
        "gpu_busy": median.get("gpu_busy") or None,
        "engine_busy_share": median.get("engine_busy_share"),
        "median_round": median,
    }


def ratios(engines: dict[str, dict], counts: list[int]) -> dict[str, dict[str, float]]:
    """embedded / sglang and embedded / in-process tokens/s per count, where both ran."""

    def rate(name: str, count: int) -> float | None:
        row = engines.get(name, {}).get("counts", {}).get(str(count))
        return row["tokens_per_s"] if row else None

    out: dict[str, dict[str, float]] = {}
    for other in ("sglang", "in-process"):
        for count in counts:
            ours, theirs = rate("embedded", count), rate(other, count)
            if ours is not None and theirs:
                out.setdefault(f"embedded_over_{other}", {})[str(count)] = round(ours / theirs, 3)
    return out


def summary_lines(result: dict[str, Any], counts: list[int]) -> list[str]:
    lines = []
    for name, row in result["engines"].items():
        if "error" in row:
            lines.append(f"{name}: failed: {row['error']}")
            continue
        cells = []
        for count in counts:
            cell = row["counts"][str(count)]
            ttft = cell["ttft_s_median"]
            cells.append(
                f"{count}: {cell['tokens_per_s']:,.0f} tok/s"
                f" (spread {cell['spread']:.0%}"
                + (f", TTFT {ttft * 1e3:.0f} ms" if ttft is not None else "")
                + ("" if cell["steady"] else ", NOT steady")
                + ")"
            )
        lines.append(f"{name}: " + "; ".join(cells))
    for key, by_count in result.get("ratios", {}).items():
        lines.append(f"{key}: " + ", ".join(f"{c}: {v:.2f}x" for c, v in by_count.items()))
    return lines


def plot_engine(result: dict[str, Any], axes) -> None:
    engines = {n: r for n, r in result["engines"].items() if "counts" in r}
    counts = sorted({int(c) for row in engines.values() for c in row["counts"]})
    has_gpu = any(
        cell.get("gpu_busy") for row in engines.values() for cell in row["counts"].values()
    )
    panels = (
        ("tokens_per_s", "generated tokens/s", 1.0),
        ("ttft_s_median", "time to first token, median (ms)", 1e3),
        ("gpu_busy", "GPU busy share", 1.0)
        if has_gpu
        else ("engine_busy_share", "engine thread busy share (no GPU seen)", 1.0),
    )
    width = 0.8 / max(1, len(engines))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for index, (name, row) in enumerate(engines.items()):
            values = []
            for count in counts:
                cell = row["counts"].get(str(count), {})
                value = cell.get(key)
                if isinstance(value, dict):  # GPU busy per GPU index: the first GPU
                    value = next(iter(value.values()), None)
                values.append(float("nan") if value is None else value * scale)
            ax.bar([i + index * width for i in range(len(counts))], values, width, label=name)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(counts))])
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_xlabel("requests sent at once")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title("Decode throughput through /generate")
