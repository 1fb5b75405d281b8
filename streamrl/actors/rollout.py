"""The rollout worker: prompts in, scored groups out, as many in flight as admission allows.

    loop:  credit = await sender.acquire()      # admission: waits while the learner is behind
           prompt = source.next()
           start_soon(run_group(prompt))        # n samples concurrently, each via generate_fn
    run_group: samples = generate + score (x n) -> Group -> sender.send (kept until acked)

Nothing generated is dropped: each trajectory becomes a `Sample` in
`streamrl.actors.samples`, a failed generation with status `generation_failed` (the
buffer's `failed` filter counts the group), a failed reward with reward 0 and status
`reward_failed`. When every one of the last `max_consecutive_failures` samples failed
(`streamrl.actors.failures`), the worker stops starting groups, reports its counters and
raises `SystematicFailure`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import anyio
import msgspec

from streamrl.actors.failures import (
    Failure,
    FailureWindow,
    generation_failure,
    is_engine_outage,
)
from streamrl.actors.in_flight import InFlight, resume_completion
from streamrl.actors.samples import RolloutCounters, make_sample
from streamrl.agents.api import (
    GenerateContext,
    GenerateFn,
    Trajectory,
    VersionRule,
)
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.limits import RequestRejected
from streamrl.queues.accounting import DataPosition, StreamState
from streamrl.queues.sender import StreamSender
from streamrl.types import (
    FinishReason,
    Group,
    PartialGroup,
    PartialSample,
    Prompt,
    Sample,
)

log = logging.getLogger(__name__)


def sample_seed(seed: int, prompt_seq: int, index: int) -> int:
    """The `sampling_seed` of sample `index` of prompt `prompt_seq` in a run seeded `seed`: a
    hash, so seeds of nearby prompts are unrelated; a group made in one call gets the seed
    of its sample 0, and the engine seeds sample j with it + j (SGLang's `n` does too)."""
    key = f"{seed}/{prompt_seq}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") // 4 + index


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
        max_consecutive_failures: int,
        generate_kwargs: dict[str, Any] | None = None,
        reward_timeout_s: float = 60.0,
        retry_timeout_s: float = 300.0,
        report_interval_s: float = 2.0,
        version_rule: VersionRule | None = None,
        seed: int | None = None,
        return_routed_experts: bool = False,
        resume: list[PartialGroup] = (),
    ) -> None:
        """`max_consecutive_failures` has no default here: the run's is
        `rollout.max_consecutive_failures`' (0: never stop)."""
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
        return await make_sample(
            prompt,
            index,
            trajectory,
            error,
            reward_fn=self.reward_fn,
            reward_timeout_s=self.reward_timeout_s,
            counters=self.counters,
            failures=self.failures,
            count_failure=self._count_failure,
        )
