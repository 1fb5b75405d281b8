"""`buffer.max_staleness = "auto"`: the learner sets the staleness bound from what it sees.

A higher bound eta lets generation run further ahead of training, so the learner waits
less for data, at the price of older samples: the behaviour policy drifts from the
proximal one, which the learner measures on every step (`train/mismatch_kl`, the
importance weights' effective sample size `train/importance_ess`). The controller
trades the two, one step of eta at a time:

    every step:  observe (learner idle s, step s, mismatch KL, ESS)
    settling     for bound + 1 steps after a change (groups admitted under the new bound
                 have not reached the learner yet), and the run's first step (the
                 pipeline's fill): nothing is measured
    measuring    until `window_steps` steps under the current bound are seen (twice as
                 many after a raise: that window judges it)
    then, on the window's means (the steps/s without the window's slowest step, so
    that one slow step, an evaluation or a checkpoint, does not undo a raise):
      over the budget (KL above max_mismatch_kl, or ESS below min_importance_ess)
                 -> bound - 1, and the bound that broke the budget is not tried again
                    for a while (the ceiling; twice as long each time it fails again),
                    unless the KL measured later leaves room for it (`_has_kl_room`)
      a raise that did not pay -> bound - 1, and that bound becomes the ceiling
      learner idle share above raise_idle_share, below the limit and the ceiling
                 -> bound + 1
      otherwise  hold (the learner does not wait, or the bound is at its limit)

A raise pays when, against every step measured under the bound before it (not only the
window that asked for the raise: a window picked for its long waits is followed by shorter
ones whatever the bound, regression to the mean), steps/s rose by `min_gain`, or the
learner's idle share fell to half or less while steps/s did not fall. The second clause
keeps a raise that did its job on a shared GPU, where generation running further ahead
takes some of the time the learner stopped waiting (on an H200 a raise cut the wait from
13% of the step to 1% for 4% more steps/s, within the steps' own noise).

The bound never goes below `weights.update_interval - 1` (admission needs it) nor above
`buffer.auto.limit`. Groups admitted under a bound keep it when the bound is lowered
(`streamrl.queues.admission.BoundHistory`). Each step's decision, its reason and the
means it was made on are metrics (`staleness/*`, `Decision.metrics`); each change is a
log line.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass

from streamrl.config import RunConfig
from streamrl.config.sections import AutoStalenessConfig

log = logging.getLogger(__name__)

BASELINE_WINDOWS = 4
"""A raise is judged against at most this many windows' steps under the bound before it."""

CEILING_WINDOWS = 4
"""A bound lowered for breaking the budget (or undone for not paying) is not tried again for
this many decision periods (settling + window of the bound below it), doubled each time the
same bound fails again: probes of a bound that keeps failing become rare."""


class Reason(enum.IntEnum):
    """Why the bound is what it is after a step (metric `staleness/auto_reason`)."""

    SETTLING = 0
    MEASURING = 1
    BALANCED = 2
    """Within the budget and the learner does not wait: nothing to gain."""
    LEARNER_WAITS = 3
    """Raised: the learner waited for data."""
    OVER_BUDGET = 4
    """Lowered: the off-policy diagnostics left the budget."""
    RAISE_DID_NOT_PAY = 5
    """Lowered: the last raise did not make steps faster."""
    AT_LIMIT = 6
    """The learner waits, but the bound is at `auto.limit` or below a ceiling."""
    OVER_BUDGET_AT_FLOOR = 7
    """Over the budget with the bound already at its floor."""


@dataclass(frozen=True)
class Observation:
    """What one training step showed the controller."""

    idle_s: float
    """Seconds the learner waited for the step's batch."""
    step_s: float
    """Seconds of the whole step (wait, train, publish)."""
    mismatch_kl: float | None
    """`train/mismatch_kl` of the step (None: the backend did not report it)."""
    importance_ess: float | None


@dataclass(frozen=True)
class Decision:
    bound: int
    change: int
    """-1, 0 or +1."""
    reason: Reason
    idle_share: float | None = None
    mismatch_kl: float | None = None
    importance_ess: float | None = None
    steps_per_s: float | None = None

    def metrics(self) -> dict[str, float]:
        """The step's `staleness/*` metrics (window means only where a decision was made)."""
        out: dict[str, float] = {
            "staleness/bound": float(self.bound),
            "staleness/auto_change": float(self.change),
            "staleness/auto_reason": float(self.reason),
        }
        for name in ("idle_share", "mismatch_kl", "importance_ess", "steps_per_s"):
            value = getattr(self, name)
            if value is not None:
                out[f"staleness/auto_{name}"] = value
        return out


