"""Learning-rate schedules: pure functions of the optimizer step, without torch.

`step` counts the optimizer updates already taken, so update k (0-based) runs
at `lr_at(k, ...)`. That is the count torch's `LambdaLR` hands its multiplier
when `scheduler.step()` follows every `optimizer.step()` (0 at construction,
then +1 per call), which `lr_multiplier` plugs into.

The convention, for warmup W and decay D:

    step:  0        ...  W - 1   W    ...   W + D    W + D + 1 ...
    lr:    lr / W   ...  lr      lr   ...   min_lr   min_lr

The ramp ends at lr on step W - 1, so no update is taken at rate 0.
Megatron's `OptimizerParamScheduler.get_lr` (megatron-core 0.16.1) differs:
its ramp is init_lr + (lr - init_lr) * n / W, so update 0 runs at init_lr and
update W at lr; its decay steps count from 0, warmup included; its `constant`
style ignores min_lr (as here).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

DECAY_STYLES = ("constant", "linear", "cosine")


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    decay_style: str,
    decay_steps: int,
    min_lr: float,
) -> float:
    """The learning rate of optimizer update `step` (0-based).

    - Warmup, steps 0 .. warmup_steps - 1: lr * (step + 1) / warmup_steps.
    - Decay, steps warmup_steps .. warmup_steps + decay_steps, with progress
      p = (step - warmup_steps) / decay_steps from 0 to 1: `linear`
      min_lr + (lr - min_lr) * (1 - p); `cosine` min_lr + (lr - min_lr) *
      (1 + cos(pi p)) / 2 (SGDR, arXiv 1608.03983, without restarts).
    - Later steps: min_lr.

    `constant` stays at lr after the warmup and ignores decay_steps and min_lr
    (both are still checked). warmup_steps = 0 starts the decay at step 0.
    Raises ValueError for an unknown style, lr <= 0, min_lr outside [0, lr],
    negative or non-integer counts, or decay_steps = 0 with a decaying style.
    """
    _check_schedule(
        lr=lr,
        warmup_steps=warmup_steps,
        decay_style=decay_style,
        decay_steps=decay_steps,
        min_lr=min_lr,
    )
    _check_count("step", step)
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_style == "constant":
        return lr
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if decay_style == "linear":
        coefficient = 1.0 - progress
    else:
        coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * coefficient


def lr_multiplier(
    *,
    lr: float,
    warmup_steps: int,
    decay_style: str,
    decay_steps: int,
    min_lr: float,
) -> Callable[[int], float]:
    """step -> lr_at(step, ...) / lr, the factor `torch.optim.lr_scheduler.LambdaLR` expects.

    Build the optimizer with this `lr` and call `scheduler.step()` after each
    `optimizer.step()`: LambdaLR sets the rate to lr * factor(count of its
    steps), so update k runs at lr_at(k). The arguments are checked here,
    once; the returned function is a closure, which LambdaLR leaves out of its
    state_dict (the schedule comes from the config, the step count is saved).
    """
    schedule = {
        "lr": lr,
        "warmup_steps": warmup_steps,
        "decay_style": decay_style,
        "decay_steps": decay_steps,
        "min_lr": min_lr,
    }
    _check_schedule(**schedule)

    def multiplier(step: int) -> float:
        return lr_at(step, **schedule) / lr

    return multiplier


def _check_schedule(
    *, lr: float, warmup_steps: int, decay_style: str, decay_steps: int, min_lr: float
) -> None:
    if decay_style not in DECAY_STYLES:
        raise ValueError(
            f"unknown decay_style {decay_style!r}; expected one of {', '.join(DECAY_STYLES)}"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr must be in [0, lr = {lr}], got {min_lr}")
    _check_count("warmup_steps", warmup_steps)
    _check_count("decay_steps", decay_steps)
    if decay_style != "constant" and decay_steps == 0:
        raise ValueError(
            f"decay_steps must be >= 1 for decay_style {decay_style!r} "
            "(use 'constant' for no decay)"
        )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
