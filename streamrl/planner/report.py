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
    lines = [f"memory plan of {plan.model} ({plan.num_parameters / 1e9:.2f}B parameters), {size}"]
    lines += [f"  {note}" for note in plan.notes]
    for names, gpu in _groups(plan.gpus):
        where = names_of(names)
        share = f" of {plan.gpu_bytes / GB:.1f} GB" if plan.gpu_bytes else ""
        lines.append(f"{where}: {gpu.peak_bytes / GB:.1f} GB at the peak{share}")
        if gpu.handoff_phases:
            phases = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in gpu.handoff_phases.items())
            lines.append(
                f"  colocated (cluster.colocate, a synchronous schedule): learner and engines "
                f"take turns, the peak is the larger phase: {phases}"
            )
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


def names_of(names: list[str]) -> str:
    """One name as it is, GPU 0 ... GPU 3 as `GPUs 0-3 (each)`, others as `8 GPUs (each)`."""
    if len(names) == 1:
        return names[0]
    prefixes = {name.rpartition(" ")[0] for name in names}
    numbers = [name.rpartition(" ")[2] for name in names]
    if len(prefixes) == 1 and all(n.isdigit() for n in numbers):
        first, last = int(numbers[0]), int(numbers[-1])
        if [int(n) for n in numbers] == list(range(first, last + 1)):
            return f"{prefixes.pop()}s {first}-{last} (each)"
        return f"{prefixes.pop()}s {', '.join(numbers)} (each)"
    return f"{len(names)} GPUs (each)"


def _groups(gpus: list[GpuPlan]) -> list[tuple[list[str], GpuPlan]]:
    """GPUs with the same processes and peaks, together, in order."""
    groups: dict[tuple, tuple[list[str], GpuPlan]] = {}
    for gpu in gpus:
        key = tuple((usage.description, usage.peak_bytes) for usage in gpu.usages)
        groups.setdefault(key, ([], gpu))[0].append(gpu.name)
    return list(groups.values())
