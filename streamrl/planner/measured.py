"""The planner's prediction next to what a run measured: `streamrl check CONFIG --against RUN_DIR`.

A run's `summary.json` holds `memory.processes`: per process (`learner rank 0`, `engine 0`,
...) its measured peak (`streamrl.memory_use.measured_peak`: torch's tensor peak plus what
the process holds outside torch's pool, or nvidia-smi's figure for SGLang). The plan names
the same processes (`MemoryPlan.processes`); each row is one process, its predicted peak,
the measured one, and the error of the prediction relative to the measure. The issue's
target is every row within `TARGET_ERROR` (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from streamrl.planner.plan import GB, MemoryPlan

TARGET_ERROR = 0.10
"""|predicted - measured| / measured that the planner is held to, per process."""


@dataclass(frozen=True)
class Comparison:
    """One process: the planner's peak and the run's, in bytes (None: not there)."""

    process: str
    predicted_bytes: int | None
    predicted_phase: str
    measured_bytes: int | None
    measured_as: str

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None where either is missing."""
        if self.predicted_bytes is None or not self.measured_bytes:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def is_within_target(self) -> bool | None:
        return None if self.error is None else abs(self.error) <= TARGET_ERROR

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error, "is_within_target": self.is_within_target}


def compare(plan: MemoryPlan, memory: dict[str, Any] | None) -> list[Comparison]:
    """One row per process the plan or the run names, planned ones first."""
    measured = dict((memory or {}).get("processes", {}))
    rows = []
    for name in [*plan.processes, *(n for n in measured if n not in plan.processes)]:
        usage = plan.processes.get(name)
        figures = measured.get(name, {})
        rows.append(
            Comparison(
                process=name,
                predicted_bytes=usage.peak_bytes if usage is not None else None,
                predicted_phase=usage.peak_phase if usage is not None else "not planned",
                measured_bytes=figures.get("measured_peak_bytes"),
                measured_as=figures.get("measured_as", "not in the run's summary"),
            )
        )
    return rows


def comparison_lines(rows: list[Comparison]) -> list[str]:
    """The rows as text (GB = 10^9 bytes)."""

    def gb(value: int | None) -> str:
        return f"{value / GB:8.2f} GB" if value is not None else "       n/a"

    lines = [f"{'process':<16}{'predicted':>12}{'measured':>12}{'error':>9}  measured as"]
    for row in rows:
        error = f"{row.error * 100:+7.1f}%" if row.error is not None else "    n/a"
        mark = {True: "", False: "  (over 10%)", None: ""}[row.is_within_target]
        lines.append(
            f"{row.process:<16}{gb(row.predicted_bytes):>12}{gb(row.measured_bytes):>12}"
            f"{error:>9}  {row.measured_as}{mark}"
        )
    return lines
