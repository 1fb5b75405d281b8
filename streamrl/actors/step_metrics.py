"""A training step's record for metrics.jsonl: what was trained, how long it took, and the
step source's and the publisher's counters at its end.

    step_record(groups, StepTimes, SourceStats, the backend's step metrics)
      reward_*, staleness_*, episode/*       of the batch trained
      groups_*, filtered/*, response_len_*   of the source's buffer (cumulative)
      rollout/*, reward_generated_mean       of the rollout (when there is one)
      accounting/*                           the group accounting's identity
    publish_metrics(publish, publisher)      weights/* of the step's weight push
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.queues import horizon
from streamrl.queues.progress import SourceStats
from streamrl.types import Group

if TYPE_CHECKING:  # the publisher imports torch
    from streamrl.publish.publisher import PublishRecord, WeightPublisher

ROLLOUT_COUNTERS = (
    "response_tokens",
    "samples",
    "generation_failures",
    "reward_failures",
    "resumes",
    "resume_prompt_tokens",
    "inexact_version_samples",
    "resumed_samples",
    "resumed_tokens",
    "regenerated_groups",
    "groups_started",
)
"""Counters of the rollout's reports copied into each step record as `rollout/<name>`."""


@dataclass(frozen=True)
class StepTimes:
    """Where a step stands in the run: its number, versions, clocks and running totals."""

    step: int
    version: int
    """The policy's version after the step."""
    trained_version: int
    """The version the batch was trained at (staleness is measured from it)."""
    idle_s: float
    """Seconds the learner waited for the batch."""
    train_s: float
    """Seconds of the training step itself."""
    elapsed_s: float
    """Seconds since the run's metrics started."""
    samples_trained: int
    trained_tokens: int
    """Tokens trained since this process started (for the throughput)."""


def step_record(
    groups: list[Group],
    times: StepTimes,
    stats: SourceStats,
    train_metrics: dict[str, float],
) -> dict[str, Any]:
    """The step's record (see the module docstring), without the publisher's part."""
    rewards = np.array([s.reward for g in groups for s in g.samples], dtype=np.float64)
    staleness = [g.staleness(times.trained_version) for g in groups]
    buffer = stats.buffer
    elapsed = times.elapsed_s
    record: dict[str, Any] = {
        "step": times.step,
        "version": times.version,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": int(max(staleness)),
        "versions_spanned_max": max(g.num_versions_spanned for g in groups),
        "prompt_seqs": [g.prompt_seq for g in groups],
        "samples_trained": times.samples_trained,
        "groups_trained": buffer.num_handed_out,
        "groups_accepted": buffer.num_accepted,
        "groups_filtered": buffer.num_filtered,
        "groups_evicted": buffer.num_evicted,
        "groups_buffered": stats.num_buffered,
        **{f"filtered/{name}": count for name, count in sorted(buffer.filtered.items())},
        "learner_idle_s": times.idle_s,
        "train_s": times.train_s,
        "time": elapsed,
        "unix_time": time.time(),
        "throughput/trained_tokens_per_s": times.trained_tokens / max(elapsed, 1e-9),
        "response_len_generated_mean": buffer.generated.mean,
        "response_len_trained_mean": buffer.trained.mean,
    }
    if stats.generated_reward_mean is not None:  # includes filtered groups, unlike reward_mean
        record["reward_generated_mean"] = stats.generated_reward_mean
    record.update(episode_metrics(groups))
    record.update(horizon.step_metrics(groups, times.trained_version, stats.max_staleness))
    record.update(train_metrics)
    record.update(rollout_metrics(stats.rollout, elapsed))
    record.update(stats.accounting)
    record["accounting/ok"] = not stats.accounting_problems
    return record


def rollout_metrics(rollout: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """`rollout/*` from the rollout's latest counters, and the generated tokens' rate."""
    record: dict[str, Any] = {
        f"rollout/{key}": rollout[key] for key in ROLLOUT_COUNTERS if key in rollout
    }
    for reason, count in rollout.get("rejected", {}).items():
        record[f"rollout/rejected/{reason}"] = count
    if "response_tokens" in rollout:
        record["throughput/generated_tokens_per_s"] = rollout["response_tokens"] / max(
            elapsed_s, 1e-9
        )
    return record


def publish_metrics(
    publish: PublishRecord | None, publisher: WeightPublisher | None
) -> dict[str, Any]:
    """`weights/*` of the step's push: the learner's stall for it, the digest mismatches so
    far and the latest push's record (`publish` and `publisher` None: no engines take
    weights)."""
    record: dict[str, Any] = {
        "weights/learner_stall_s": publish.learner_stall_s if publish else 0.0
    }
    if publisher is None:
        return record
    record["weights/digest_mismatches"] = publisher.num_digest_mismatches
    if publisher.records:
        last = publisher.records[-1].as_metrics()
        record.update({k: v for k, v in last.items() if k != "weights/learner_stall_s"})
    return record


def episode_metrics(groups: list[Group]) -> dict[str, Any]:
    """Aggregates of what generate functions record per sample (turns, tools, endings)."""
    samples = [s for g in groups for s in g.samples]
    turns = [s.metadata.get("num_turns", 0) for s in samples]
    record: dict[str, Any] = {
        "episode/turns_mean": float(np.mean(turns)) if turns else 0.0,
        "episode/turns_max": int(max(turns, default=0)),
    }
    for key in ("tool_calls", "tool_errors", "tool_timeouts"):
        values = [s.metadata[key] for s in samples if key in s.metadata]
        if values:
            record[f"episode/{key}"] = int(sum(values))
    reasons: dict[str, int] = {}
    for sample in samples:
        if "end_reason" in sample.metadata:
            reason = str(sample.metadata["end_reason"])
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        record[f"episode/ended_{reason}"] = count
    return record
