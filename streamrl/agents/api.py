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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from streamrl.fleet.client import EngineError
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.results import GenerateResult
from streamrl.types import NO_VERSION, FinishReason, Prompt

log = logging.getLogger(__name__)


ABORTED_BEFORE_START = 499
"""SGLang 0.5.17's answer to a request that a pause in `abort` mode aborted before it ran
(seen on the H200: `{"error": {"message": "Request ... was aborted"}}`): the pause aborts
every request it knows of, including ones waiting at the pause gate, such as a sample
resumed after the first abort. No token was generated, so the request is sent again."""


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
    versions_exact: bool = True
    """False when some call's tokens may come from an older version than they are labelled
    with: they are then labelled with the oldest version possible (see `VersionRule`)."""
    resume_prompt_tokens: int = 0
    """Tokens sent again as the prompt of a resumed call (prompt + partial output: the extra
    prefill an abort costs)."""
    is_finished: bool = False
    """The turn has ended (by stop, length or budget); False while it is being generated."""
    routed_experts: Any = None
    """The latest engine call's routed experts (`GenerateResult.routed_experts`): it covers its
    whole input, so it supersedes what earlier calls of a resumed turn reported."""

    def extend(self, result: GenerateResult, versions: list[int], *, is_exact: bool) -> None:
        self.output_ids.extend(result.output_ids)
        self.logprobs.extend(result.logprobs)
        self.versions.extend(versions)
        self.versions_exact &= is_exact
        self.text += result.text
        if result.routed_experts is not None:
            self.routed_experts = result.routed_experts


