"""The rollout worker: prompts in, scored groups out, as many in flight as admission allows.

    loop:  credit = await sender.acquire()      # admission: waits while the learner is behind
           prompt = source.next()
           start_soon(run_group(prompt))        # n samples concurrently, each via generate_fn
    run_group: samples = generate + score (x n) -> Group -> sender.send (kept until acked)

Nothing generated is dropped: a sample whose generate function fails after
its retries is kept with status `generation_failed` (the buffer's `failed`
filter counts the group); a reward that raises or times out gives reward 0
with status `reward_failed` and the error in the sample's metadata. When every
one of the last `max_consecutive_failures` samples failed (`streamrl.actors.failures`),
the worker stops starting groups, reports its counters and raises `SystematicFailure`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import numpy as np

from streamrl.actors.failures import (
    Failure,
    FailureWindow,
    Stage,
    generation_failure,
    is_engine_outage,
)
from streamrl.actors.in_flight import InFlight, resume_completion
from streamrl.agents.api import (
    GenerateContext,
    GenerateFn,
    Trajectory,
    VersionRule,
    score_trajectory,
)
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.limits import RequestRejected
from streamrl.queues.accounting import DataPosition, StreamState
from streamrl.queues.transport import StreamSender
from streamrl.types import (
    FinishReason,
    Group,
    PartialGroup,
    PartialSample,
    Prompt,
    Sample,
    SampleStatus,
)

log = logging.getLogger(__name__)


def sample_seed(seed: int, prompt_seq: int, index: int) -> int:
    """The `sampling_seed` of sample `index` of prompt `prompt_seq` in a run seeded `seed`: a
    hash, so seeds of nearby prompts are unrelated; a group made in one call gets the seed
    of its sample 0, and the engine seeds sample j with it + j (SGLang's `n` does too)."""
    key = f"{seed}/{prompt_seq}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") // 4 + index


@dataclass
class RolloutCounters:
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


