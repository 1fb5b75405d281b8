"""A filled slime `Sample` -> streamrl's `Trajectory`, every trained token with its version.

The Sample says which tokens are the response (`tokens[-response_length:]`), which of
them are trained (`loss_mask`, all when None; none with `remove_sample`), their
behaviour logprobs (`rollout_log_probs`), the status and the reward. It has no
per-token versions: those come from the engine calls the function made through `post`
(`streamrl.compat.slime.engine_calls`). The trained tokens are matched, left to right,
against the calls' outputs: a token continues the call the previous trained token came
from when it is that call's next token, or else starts the first call not used yet
whose output starts with it, or else is a later token of the current call (the function
dropped or replaced some: it then takes the version at the first skipped position, the
oldest it can have, and the sample is inexact). A matched token takes that call's
version (and its engine logprob when the Sample has none). A trained token no call produced (a
function that re-tokenized the engine's text differently) gets the lower bound of any
version it could have, the version the engines served when the function started, and
the sample is marked `versions_exact = False` (its staleness is then overestimated,
never underestimated); a trained token with neither a match nor a rollout logprob is
an error, since decoupled PPO needs every trained token's behaviour logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.agents.api import Trajectory
from streamrl.compat.slime.engine_calls import EngineCall
from streamrl.compat.slime.sample import Sample, SampleStatus
from streamrl.types import NO_VERSION, FinishReason


class SampleError(ValueError):
    """The Sample a slime function returned cannot become a trajectory (or says it failed)."""


_FINISH = {
    SampleStatus.COMPLETED: FinishReason.STOP,
    SampleStatus.TRUNCATED: FinishReason.LENGTH,
}


@dataclass
class Alignment:
    """Per response token: the version and engine logprob of the call it came from (None
    where no call produced it, and on masked tokens)."""

    versions: list[int | None] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    num_unmatched: int = 0
    is_exact: bool = True


def align(response: list[int], loss_mask: list[int], calls: list[EngineCall]) -> Alignment:
    """Find every trained token of `response` in the outputs of `calls` (module docstring)."""
    outputs = [call.completion for call in calls]
    used = [0] * len(outputs)  # each call's next unmatched position
    out = Alignment(versions=[None] * len(response), logprobs=[None] * len(response))
    current: int | None = None
    for position, (token, trained) in enumerate(zip(response, loss_mask, strict=True)):
        if not trained:
            current = None
            continue
        found = _find(token, current, outputs, used)
        if found is None:
            out.num_unmatched += 1
            out.is_exact = False
            continue
        current, at = found
        completion = outputs[current]
        # Tokens skipped in the call (the function dropped or replaced them): the version
        # at the first skipped one, the oldest this token can have (versions only grow).
        out.versions[position] = completion.versions[used[current]]
        out.logprobs[position] = completion.logprobs[at]
        out.is_exact &= completion.versions_exact and at == used[current]
        used[current] = at + 1
    return out


def _find(
    token: int, current: int | None, outputs: list[Any], used: list[int]
) -> tuple[int, int] | None:
    """(call, position) of `token`: the current call's next token, else the first token of
    the first call not used yet, else a later token of the current call."""
    if current is not None:
        ids = outputs[current].output_ids
        if used[current] < len(ids) and ids[used[current]] == token:
            return current, used[current]
    for index, completion in enumerate(outputs):
        if used[index] == 0 and completion.output_ids[:1] == [token]:
            return index, 0
    if current is not None:
        ids = outputs[current].output_ids
        if token in ids[used[current] :]:
            return current, ids.index(token, used[current])
    return None


def to_trajectory(
    sample: Sample, calls: list[EngineCall], *, floor_version: int, reward_key: str = ""
) -> Trajectory:
    """The trajectory of a Sample a slime function filled (module docstring)."""
    if sample.status in (SampleStatus.ABORTED, SampleStatus.FAILED):
        raise SampleError(f"the slime function returned a sample with status {sample.status.value}")
    tokens = [int(token) for token in sample.tokens]
    length = int(sample.response_length)
    if not 0 <= length <= len(tokens):
        raise SampleError(f"response_length = {length} with {len(tokens)} tokens")
    prompt_ids, response = tokens[: len(tokens) - length], tokens[len(tokens) - length :]
    mask = [1] * length if sample.loss_mask is None else [int(bool(m)) for m in sample.loss_mask]
    _check_length("loss_mask", mask, length)
    if sample.remove_sample:
        mask = [0] * length
    given = sample.rollout_log_probs
    if given is not None:
        _check_length("rollout_log_probs", given, length)
    alignment = align(response, mask, calls)
    versions, logprobs = [], []
    for position, trained in enumerate(mask):
        if not trained:
            versions.append(NO_VERSION)
            logprobs.append(0.0)
            continue
        version = alignment.versions[position]
        versions.append(floor_version if version is None else version)
        logprob = given[position] if given is not None else alignment.logprobs[position]
        if logprob is None:
            raise SampleError(
                f"response token {position} (id {response[position]}) is trained, came from "
                f"no /generate call this sample made and has no rollout_log_probs: ask the "
                f"engine for return_logprob and keep its output token ids"
            )
        logprobs.append(float(logprob))
    trajectory = Trajectory(
        response_ids=response,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        text=sample.response,
        finish_reason=_finish_reason(sample, calls),
        reward=_reward(sample, reward_key),
        prompt_ids=prompt_ids,
        versions_exact=alignment.is_exact,
        turn_starts=[i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])],
    )
    trajectory.num_turns = len(trajectory.turn_starts)
    trajectory.num_resumes = sum(call.completion.num_resumes for call in calls)
    trajectory.resume_prompt_tokens = sum(call.completion.resume_prompt_tokens for call in calls)
    trajectory.routed_experts = _routed_experts(tokens, calls)
    trajectory.metadata = _metadata(sample, calls, alignment)
    return trajectory


def _check_length(name: str, values: list, length: int) -> None:
    if len(values) != length:
        raise SampleError(f"{name} has {len(values)} entries for response_length = {length}")


def _finish_reason(sample: Sample, calls: list[EngineCall]) -> FinishReason:
    if sample.status in _FINISH:
        return _FINISH[sample.status]
    return calls[-1].completion.finish_reason if calls else FinishReason.STOP


def _reward(sample: Sample, reward_key: str) -> float | None:
    """The Sample's reward as a float (`reward[reward_key]` for a dict); None asks
    `rollout.reward_fn`."""
    reward = sample.reward
    if reward is None:
        return None
    if isinstance(reward, dict):
        if not reward_key:
            raise SampleError(
                f"the sample's reward is a dict ({sorted(reward)}): name the entry to train "
                f"on with rollout.generate_kwargs.reward_key (slime --reward-key)"
            )
        reward = reward[reward_key]
    return float(reward)


def _routed_experts(tokens: list[int], calls: list[EngineCall]) -> Any:
    """The last call's routed experts when its input and output begin the sample's tokens
    (they then cover them up to that call's last token)."""
    if not calls or calls[-1].completion.routed_experts is None:
        return None
    last = calls[-1]
    fed = last.input_ids + last.completion.output_ids
    return last.completion.routed_experts if tokens[: len(fed)] == fed else None


def _metadata(sample: Sample, calls: list[EngineCall], alignment: Alignment) -> dict[str, Any]:
    """The Sample's metadata (entries that cannot travel as msgpack are dropped and named)
    plus what the conversion saw."""
    metadata: dict[str, Any] = {}
    dropped = []
    for key, value in (sample.metadata or {}).items():
        try:
            msgspec.msgpack.encode(value)
        except (TypeError, msgspec.EncodeError):
            dropped.append(str(key))
            continue
        metadata[str(key)] = value
    metadata["slime/engine_calls"] = len(calls)
    metadata["slime/unmatched_tokens"] = alignment.num_unmatched
    if sample.remove_sample:
        metadata["slime/remove_sample"] = True
    if dropped:
        metadata["slime/dropped_metadata"] = dropped
    return metadata