@dataclass(frozen=True)
class VersionRule:
    """How the tokens of one engine response get their weight versions.

    A response with `weight_versions` spans (the embedded engine) is exact token by token.
    SGLang sends one `weight_version` per response, the version when it finished. With
    `weights.pause_mode = "abort"` (or `retract_abort`) every request in flight at an update
    is aborted and resumed as a new request, so no response straddles an update:
    `single_version` says so, and each response's version is exact. Otherwise a response is exact when it
    finished at `floor()`, the version the engines were known to serve when it was sent
    (versions only grow); else its tokens are labelled with that floor, the oldest they
    can be, so the staleness bound stays safe (it overestimates staleness), and the
    sample is counted as inexact."""

    single_version: bool = False
    floor: Callable[[], int] = lambda: 0

    def versions(self, result: GenerateResult, floor: int) -> tuple[list[int], bool]:
        """(per-token versions, exact?) of `result`, sent when the floor was `floor`."""
        if result.versions_exact or self.single_version:
            return list(result.versions), True
        if result.weight_version == floor or not result.output_ids:
            return list(result.versions), True
        return [min(floor, result.weight_version)] * len(result.output_ids), False


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
    versions_exact: bool = True
    """False when some model token's version is a lower bound (`VersionRule`)."""
    resume_prompt_tokens: int = 0
    """Prompt tokens sent again to resume aborted calls (`Completion.resume_prompt_tokens`)."""
    routed_experts: Any = None
    """The last model turn's routed experts: the engine reports them for the turn's whole
    input (every earlier turn and observation) plus its output, so the last one covers the
    trajectory up to its final model token."""
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
        self.versions_exact &= completion.versions_exact
        self.resume_prompt_tokens += completion.resume_prompt_tokens
        if completion.routed_experts is not None:
            self.routed_experts = completion.routed_experts

    def add_observation(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not produce (tool results, environment feedback): masked."""
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NO_VERSION] * len(token_ids))


class Hold:
    """Stops generation at a consistent point to collect the samples in flight (a checkpoint's cut).

    While closed, every call parks before its next engine call: calls decoding when it
    closes come back aborted (the worker aborts the engines' requests) with their partial
    output, and new calls park before their first. `wait_parked` returns once every
    active call has parked; `release` lets them all go on from their tokens."""

    def __init__(self) -> None:
        self._open = anyio.Event()
        self._open.set()
        self._changed = anyio.Event()
        self.active: set[int] = set()
        self.parked: set[int] = set()

    @property
    def is_closed(self) -> bool:
        return not self._open.is_set()

    def begin(self, completion: Completion) -> None:
        self.active.add(id(completion))

    def end(self, completion: Completion) -> None:
        self.active.discard(id(completion))
        self._notify()

    async def checkpoint(self, completion: Completion) -> None:
        """Park here while the hold is closed."""
        if self._open.is_set():
            return
        self.parked.add(id(completion))
        self._notify()
        try:
            await self._open.wait()
        finally:
            self.parked.discard(id(completion))

    def close(self) -> None:
        if self._open.is_set():
            self._open = anyio.Event()

    @property
    def all_parked(self) -> bool:
        """Whether every active call has parked."""
        return self.active <= self.parked

    async def wait_parked(self) -> None:
        while not self.all_parked:
            changed = self._changed
            await changed.wait()

    def release(self) -> None:
        self._open.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


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
    version_rule: VersionRule = field(default_factory=VersionRule)
    """How responses' tokens get their versions (exact, or a safe lower bound)."""
    return_routed_experts: bool = False
    """Ask engines for each token's routed experts (`rollout.return_routed_experts`)."""
    hold: Hold | None = None
    """Lets the rollout worker stop every call at a consistent point (a checkpoint's cut)."""
    completions: list[Completion] = field(default_factory=list)
    """Every completion this context's calls made, in order (what the in-flight report reads)."""

    async def generate(
        self, input_ids: list[int], *, max_new_tokens: int | None = None, **overrides: Any
    ) -> Completion:
        """One model turn from `input_ids`, resumed across aborts and retried across failures."""
        params = {**self.sampling_params, **overrides}
        budget = max_new_tokens or params.get("max_new_tokens", 128)
        completion = Completion()
        self.completions.append(completion)
        return await self.continue_completion(completion, input_ids, budget, params)

    async def continue_completion(
        self, completion: Completion, input_ids: list[int], budget: int, params: dict[str, Any]
    ) -> Completion:
        """Generate into `completion` (possibly holding tokens already: a sample resumed after
        an abort or a restart) until it finishes or holds `budget` tokens."""
        params = dict(params)
        failures = 0
        deadline = time.monotonic() + self.retry_timeout_s
        if self.hold is not None:
            self.hold.begin(completion)
        try:
            while True:
                if self.hold is not None:
                    await self.hold.checkpoint(completion)
                if len(completion.output_ids) >= budget:
                    completion.finish_reason = FinishReason.LENGTH
                    completion.is_finished = True
                    return completion
                params["max_new_tokens"] = budget - len(completion.output_ids)
                engine = self._engine(failures)
                floor = self.version_rule.floor()
                sent = input_ids + completion.output_ids
                try:
                    result = await engine.generate(sent, params, **self._generate_options())
                except EngineError as exc:
                    if exc.status == ABORTED_BEFORE_START and time.monotonic() < deadline:
                        continue  # no token was made: send it again (it waits out the pause)
                    failures += 1
                    is_client_error = exc.status is not None and 400 <= exc.status < 500
                    if is_client_error or time.monotonic() > deadline:
                        raise
                    log.warning("engine call failed (%s); retry %d", exc, failures)
                    await anyio.sleep(min(0.25 * 2**failures, 5.0))
                    continue
                if completion.num_engine_calls:
                    completion.resume_prompt_tokens += len(sent)
                completion.num_engine_calls += 1
                versions, is_exact = self.version_rule.versions(result, floor)
                completion.extend(result, versions, is_exact=is_exact)
                if not result.is_aborted:
                    completion.finish_reason = FinishReason(result.finish_reason.type)
                    completion.is_finished = True
                    return completion
                # Aborted by a weight update (pause mode "abort") or a checkpoint's cut: continue
                # from what we have.
                completion.num_resumes += 1
        finally:
            if self.hold is not None:
                self.hold.end(completion)

    async def generate_samples(
        self, input_ids: list[int], n: int, **overrides: Any
    ) -> list[Completion]:
        """`n` model turns from the same `input_ids` in one engine call (SGLang's `n`: they share
        the prefill and one HTTP round trip); a sample a weight update aborted is continued on
        its own. An engine failure falls back to n separate `generate`s."""
        params = {**self.sampling_params, **overrides}
        budget = params.get("max_new_tokens", 128)
        completions = [Completion() for _ in range(n)]
        self.completions.extend(completions)
        if self.hold is not None:  # parked like the calls it becomes, until the cut is done
            for completion in completions:
                self.hold.begin(completion)
                await self.hold.checkpoint(completion)
        floor = self.version_rule.floor()
        try:
            results = await self._engine(0).generate_many(
                [input_ids], {**params, "n": n}, **self._generate_options()
            )
        except EngineError as exc:
            is_client_error = exc.status is not None and 400 <= exc.status < 500
            if is_client_error and exc.status != ABORTED_BEFORE_START:
                for completion in completions:
                    self._end(completion)
                raise
            log.warning("batched engine call failed (%s); generating samples one by one", exc)
            results = []
        if len(results) != n:  # one by one, into the same completions (in order)
            results = [None] * n
        # Every result lands in its completion before anything else runs, so a cut
        # waiting for the calls to park sees the tokens.
        for completion, result in zip(completions, results, strict=True):
            if result is None:
                continue
            completion.num_engine_calls = 1
            versions, is_exact = self.version_rule.versions(result, floor)
            completion.extend(result, versions, is_exact=is_exact)
            if result.is_aborted:
                completion.num_resumes += 1
            else:
                completion.finish_reason = FinishReason(result.finish_reason.type)
                completion.is_finished = True
                self._end(completion)
        async with anyio.create_task_group() as tg:
            for completion in completions:
                if not completion.is_finished:
                    tg.start_soon(self.continue_completion, completion, input_ids, budget, params)
        return completions

    def _end(self, completion: Completion) -> None:
        if self.hold is not None:
            self.hold.end(completion)

    def _generate_options(self) -> dict[str, Any]:
        return {"return_routed_experts": True} if self.return_routed_experts else {}

    def _engine(self, num_failures: int):
        """The router when there is one (it keeps prefix affinity), else this session's engine;
        after a failure, another engine (a different session key) when there are several."""
        if self.engines.router is not None:
            return self.engines.router
        key = self.session_key if num_failures == 0 else f"{self.session_key}#{num_failures}"
        return self.engines.session(key)
