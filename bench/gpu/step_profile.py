"""One learner step's time, phase by phase, and where its kernels spent it (the GPU
bench scripts' shared part: `megatron_check.py`'s throughput and profile sections,
`learner_profile.py`).

- `StepClock` marks a step's phases (CUDA events on the GPU, wall time on the CPU);
  `timed_optimizer` marks the optimizer step's start and end on one.
- `profile_step` runs a step under torch.profiler and sums its kernel time by kind
  (`KERNEL_KINDS`), with the top kernels, their count and the idle share, for the step
  and (with a `marks_profiler` clock) for each phase.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch


def _synchronize(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


class StepClock:
    """Named marks inside a step: CUDA events on the GPU (no extra synchronisation), wall
    time on CPU. A phase is named by the mark that ends it.

    With `marks_profiler`, each mark first waits for the device and then leaves a marker
    in the running torch.profiler trace, so that `profile_step` can tell which phase every
    kernel ran in (one synchronisation a mark: for profiled steps only)."""

    def __init__(self, device: str, *, marks_profiler: bool = False) -> None:
        self.on_gpu = device == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.marks_profiler = marks_profiler

    def mark(self, name: str) -> None:
        if self.marks_profiler:
            _synchronize(self.on_gpu)
            with torch.profiler.record_function(PHASE_MARKER + name):
                pass
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def phases_s(self) -> dict[str, float]:
        _synchronize(self.on_gpu)
        out: dict[str, float] = {}
        for (_, begin), (name, end) in zip(self.marks, self.marks[1:], strict=False):
            seconds = begin.elapsed_time(end) / 1e3 if self.on_gpu else end - begin
            out[name] = out.get(name, 0.0) + seconds
        self.marks = []
        return out


def timed_optimizer(backend, clock: StepClock) -> None:
    """Mark the optimizer step's start and end (Schedule.train calls `optimizer.step()`) on
    `clock`, in place of the clock an earlier call marked."""
    step = getattr(backend.optimizer.step, "unmarked", backend.optimizer.step)

    def marked_step(*args, **kwargs):
        clock.mark("train_forward_backward_s")
        result = step(*args, **kwargs)
        clock.mark("optimizer_s")
        return result

    marked_step.unmarked = step
    backend.optimizer.step = marked_step


PHASE_MARKER = "streamrl.phase_end:"
"""The name prefix of a profiled StepClock's markers (the phase's name follows)."""
KERNEL_KINDS = (  # (kind, substrings of a kernel's name, lower case), first match wins
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "sm80_xmma", "cublas", "wgrad", "dgrad")),
    ("compiled", ("triton",)),
    ("reduction_or_norm", ("reduce", "norm", "softmax", "cross_entropy", "scan", "sort")),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name (KERNEL_KINDS), or "other"."""
    name = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in name for w in words)), "other")


@dataclass(frozen=True)
class Kernel:
    """One kernel in a profile (on the CPU, one operator's own time stands in)."""

    name: str
    start_us: float
    """On the profiler's clock: CPU markers and GPU kernels share it."""
    duration_us: float


def profile_step(step, device: str, *, top: int = 15) -> dict:
    """Run `step()` once under torch.profiler and sum its kernel time (GPU kernels, copies
    and memsets; on the CPU, operators' own time): the whole step's by kind, its `top`
    kernels and their calls, how many ran, and the idle share (wall - kernel time) / wall;
    with a `marks_profiler` StepClock marking the step, the same per phase (from a mark to
    the next, named by the later one; `top` 10 each). Profiler annotations (torch.optim's,
    torch.compile's ranges) are not kernels and are left out."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    _synchronize(on_gpu)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        _synchronize(on_gpu)
        wall_s = time.perf_counter() - started
    kernels, marks = [], []
    for event in prof.events():
        is_cpu = event.device_type == torch.autograd.DeviceType.CPU
        if event.is_user_annotation:
            if is_cpu and event.name.startswith(PHASE_MARKER):
                marks.append((event.time_range.start, event.name.removeprefix(PHASE_MARKER)))
            continue
        if is_cpu == on_gpu:  # on the GPU its kernels only; on the CPU its operators
            continue
        duration_us = event.self_cpu_time_total if is_cpu else event.time_range.elapsed_us()
        if duration_us > 0:
            kernels.append(Kernel(event.name, event.time_range.start, duration_us))
    result = kernel_summary(kernels, wall_s, top=top)
    marks.sort()
    result["phases"] = {
        name.removesuffix("_s"): kernel_summary(
            [k for k in kernels if begin_us <= k.start_us < end_us],
            (end_us - begin_us) / 1e6,
            top=10,
        )
        for (begin_us, _), (end_us, name) in itertools.pairwise(marks)
    }
    return result


def kernel_summary(kernels: list[Kernel], wall_s: float, *, top: int) -> dict:
    """`profile_step`'s figures for `kernels` run in `wall_s` seconds."""
    by_kind: dict[str, float] = {}
    by_name: dict[str, tuple[int, float]] = {}
    for kernel in kernels:
        kind = kernel_kind(kernel.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + kernel.duration_us / 1e6
        calls, seconds = by_name.get(kernel.name, (0, 0.0))
        by_name[kernel.name] = (calls + 1, seconds + kernel.duration_us / 1e6)
    kernel_s = sum(by_kind.values())
    slowest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {
        "wall_s": round(wall_s, 4),
        "kernel_s": round(kernel_s, 4),
        "idle_share": round(max(0.0, wall_s - kernel_s) / wall_s, 4) if wall_s > 0 else None,
        "num_kernels": len(kernels),
        "by_kind_s": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name[:160], "s": round(seconds, 4), "calls": calls}
            for name, (calls, seconds) in slowest
        ],
    }