class RolloutWorker:
    """Turns prompts from `source` into Groups streamed through `sender`."""

    def __init__(
        self,
        *,
        worker_id: str,
        source: Any,
        sender: StreamSender,
        engines: EngineSet,
        tokenizer: Any,
        generate_fn: GenerateFn,
        reward_fn: Any,
        n_samples_per_prompt: int,
        sampling_params: dict[str, Any],
        generate_kwargs: dict[str, Any] | None = None,
        reward_timeout_s: float = 60.0,
        retry_timeout_s: float = 300.0,
        report_interval_s: float = 2.0,
        version_rule: VersionRule | None = None,
        seed: int | None = None,
        return_routed_experts: bool = False,
        resume: list[PartialGroup] = (),
        max_consecutive_failures: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.source = source
        self.sender = sender
        self.engines = engines
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.reward_fn = reward_fn
        self.n_samples_per_prompt = n_samples_per_prompt
        self.sampling_params = sampling_params
        self.generate_kwargs = generate_kwargs or {}
        self.reward_timeout_s = reward_timeout_s
        self.retry_timeout_s = retry_timeout_s
        self.report_interval_s = report_interval_s
        if version_rule is None:  # the engines serve at least what the trainer announced
            version_rule = VersionRule(floor=lambda: sender.version if sender else 0)
        self.version_rule = version_rule
        self.return_routed_experts = return_routed_experts
        self.counters = RolloutCounters()
        self.seed = seed
        """With a seed every sample gets its own `sampling_seed` (`sample_seed`)."""
        self.start_position = source.position if source is not None else DataPosition()
        """Where the stream started in this process (for `stream_state`)."""
        self.in_flight = InFlight(resumable=getattr(generate_fn, "resumable", False))
        """Groups started and not yet sent (`streamrl.actors.in_flight`)."""
        self.resume = list(resume)
        """Groups a checkpoint saved in flight: started before any new prompt."""
        self.resumed_seqs: list[int] = []
        self.failures = FailureWindow(max_consecutive_failures)
        """Samples failed in a row (`streamrl.actors.failures`); 0: never systematic."""
        self._groups: anyio.CancelScope | None = None
        """The scope of the groups `run` started (cancelled by a systematic failure)."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Start groups while credits come. When the receiver says stop (training is over),
        report the final counters and abandon the groups still in flight (they are counted
        as in flight at stop). A systematic failure abandons them the same way, then
        raises `SystematicFailure`."""
        task_status.started()
        async with anyio.create_task_group() as groups:
            self._groups = groups.cancel_scope
            while await self.sender.acquire():
                partial = self.resume.pop(0) if self.resume else None
                if partial is None:
                    prompt = self.source.next()
                else:
                    prompt = self.source.get(partial.prompt_seq)
                    self.resumed_seqs.append(prompt.seq)
                self.counters.groups_started += 1
                self.in_flight.started(prompt.seq)
                groups.start_soon(self._run_group, prompt, partial)
            await self.report()
            groups.cancel_scope.cancel()
        if self.failures.is_systematic:
            await self.report()  # after every group sent: the cut sees the rest in flight
            raise self.failures.error()

    async def report(self) -> None:
        """Counters, and where the prompt stream stands: the receiver checks against it that
        every prompt this worker started is received, in flight or in transit
        (`streamrl.queues.accounting`)."""
        await self.sender.send_report(
            "rollout", {**self.counters.as_dict(), "stream": self.stream_state().as_dict()}
        )

    def stream_state(self) -> StreamState:
        start = self.start_position
        return StreamState(
            first_seq=start.next_seq,
            start_skip=list(start.skip),
            next_seq=self.source.position.next_seq,
            too_long=sorted(getattr(self.source, "too_long_seqs", ())),
            in_flight=sorted(self.in_flight.seqs),
            unacked=sorted(int(group_id[1:]) for group_id in self.sender.unacked_ids),
            resumed=list(self.resumed_seqs),
        )

    async def in_flight_loop(self) -> None:
        """Answer every `CollectInFlight` request with the groups in flight (their tokens so
        far)."""
        step = -1
        while (step := await self.sender.next_in_flight_request(step)) >= 0:
            groups, cost = await self.in_flight.collect(self.engines, self.n_samples_per_prompt)
            self.counters.snapshots += 1
            await self.sender.send_report(
                "in_flight", {"step": step, "groups": msgspec.to_builtins(groups), **cost}
            )

    async def report_loop(self) -> None:
        """Send counters every `report_interval_s` (the learner logs them with each step)."""
        while True:
            await anyio.sleep(self.report_interval_s)
            await self.report()

    async def _run_group(self, prompt: Prompt, partial: PartialGroup | None = None) -> None:
        started_at = time.time()
        if partial is not None and partial.samples:
            trajectories = await self._resume(prompt, partial)
        else:
            self.counters.regenerated_groups += partial is not None
            trajectories = await self._generate(prompt)
        samples: list[Sample | None] = [None] * len(trajectories)

        async def score_one(index: int) -> None:
            samples[index] = await self._to_sample(prompt, index, *trajectories[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(trajectories)):
                tg.start_soon(score_one, index)
        group = Group(
            group_id=f"s{prompt.seq}",
            prompt_seq=prompt.seq,
            prompt_index=prompt.index,
            epoch=prompt.epoch,
            samples=samples,
            label=prompt.label,
            started_at=started_at,
            worker_id=self.worker_id,
        )
        group.mark_finished()
        await self.sender.send(group)
        self.in_flight.sent(prompt.seq)
        self.counters.groups_sent += 1

    async def run_sample(self, prompt: Prompt, index: int) -> Sample:
        """One sample of `prompt` through the generate function and the reward (no group)."""
        return await self._to_sample(prompt, index, *await self._one(prompt, index))

    async def _resume(
        self, prompt: Prompt, partial: PartialGroup
    ) -> list[tuple[Trajectory, str | None]]:
        """A group saved in flight: each sample continued from its tokens (`in_flight`)."""
        results: list = [None] * self.n_samples_per_prompt
        finish = getattr(self.generate_fn, "finish", None)

        async def one(sample: PartialSample) -> None:
            context = self._context(f"{prompt.seq}-{sample.index}", prompt, sample.index)
            try:
                completion = await resume_completion(context, sample, list(prompt.input_ids))
            except Exception as exc:
                results[sample.index] = self._failed(prompt, sample.index, exc)
                return
            trajectory = Trajectory()
            trajectory.add_completion(completion)
            if finish is not None:  # what the generate function does after its one turn
                trajectory = finish(context, trajectory)
            results[sample.index] = (trajectory, None)

        async with anyio.create_task_group() as tg:
            for sample in partial.samples:
                self.counters.resumed_samples += 1
                self.counters.resumed_tokens += len(sample.output_ids)
                tg.start_soon(one, sample)
        missing = [i for i, result in enumerate(results) if result is None]
        for index in missing:  # a sample the in-flight report did not hold: made anew
            results[index] = await self._one(prompt, index)
        return results

    def _context(
        self, session_key: str, prompt: Prompt, index: int, *, whole_group: bool = False
    ) -> GenerateContext:
        params = dict(self.sampling_params)
        if self.seed is not None:
            params["sampling_seed"] = sample_seed(self.seed, prompt.seq, index)
        context = self._new_context(session_key, params)
        self.in_flight.add_context(prompt.seq, None if whole_group else index, context)
        return context

    def _new_context(self, session_key: str, params: dict[str, Any]) -> GenerateContext:
        return GenerateContext(
            engines=self.engines,
            tokenizer=self.tokenizer,
            sampling_params=params,
            kwargs=self.generate_kwargs,
            session_key=session_key,
            retry_timeout_s=self.retry_timeout_s,
            hold=self.in_flight.hold,
            version_rule=self.version_rule,
            return_routed_experts=self.return_routed_experts,
        )

    async def _generate(self, prompt: Prompt) -> list[tuple[Trajectory, str | None]]:
        """The group's n trajectories, each with the error that ended it (None when it did not
        fail): one `for_group` call when the generate function has one, else n calls."""
        n = self.n_samples_per_prompt
        started = time.perf_counter()
        for_group = getattr(self.generate_fn, "for_group", None)
        if for_group is not None:
            try:
                results = [
                    (t, None)
                    # One call for the group: the engine seeds sample j with seed + j.
                    for t in await for_group(
                        self._context(f"{prompt.seq}", prompt, 0, whole_group=True), prompt, n
                    )
                ]
            except Exception as exc:  # every engine failed, or the user's code raised
                results = [self._failed(prompt, index, exc) for index in range(n)]
        else:
            results: list = [None] * n

            async def one(index: int) -> None:
                results[index] = await self._one(prompt, index)

            async with anyio.create_task_group() as tg:
                for index in range(n):
                    tg.start_soon(one, index)
        self.counters.busy_s += time.perf_counter() - started
        return results

    async def _one(self, prompt: Prompt, index: int) -> tuple[Trajectory, str | None]:
        """Sample `index` of `prompt` through the generate function (the error if it failed)."""
        try:
            context = self._context(f"{prompt.seq}-{index}", prompt, index)
            return await self.generate_fn(context, prompt), None
        except Exception as exc:
            return self._failed(prompt, index, exc)

    def _failed(self, prompt: Prompt, index: int, exc: Exception) -> tuple[Trajectory, str]:
        """Keep a record of a sample that could not be generated (the group will be filtered)."""
        log.warning("generate failed for prompt %d sample %d: %r", prompt.seq, index, exc)
        self.counters.generation_failures += 1
        if isinstance(exc, RequestRejected):
            self.counters.rejected[exc.reason] += 1
        if not is_engine_outage(exc):
            self._count_failure(generation_failure(exc, f"prompt {prompt.seq} sample {index}"))
        return Trajectory(finish_reason=FinishReason.ERROR), f"{type(exc).__name__}: {exc}"

    def _count_failure(self, failure: Failure) -> None:
        """One more sample failed; when that makes the failures systematic, stop the groups
        (`run` raises)."""
        if self.failures.failed(failure) and self._groups is not None:
            self._groups.cancel()

    async def _to_sample(
        self, prompt: Prompt, index: int, trajectory: Trajectory, error: str | None
    ) -> Sample:
        """Score one trajectory; a failing reward is recorded in the sample, never raised."""
        status = SampleStatus.OK if error is None else SampleStatus.GENERATION_FAILED
        metadata: dict[str, Any] = {"index": index, **trajectory.metadata}
        metadata["num_turns"] = trajectory.num_turns
        if error is not None:
            metadata["error"] = error
        reward = trajectory.reward
        where = f"prompt {prompt.seq} sample {index}"
        if trajectory.reward_error is not None and status is SampleStatus.OK:
            self.counters.reward_failures += 1
            status = SampleStatus.REWARD_FAILED
            metadata["reward_error"] = trajectory.reward_error
            self._count_failure(Failure(Stage.REWARD, trajectory.reward_error, where))
        if reward is None and status is SampleStatus.OK:
            outcome = await score_trajectory(
                self.reward_fn, prompt, trajectory, timeout_s=self.reward_timeout_s
            )
            reward = outcome.reward
            metadata.update({f"reward/{k}": v for k, v in outcome.metrics.items()})
            if outcome.error is not None:
                self.counters.reward_failures += 1
                status = SampleStatus.REWARD_FAILED
                metadata["reward_error"] = outcome.error
                log.warning("reward failed for %s: %s", where, outcome.error)
                failure = Failure(Stage.REWARD, outcome.error, where, outcome.traceback)
                self._count_failure(failure)
        if status is SampleStatus.OK:
            self.failures.succeeded()
        self.counters.samples += 1
        self.counters.resumes += trajectory.num_resumes
        self.counters.resume_prompt_tokens += trajectory.resume_prompt_tokens
        self.counters.inexact_version_samples += not trajectory.versions_exact
        self.counters.response_tokens += len(trajectory.response_ids)
        self.counters.finish_reasons[str(trajectory.finish_reason)] += 1
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
            routed_experts=self._routed_experts(trajectory, len(prompt_ids)),
            turn_starts=trajectory.turn_starts,
        )

    def _routed_experts(self, trajectory: Trajectory, num_prompt_tokens: int):
        """The last model turn's routed experts as the sample's `[tokens - 1, layers * k]`:
        rows after the last model token (a closing observation) are -1; a report with more
        rows than the sample has tokens belongs to other tokens and is dropped (counted)."""
        routed = trajectory.routed_experts
        if routed is None:
            return None
        rows = num_prompt_tokens + len(trajectory.response_ids) - 1
        if len(routed) > rows or rows <= 0:
            self.counters.routed_experts_dropped += 1
            log.warning(
                "routed experts for %d tokens, the sample has %d: dropped", len(routed), rows
            )
            return None
        out = np.full((rows, routed.shape[1]), -1, dtype=np.int16)
        out[: len(routed)] = routed
        return out
