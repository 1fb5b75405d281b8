"""The generate-function API: how one prompt becomes one trajectory.

A generate function is `async def generate(ctx: GenerateContext, prompt: Prompt) -> Trajectory`
(named in the config as `rollout.generate_fn = "module:function"`). It talks
to the engines only through `ctx.generate`, which

- keeps the episode on one engine (session affinity: its KV prefix stays warm),
- resumes a request that a weight update aborted from the tokens it already
  has (prompt + partial output, remaining budget) instead of starting over,
- retries on another engine (or the same one, once restarted) after an engine
  failure, keeping every token that already arrived,

and returns a `Completion` whose tokens each carry the logprob and the weight
version that produced them. The function appends completions (trainable,
`loss_mask` 1) and observations (tool or environment text, `loss_mask` 0) to
a `Trajectory`. If it sets `trajectory.reward`, that is the sample's reward;
otherwise `rollout.reward_fn` scores `trajectory.text`.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from streamrl.fleet.client import EngineError
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.results import GenerateResult
from streamrl.rewards import RewardInput, RewardOutcome, score
from streamrl.types import NO_VERSION, FinishReason, Prompt

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One model turn, possibly assembled from several engine calls (after aborts or failures)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.STOP
    num_engine_calls: int = 0
    num_resumes: int = 0

    def extend(self, result: GenerateResult) -> None:
        self.output_ids.extend(result.output_ids)
        self.logprobs.extend(result.logprobs)
        self.versions.extend(result.versions)
        self.text += result.text


@dataclass
class Trajectory:
    """Everything after the prompt: model tokens (trained) and observation tokens (masked)."""

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    """The text the reward function scores (the model's final answer, by default all its text)."""
    finish_reason: FinishReason = FinishReason.STOP
    reward: float | None = None
    """Set by environments that score episodes themselves; None asks `rollout.reward_fn`."""
    metadata: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 0
    num_resumes: int = 0
    """Model turns continued after an abort (weight update) or an engine failure."""
    prompt_ids: list[int] | None = None
    """Set when the episode started from other tokens than `prompt.input_ids` (an
    environment whose first observation is not the prompt); the sample's prompt then."""
    reward_error: str | None = None
    """Set with `reward` when the generate function's own reward failed (reward 0): the
    sample is then marked `reward_failed` and counted, as for `rollout.reward_fn`."""
    turn_starts: list[int] = field(default_factory=list)
    """Offset in `response_ids` where each model turn starts (`add_completion` records
    them; the buffer's per-turn staleness rule reads them from `Sample.turn_starts`)."""

    def add_completion(self, completion: Completion) -> None:
        """Append a model turn: trainable, with its behaviour logprobs and versions."""
        self.turn_starts.append(len(self.response_ids))
        self.response_ids.extend(completion.output_ids)
        self.loss_mask.extend([1] * len(completion.output_ids))
        self.logprobs.extend(completion.logprobs)
        self.versions.extend(completion.versions)
        self.text += completion.text
        self.finish_reason = completion.finish_reason
        self.num_turns += 1
        self.num_resumes += completion.num_resumes

    def add_observation(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not produce (tool results, environment feedback): masked."""
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NO_VERSION] * len(token_ids))


class GenerateFn(Protocol):
    """One prompt -> one trajectory. It may also carry `for_group(ctx, prompt, n) ->
    list[Trajectory]`, which the rollout worker then uses to make a group's n samples at
    once (the default single-turn function does: one engine call with SGLang's `n`)."""

    async def __call__(self, ctx: GenerateContext, prompt: Prompt) -> Trajectory: ...


@dataclass
class GenerateContext:
    """What a generate function gets: engines, tokenizer, sampling params, its own options."""

    engines: EngineSet
    tokenizer: Any
    sampling_params: dict[str, Any]
    """SGLang `sampling_params` for this rollout (max_new_tokens is per turn)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """`rollout.generate_kwargs` from the config."""
    session_key: str = field(default_factory=lambda: uuid.uuid4().hex)
    retry_timeout_s: float = 300.0
    """Engine failures are retried with backoff for this long (an engine may be restarting)."""

    async def generate(
        self, input_ids: list[int], *, max_new_tokens: int | None = None, **overrides: Any
    ) -> Completion:
        """One model turn from `input_ids`, resumed across aborts and retried across failures."""
        params = {**self.sampling_params, **overrides}
        budget = max_new_tokens or params.get("max_new_tokens", 128)
        completion = Completion()
        failures = 0
        deadline = time.monotonic() + self.retry_timeout_s
        while True:
            params["max_new_tokens"] = budget - len(completion.output_ids)
            engine = self._engine(failures)
            try:
                result = await engine.generate(input_ids + completion.output_ids, params)
            except EngineError as exc:
                failures += 1
                is_client_error = exc.status is not None and 400 <= exc.status < 500
                if is_client_error or time.monotonic() > deadline:
                    raise
                log.warning("engine call failed (%s); retry %d", exc, failures)
                await anyio.sleep(min(0.25 * 2**failures, 5.0))
                continue
            completion.num_engine_calls += 1
            completion.extend(result)
            if not result.is_aborted:
                completion.finish_reason = FinishReason(result.finish_reason.type)
                return completion
            if len(completion.output_ids) >= budget:
                completion.finish_reason = FinishReason.LENGTH
                return completion
            # Aborted by a weight update (pause mode "abort"): continue from what we have.
            completion.num_resumes += 1

    async def generate_samples(
        self, input_ids: list[int], n: int, **overrides: Any
    ) -> list[Completion]:
        """`n` model turns from the same `input_ids` in one engine call (SGLang's `n`: they share
        the prefill and one HTTP round trip); a sample a weight update aborted is continued on
        its own through `generate`. An engine failure falls back to n separate `generate`s."""
        params = {**self.sampling_params, **overrides}
        budget = params.get("max_new_tokens", 128)
        try:
            results = await self._engine(0).generate_many([input_ids], {**params, "n": n})
        except EngineError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise
            log.warning("batched engine call failed (%s); generating samples one by one", exc)
            results = []
        if len(results) != n:
            return await self._each(n, lambda: self.generate(input_ids, **overrides))
        completions = [Completion() for _ in range(n)]

        async def finish(completion: Completion, result: GenerateResult) -> None:
            completion.num_engine_calls = 1
            completion.extend(result)
            if not result.is_aborted:
                completion.finish_reason = FinishReason(result.finish_reason.type)
                return
            remaining = budget - len(completion.output_ids)
            if remaining <= 0:
                completion.finish_reason = FinishReason.LENGTH
                return
            rest = await self.generate(
                input_ids + completion.output_ids, **{**overrides, "max_new_tokens": remaining}
            )
            completion.output_ids += rest.output_ids
            completion.logprobs += rest.logprobs
            completion.versions += rest.versions
            completion.text += rest.text
            completion.finish_reason = rest.finish_reason
            completion.num_engine_calls += rest.num_engine_calls
            completion.num_resumes += 1 + rest.num_resumes

        async with anyio.create_task_group() as tg:
            for completion, result in zip(completions, results, strict=True):
                tg.start_soon(finish, completion, result)
        return completions

    @staticmethod
    async def _each(n: int, make) -> list[Completion]:
        out: list[Completion | None] = [None] * n

        async def one(index: int) -> None:
            out[index] = await make()

        async with anyio.create_task_group() as tg:
            for index in range(n):
                tg.start_soon(one, index)
        return out

    def _engine(self, num_failures: int):
        """The router when there is one (it keeps prefix affinity), else this session's engine;
        after a failure, another engine (a different session key) when there are several."""
        if self.engines.router is not None:
            return self.engines.router
        key = self.session_key if num_failures == 0 else f"{self.session_key}#{num_failures}"
        return self.engines.session(key)


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
