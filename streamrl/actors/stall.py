"""The learner's stall report: when it has waited `train.stall_warning_s` for a batch, the
terminal says why, and says it again every as many seconds while the wait lasts.

    LearnerLoop._take ─► wait_watched(source.take(B, v)) ── StallWatch: due after threshold_s,
                             │                                 then every threshold_s
                             ▼ while it waits, when due
                         source.progress(B) ─► describe_stall ─► log.warning (the terminal)
                                           └─► stall_record ─► metrics.jsonl

The message counts what became of the groups since the learner's last batch (arrived,
failed, filtered by which filter with the rewards of the groups it dropped, evicted), what
the next batch waits for (needed, buffered, in flight, startable), and names the keys
that change it. A run whose every group is filtered says so in as many words.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from streamrl.queues.progress import ProgressReport

T = TypeVar("T")

FILTER_ADVICE = {
    "zero_std": (
        "every sample of each group got the same reward, so its advantage is zero and there "
        "is nothing to learn from it. Change the reward (rollout.reward_fn, or "
        "rollout.generate_kwargs of a generate function that scores), let samples differ "
        "more (a higher rollout.sampling.temperature or rollout.n_samples_per_prompt), or "
        'take "zero_std" out of buffer.filters'
    ),
    "truncated": (
        "samples stopped at rollout.sampling.max_new_tokens: raise it, or take "
        '"truncated" out of buffer.filters'
    ),
    "generation_failed": (
        "the engines failed those samples: see the rollout and engine logs in the run "
        "directory's logs/"
    ),
    "min_response_tokens": "responses were shorter than buffer.min_response_tokens: lower it",
    "max_response_tokens": "responses were longer than buffer.max_response_tokens: raise it",
}
"""What a filter that drops every group means, and the keys that change it."""

EVICTION_ADVICE = {
    "stale": "groups grew older than buffer.max_staleness versions before training: raise it",
    "episode_stale": "episodes outlived buffer.max_episode_staleness: raise it",
    "turn_stale": (
        "a turn was older than buffer.max_staleness when the next began: raise it, or "
        "see buffer.staleness_rule"
    ),
    "overflow": "the buffer was full: raise buffer.capacity",
}
"""What an eviction reason means, and the key that changes it."""


class StallWatch:
    """Says when the learner has waited `threshold_s` for a batch, then again every
    `threshold_s` while it still waits; quiet while batches come sooner. `clock` gives
    seconds (monotonic)."""

    def __init__(self, threshold_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.threshold_s = threshold_s
        self._clock = clock
        self._since: float | None = None
        self._due_at = math.inf

    def waiting(self) -> None:
        """The learner starts waiting for a batch."""
        self._since = self._clock()
        self._due_at = self._since + self.threshold_s

    def done(self) -> None:
        """The batch came."""
        self._since, self._due_at = None, math.inf

    def seconds_to_due(self) -> float:
        """Seconds until the next warning is due (inf while the learner is not waiting)."""
        return max(self._due_at - self._clock(), 0.0)

    def poll(self) -> float | None:
        """The seconds waited when a warning is due now (the next one is then due
        `threshold_s` later), else None."""
        now = self._clock()
        if self._since is None or now < self._due_at:
            return None
        self._due_at = now + self.threshold_s
        return now - self._since


async def wait_watched(
    wait: Callable[[], Awaitable[T]], watch: StallWatch, warn: Callable[[float], None]
) -> T:
    """`await wait()`, calling `warn(seconds waited)` whenever `watch` says a warning is due
    meanwhile. An error of `wait` propagates as itself (not inside an ExceptionGroup)."""
    error: Exception | None = None
    watch.waiting()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_warn_when_due, watch, warn)
        try:
            result = await wait()
        except Exception as exc:
            error = exc
        tg.cancel_scope.cancel()  # the wait is over: only the watcher is cancelled
    watch.done()
    if error is not None:
        raise error
    return result


async def _warn_when_due(watch: StallWatch, warn: Callable[[float], None]) -> None:
    while True:
        await anyio.sleep(watch.seconds_to_due())
        waited_s = watch.poll()
        if waited_s is not None:
            warn(waited_s)


def describe_stall(report: ProgressReport, *, waited_s: float, step: int) -> str:
    """The terminal's message (see the module docstring): a first line with the wait, the
    counts, one line per filter that dropped groups, then what it means and what to set."""
    lines = [
        f"no training step for {waited_s:.0f} s (the learner waits for step {step}'s batch): "
        f"it needs {report.num_needed} groups, {report.num_buffered} are buffered",
        f"  since the learner's last batch (or its start): {report.num_arrived} groups arrived "
        f"({report.num_samples} samples; generation failed for {report.num_generation_failed}, "
        f"the reward for {report.num_reward_failed}), {report.num_filtered} filtered, "
        f"{report.num_evicted} evicted; {report.num_in_flight} in flight at the rollout, "
        f"{report.num_startable} more may start",
    ]
    for name in _by_count(report):
        stats = report.filtered[name]
        lines.append(f"  filtered by {name}: {stats.num_groups} groups, {stats.describe()}")
    for reason, count in sorted(report.evicted.items()):
        lines.append(f"  evicted ({reason}): {count} groups")
    lines.extend(f"  {line}" for line in _diagnosis(report))
    return "\n".join(lines)


def _diagnosis(report: ProgressReport) -> list[str]:
    """What the counts mean, most likely cause first, with the keys that change it."""
    lines = []
    if report.num_arrived == 0:
        if report.num_in_flight:
            lines.append(
                f"no group arrived: {report.num_in_flight} are being generated; see the "
                "rollout and engine logs in the run directory's logs/ if that lasts"
            )
        elif not report.num_startable:
            lines.append(
                "no group arrived and admission lets none start: see buffer.max_staleness "
                "and buffer.capacity"
            )
        else:
            lines.append(
                "no group arrived and none is in flight: the rollout process may still be "
                "starting; see its log (logs/rollout.log in the run directory)"
            )
    elif report.num_filtered == report.num_arrived:
        names = ", ".join(sorted(report.filtered))
        lines.append(
            f"every group that arrived was dropped by buffer.filters ({names}): nothing trains."
        )
    elif report.num_filtered or report.num_evicted:
        kept = report.num_arrived - report.num_filtered
        lines.append(f"{kept} of {report.num_arrived} groups that arrived were kept.")
    for name in _by_count(report):
        advice = FILTER_ADVICE.get(
            name, f"check the filter, or take {name!r} out of buffer.filters"
        )
        lines.append(f"{name}: {advice}.")
    for reason in sorted(report.evicted):
        lines.append(f"evicted ({reason}): {EVICTION_ADVICE.get(reason, 'see buffer.*')}.")
    if report.num_reward_failed:
        lines.append(
            f"the reward function failed for {report.num_reward_failed} of "
            f"{report.num_samples} samples (their reward is 0): see the rollout's log"
        )
    return lines


def _by_count(report: ProgressReport) -> list[str]:
    """The filters that dropped groups, most groups first."""
    return sorted(report.filtered, key=lambda name: -report.filtered[name].num_groups)


def stall_record(
    report: ProgressReport, *, waited_s: float, step: int, elapsed_s: float
) -> dict[str, Any]:
    """The report as a metrics.jsonl record of kind `stall` (`step`: the last step done)."""
    record: dict[str, Any] = {
        "kind": "stall",
        "step": step,
        "time": elapsed_s,
        "stall/waited_s": waited_s,
        "stall/groups_needed": report.num_needed,
        "stall/groups_buffered": report.num_buffered,
        "stall/groups_in_flight": report.num_in_flight,
        "stall/groups_startable": report.num_startable,
        "stall/groups_arrived": report.num_arrived,
        "stall/groups_filtered": report.num_filtered,
        "stall/groups_evicted": report.num_evicted,
        "stall/samples_generation_failed": report.num_generation_failed,
        "stall/samples_reward_failed": report.num_reward_failed,
    }
    for name, stats in report.filtered.items():
        record[f"stall/filtered/{name}"] = stats.num_groups
        record[f"stall/filtered/{name}/reward_mean"] = stats.mean
        record[f"stall/filtered/{name}/reward_std"] = stats.std
        record[f"stall/filtered/{name}/reward_min"] = stats.min
        record[f"stall/filtered/{name}/reward_max"] = stats.max
    for reason, count in report.evicted.items():
        record[f"stall/evicted/{reason}"] = count
    return record
