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

from streamrl.engine.client import EngineError, EngineSet, GenerateResult
from streamrl.types import NO_VERSION, FinishReason

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

    def add_completion(self, completion: Completion) -> None:
        """Append a model turn: trainable, with its behaviour logprobs and versions."""
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
    async def __call__(self, ctx: GenerateContext, prompt: Any) -> Trajectory: ...


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

    def _engine(self, num_failures: int):
        """The router when there is one (it keeps prefix affinity), else this session's engine;
        after a failure, another engine (a different session key) when there are several."""
        if self.engines.router is not None:
            return self.engines.router
        key = self.session_key if num_failures == 0 else f"{self.session_key}#{num_failures}"
        return self.engines.session(key)
