"""A `MemoryPlan` as text: one block per GPU (identical GPUs once), every term in GB."""

from __future__ import annotations

from streamrl.planner.plan import GB, GpuPlan, MemoryPlan


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan, line by line (GB = 10^9 bytes)."""
    size = (
        f"{plan.gpu_bytes / GB:.1f} GB per GPU ({plan.gpu_bytes_source})"
        if plan.gpu_bytes is not None
        else f"GPU size unknown ({plan.gpu_bytes_source}): not checked; "
        "set cluster.gpu_memory_gb to check"
    )
    lines = [
        f"memory plan of {plan.model} ({plan.num_parameters / 1e9:.2f}B parameters), {size}"
    ]
    lines += [f"  {note}" for note in plan.notes]
    for names, gpu in _groups(plan.gpus):
        where = names[0] if len(names) == 1 else f"{', '.join(names)} (each)"
        share = f" of {plan.gpu_bytes / GB:.1f} GB" if plan.gpu_bytes else ""
        lines.append(f"{where}: {gpu.peak_bytes / GB:.1f} GB at the peak{share}")
        for usage in gpu.usages:
            lines.append(
                f"  {usage.description}: {usage.peak_bytes / GB:.1f} GB in {usage.peak_phase}"
            )
            for name, bytes_ in usage.terms.items():
                if bytes_:
                    lines.append(f"    {name:<28}{bytes_ / GB:8.2f} GB")
            lines += [f"    {note}" for note in usage.notes]
            if len(usage.phases) > 1:
                phases = ", ".join(
                    f"{name} {usage.phase_bytes(name) / GB:.1f}" for name in usage.phases
                )
                lines.append(f"    phases (GB): {phases}")
    if not plan.gpus:
        lines.append("  nothing runs on a GPU")
    return lines


def _groups(gpus: list[GpuPlan]) -> list[tuple[list[str], GpuPlan]]:
    """GPUs with the same processes and peaks, together, in order."""
    groups: dict[tuple, tuple[list[str], GpuPlan]] = {}
    for gpu in gpus:
        key = tuple((usage.description, usage.peak_bytes) for usage in gpu.usages)
        groups.setdefault(key, ([], gpu))[0].append(gpu.name)
    return list(groups.values())