class AutoStaleness:
    """The controller of the module docstring; `observe` once per trained step."""

    def __init__(self, settings: AutoStalenessConfig, *, floor: int = 0, start: int | None = None):
        """`floor`: the lowest bound allowed (`weights.update_interval - 1`); `start`: the bound
        to begin from (a resumed run's), else `settings.start`."""
        self.settings = settings
        self.floor = floor
        self.limit = max(settings.limit, floor)
        self.bound = min(max(settings.start if start is None else start, floor), self.limit)
        self._window: list[Observation] = []
        self._window_steps = settings.window_steps
        """Steps the current window needs: twice `window_steps` when it judges a raise."""
        self._at_bound: deque[Observation] = deque(maxlen=BASELINE_WINDOWS * settings.window_steps)
        """Every step measured under the current bound (the baseline a raise is judged on)."""
        self._settle_steps = 1
        """Steps left before the next is measured: first the run's first step (its wait is the
        pipeline's fill, not a rate)."""
        self._before_raise: _Rates | None = None
        """The rates under the bound before the last raise, until the raise is judged."""
        self._ceiling: int | None = None
        self._ceiling_steps = 0
        self._is_ceiling_kl_only = False
        """Whether the ceiling was set by the mismatch KL alone (`_has_kl_room` may lift it)."""
        self._failures: dict[int, int] = {}
        """How often each bound was lowered from or undone."""

    @classmethod
    def for_run(cls, cfg: RunConfig, start: int | None = None) -> AutoStaleness | None:
        """The run's controller, or None when its bound is fixed."""
        if not cfg.buffer.is_auto:
            return None
        return cls(cfg.buffer.auto, floor=cfg.weights.update_interval - 1, start=start)

    def observe(self, observation: Observation) -> Decision:
        """Take one step's observation; returns the bound for the next steps and why."""
        if self._ceiling is not None:
            self._ceiling_steps -= 1
            if self._ceiling_steps <= 0:
                self._ceiling = None
        if self._settle_steps > 0:
            self._settle_steps -= 1
            return Decision(self.bound, 0, Reason.SETTLING)
        self._window.append(observation)
        self._at_bound.append(observation)
        if len(self._window) < self._window_steps:
            return Decision(self.bound, 0, Reason.MEASURING)
        decision = self._decide()
        if not decision.change:  # the window slides on, `window_steps` long
            self._window_steps = self.settings.window_steps
            del self._window[: -self._window_steps]
        return decision

    def _decide(self) -> Decision:
        settings = self.settings
        window = self._window
        rates = _Rates.of(window)
        # The raise is asked for on the whole window's waits (a burst may be its slowest step).
        idle_share = sum(o.idle_s for o in window) / max(sum(o.step_s for o in window), 1e-9)
        kl = _mean([o.mismatch_kl for o in window])
        ess = _mean([o.importance_ess for o in window])
        means = {
            "idle_share": idle_share,
            "mismatch_kl": kl,
            "importance_ess": ess,
            "steps_per_s": rates.steps_per_s,
        }
        is_kl_over = kl is not None and kl > settings.max_mismatch_kl
        is_ess_under = (
            settings.min_importance_ess > 0
            and ess is not None
            and ess < settings.min_importance_ess
        )
        before_raise, self._before_raise = self._before_raise, None
        if is_kl_over or is_ess_under:
            if self.bound <= self.floor:
                return Decision(self.bound, 0, Reason.OVER_BUDGET_AT_FLOOR, **means)
            decision = self._change(-1, Reason.OVER_BUDGET, means, ceiling=self.bound)
            self._is_ceiling_kl_only = not is_ess_under
            return decision
        if before_raise is not None and not rates.paid_against(before_raise, settings):
            return self._change(-1, Reason.RAISE_DID_NOT_PAY, means, ceiling=self.bound)
        if idle_share > settings.raise_idle_share:
            is_capped = self._ceiling is not None and self.bound + 1 >= self._ceiling
            if is_capped and self._has_kl_room(kl):
                log.info("the mismatch KL (%.4f at bound %d) leaves room for %d now: "
                         "its ceiling is lifted", kl, self.bound, self.bound + 1)  # fmt: skip
                self._ceiling, is_capped = None, False
            if self.bound >= self.limit or is_capped:
                return Decision(self.bound, 0, Reason.AT_LIMIT, **means)
            self._before_raise = _Rates.of(list(self._at_bound))
            return self._change(+1, Reason.LEARNER_WAITS, means)
        return Decision(self.bound, 0, Reason.BALANCED, **means)

    def _has_kl_room(self, kl: float | None) -> bool:
        """Whether a ceiling set because the mismatch KL broke its budget may be lifted early:
        the KL measured now, scaled to one version more as if it grew with the square of the
        staleness (a policy drifting the same way each version; a random walk grows only
        linearly), is within half the budget. The policy moves fastest early in a run, so a
        budget broken then says little about later."""
        if not self._is_ceiling_kl_only or kl is None:
            return False
        scale = ((self.bound + 1) / max(self.bound, 1)) ** 2
        return kl * scale <= self.settings.max_mismatch_kl / 2

    def _change(self, change: int, reason: Reason, means: dict, *, ceiling: int | None = None):
        old = self.bound
        self.bound = old + change
        self._window.clear()
        self._at_bound.clear()
        self._window_steps = self.settings.window_steps * (2 if change > 0 else 1)
        self._settle_steps = self.bound + 1
        if ceiling is not None:
            failures = self._failures[ceiling] = self._failures.get(ceiling, 0) + 1
            period = self.bound + 1 + self.settings.window_steps
            self._ceiling = ceiling
            self._ceiling_steps = CEILING_WINDOWS * period * 2 ** (failures - 1)
            self._is_ceiling_kl_only = False
        decision = Decision(self.bound, change, reason, **means)
        log.info("staleness bound %d -> %d: %s", old, self.bound, describe(decision, self))
        return decision


