"""A trajectory becomes a `Sample`: scored (or its failure recorded), counted, packed.

The rollout worker (`streamrl.actors.rollout`) makes trajectories from prompts; each one
comes here with the error that ended it, if any. A generation failure is kept as a
sample with status `generation_failed`; a reward that raises or times out gives reward 0
with status `reward_failed` and the error in the metadata. Both go to the worker's failure
window (`streamrl.actors.failures`). `RolloutCounters` is what the worker reports;
`score_trajectory` runs `rollout.reward_fn` on a trajectory (the evaluator's too).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl.actors.failures import Failure, FailureWindow, Stage
from streamrl.agents.api import Trajectory
from streamrl.rewards import RewardInput, RewardOutcome, score
from streamrl.types import Prompt, Sample, SampleStatus

log = logging.getLogger(__name__)


@dataclass
class RolloutCounters:
    """What the rollout worker counts, sent with each of its reports (`rollout/*` metrics,
    the summary's `rollout` section)."""

    groups_started: int = 0
    groups_sent: int = 0
    samples: int = 0
    response_tokens: int = 0
    generation_failures: int = 0
    reward_failures: int = 0
    resumes: int = 0
    resume_prompt_tokens: int = 0
    """Prompt tokens sent again to resume aborted calls (the extra prefill of `abort`)."""
    snapshots: int = 0
    """In-flight reports answered (one per checkpoint's cut; the key keeps its first name)."""
    resumed_samples: int = 0
    """Samples a checkpoint saved in flight, continued from their tokens after a restart."""
    resumed_tokens: int = 0
    """Their tokens kept (not generated again)."""
    regenerated_groups: int = 0
    """Groups a checkpoint saved in flight that had to be generated again from the prompt
    (their generate function cannot be continued from tokens)."""
    inexact_version_samples: int = 0
    """Samples some of whose tokens carry a lower bound of their version (`VersionRule`)."""
    rejected: Counter = field(default_factory=Counter)
    """Samples whose request the client refused before sending, by reason."""
    routed_experts_dropped: int = 0
    """Samples whose engine-reported routed experts did not fit their tokens (not replayed)."""
    finish_reasons: Counter = field(default_factory=Counter)
    busy_s: float = 0.0
    """Sum over samples of generate-call wall time (engine-side occupancy proxy)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "finish_reasons": dict(self.finish_reasons),
            "rejected": dict(self.rejected),
        }


async def make_sample(
    prompt: Prompt,
    index: int,
    trajectory: Trajectory,
    error: str | None,
    *,
    reward_fn: Any,
    reward_timeout_s: float,
    counters: RolloutCounters,
    failures: FailureWindow,
    count_failure: Callable[[Failure], None],
) -> Sample:
    """Score one trajectory (`error`: why its generation failed, None when it did not) and
    pack it as a `Sample`; a failing reward is recorded in the sample, never raised.
    `count_failure` takes each failure (it may stop the worker's groups)."""
    status = SampleStatus.OK if error is None else SampleStatus.GENERATION_FAILED
    metadata: dict[str, Any] = {"index": index, **trajectory.metadata}
    metadata["num_turns"] = trajectory.num_turns
    if error is not None:
        metadata["error"] = error
    reward = trajectory.reward
    where = f"prompt {prompt.seq} sample {index}"
    if trajectory.reward_error is not None and status is SampleStatus.OK:
        counters.reward_failures += 1
        status = SampleStatus.REWARD_FAILED
        metadata["reward_error"] = trajectory.reward_error
        count_failure(Failure(Stage.REWARD, trajectory.reward_error, where))
    if reward is None and status is SampleStatus.OK:
        outcome = await score_trajectory(reward_fn, prompt, trajectory, timeout_s=reward_timeout_s)
        reward = outcome.reward
        metadata.update({f"reward/{k}": v for k, v in outcome.metrics.items()})
        if outcome.error is not None:
            counters.reward_failures += 1
            status = SampleStatus.REWARD_FAILED
            metadata["reward_error"] = outcome.error
            log.warning("reward failed for %s: %s", where, outcome.error)
            failure = Failure(Stage.REWARD, outcome.error, where, outcome.traceback)
            count_failure(failure)
    if status is SampleStatus.OK:
        failures.succeeded()
    counters.samples += 1
    counters.resumes += trajectory.num_resumes
    counters.resume_prompt_tokens += trajectory.resume_prompt_tokens
    counters.inexact_version_samples += not trajectory.versions_exact
    counters.response_tokens += len(trajectory.response_ids)
    counters.finish_reasons[str(trajectory.finish_reason)] += 1
    prompt_ids = prompt.input_ids if trajectory.prompt_ids is None else trajectory.prompt_ids
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=trajectory.response_ids,
        logprobs=trajectory.logprobs,
        versions=trajectory.versions,
        loss_mask=trajectory.loss_mask,
        reward=float(reward or 0.0),
        finish_reason=trajectory.finish_reason,
        status=status,
        response_text=trajectory.text,
        metadata=metadata,
        versions_exact=trajectory.versions_exact,
        routed_experts=routed_experts_rows(trajectory, len(prompt_ids), counters),
        turn_starts=trajectory.turn_starts,
    )


def routed_experts_rows(
    trajectory: Trajectory, num_prompt_tokens: int, counters: RolloutCounters
) -> np.ndarray | None:
    """The last model turn's routed experts as the sample's `[tokens - 1, layers * k]`:
    rows after the last model token (a closing observation) are -1; a report with more
    rows than the sample has tokens belongs to other tokens and is dropped (counted)."""
    routed = trajectory.routed_experts
    if routed is None:
        return None
    rows = num_prompt_tokens + len(trajectory.response_ids) - 1
    if len(routed) > rows or rows <= 0:
        counters.routed_experts_dropped += 1
        log.warning("routed experts for %d tokens, the sample has %d: dropped", len(routed), rows)
        return None
    out = np.full((rows, routed.shape[1]), -1, dtype=np.int16)
    out[: len(routed)] = routed
    return out


async def score_trajectory(
    reward_fn: Any, prompt: Prompt, trajectory: Trajectory, *, timeout_s: float
) -> RewardOutcome:
    """`reward_fn` on the trajectory's text with the prompt's label and metadata (never raises:
    a failing reward comes back as an outcome with `error` set)."""
    return await score(
        reward_fn,
        RewardInput(
            prompt=prompt.text,
            response=trajectory.text,
            label=prompt.label,
            metadata=dict(prompt.metadata),
        ),
        timeout_s=timeout_s,
    )