@dataclass(frozen=True)
class _Rates:
    """A run of steps reduced to what a raise is judged on, both without the run's slowest
    step: one evaluation or checkpoint on the way neither undoes a raise nor makes one look
    as if it had cut the waits."""

    steps_per_s: float
    idle_share: float
    """The learner's waits over the steps' time: a mean, since the waits come in bursts (a
    few steps wait, most do not)."""

    @classmethod
    def of(cls, steps: list[Observation]) -> _Rates:
        kept = sorted(steps, key=lambda o: o.step_s)[:-1] or steps[:1]
        total_s = max(sum(o.step_s for o in kept), 1e-9)
        return cls(len(kept) / total_s, sum(o.idle_s for o in kept) / total_s)

    def paid_against(self, before: _Rates, settings: AutoStalenessConfig) -> bool:
        """Whether these rates, measured after a raise, show that it paid (module docstring).
        The waits count only if the learner waited before the raise (more than
        `raise_idle_share` of its steps but the slowest), not just in one slow step."""
        if self.steps_per_s >= before.steps_per_s * (1 + settings.min_gain):
            return True
        did_wait = before.idle_share > settings.raise_idle_share
        cut_waits = self.idle_share <= before.idle_share / 2
        return did_wait and cut_waits and self.steps_per_s >= before.steps_per_s


def start_bound(cfg: RunConfig, saved: int | None) -> int:
    """The bound admission starts with: the config's, or, resuming a run whose bound is auto,
    the one it had reached (`TrainState.staleness_bound`)."""
    if cfg.buffer.is_auto and saved is not None:
        return AutoStaleness.for_run(cfg, start=saved).bound
    return cfg.effective_max_staleness


def describe(decision: Decision, controller: AutoStaleness) -> str:
    """One line on why (`Decision.reason`), with the window's means."""
    settings = controller.settings
    kl = "n/a" if decision.mismatch_kl is None else f"{decision.mismatch_kl:.4f}"
    text = {
        Reason.LEARNER_WAITS: f"the learner waited {decision.idle_share:.0%} of its last "
        f"steps (> {settings.raise_idle_share:.0%}); mismatch KL {kl} within "
        f"{settings.max_mismatch_kl}",
        Reason.OVER_BUDGET: f"off-policy diagnostics over the budget (mismatch KL {kl}, budget "
        f"{settings.max_mismatch_kl}; ESS {decision.importance_ess}, floor "
        f"{settings.min_importance_ess})",
        Reason.RAISE_DID_NOT_PAY: f"the raise did not make steps faster by "
        f"{settings.min_gain:.0%} ({decision.steps_per_s:.3f} steps/s)",
    }
    return text.get(decision.reason, decision.reason.name.lower())


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
