"""The rollout worker: prompts in, scored groups out, as many in flight as admission allows.

    loop:  credit = await sender.acquire()      # admission: waits while the learner is behind
           prompt = source.next()
           start_soon(run_group(prompt))        # n samples concurrently, each via generate_fn
    run_group: samples = generate + score (x n) -> Group -> sender.send (kept until acked)

Nothing generated is dropped: a sample whose generate function fails after
its retries is kept with status `generation_failed` (the buffer's `failed`
filter counts the group); a reward that raises or times out gives reward 0
with status `reward_failed` and the error in the sample's metadata.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from streamrl.agents.api import GenerateContext, GenerateFn, Trajectory, score_trajectory
from streamrl.fleet.engine_set import EngineSet
from streamrl.queues.transport import StreamSender
from streamrl.types import FinishReason, Group, Prompt, Sample, SampleStatus

log = logging.getLogger(__name__)


@dataclass
class RolloutCounters:
    groups_started: int = 0
    groups_sent: int = 0
    samples: int = 0
    response_tokens: int = 0
    generation_failures: int = 0
    reward_failures: int = 0
    resumes: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    busy_s: float = 0.0
    """Sum over samples of generate-call wall time (engine-side occupancy proxy)."""

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "finish_reasons": dict(self.finish_reasons)}


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
        self.counters = RolloutCounters()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Start groups while credits come. When the receiver says stop (training is over),
        report the final counters and abandon the groups still in flight (they are counted
        as in flight at stop)."""
        task_status.started()
        async with anyio.create_task_group() as groups:
            while await self.sender.acquire():
                prompt = self.source.next()
                self.counters.groups_started += 1
                groups.start_soon(self._run_group, prompt)
            await self.report()
            groups.cancel_scope.cancel()

    async def report(self) -> None:
        await self.sender.send_report("rollout", self.counters.as_dict())

    async def report_loop(self) -> None:
        """Send counters every `report_interval_s` (the learner logs them with each step)."""
        while True:
            await anyio.sleep(self.report_interval_s)
            await self.report()

    async def _run_group(self, prompt: Prompt) -> None:
        started_at = time.time()
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
        self.counters.groups_sent += 1

    async def run_sample(self, prompt: Prompt, index: int) -> Sample:
        """One sample of `prompt` through the generate function and the reward (no group)."""
        try:
            result = (await self.generate_fn(self._context(f"{prompt.seq}-{index}"), prompt), None)
        except Exception as exc:
            result = self._failed(prompt, index, exc)
        return await self._to_sample(prompt, index, *result)

    def _context(self, session_key: str) -> GenerateContext:
        return GenerateContext(
            engines=self.engines,
            tokenizer=self.tokenizer,
            sampling_params=dict(self.sampling_params),
            kwargs=self.generate_kwargs,
            session_key=session_key,
            retry_timeout_s=self.retry_timeout_s,
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
                    (t, None) for t in await for_group(self._context(f"{prompt.seq}"), prompt, n)
                ]
            except Exception as exc:  # every engine failed, or the user's code raised
                results = [self._failed(prompt, index, exc) for index in range(n)]
        else:
            results: list = [None] * n

            async def one(index: int) -> None:
                try:
                    trajectory = await self.generate_fn(
                        self._context(f"{prompt.seq}-{index}"), prompt
                    )
                    results[index] = (trajectory, None)
                except Exception as exc:
                    results[index] = self._failed(prompt, index, exc)

            async with anyio.create_task_group() as tg:
                for index in range(n):
                    tg.start_soon(one, index)
        self.counters.busy_s += time.perf_counter() - started
        return results

    def _failed(self, prompt: Prompt, index: int, exc: Exception) -> tuple[Trajectory, str]:
        """Keep a record of a sample that could not be generated (the group will be filtered)."""
        log.warning("generate failed for prompt %d sample %d: %r", prompt.seq, index, exc)
        self.counters.generation_failures += 1
        return Trajectory(finish_reason=FinishReason.ERROR), f"{type(exc).__name__}: {exc}"

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
        if trajectory.reward_error is not None and status is SampleStatus.OK:
            self.counters.reward_failures += 1
            status = SampleStatus.REWARD_FAILED
            metadata["reward_error"] = trajectory.reward_error
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
        self.counters.samples += 1
        self.counters.resumes += trajectory.num_resumes
        self.counters.response_tokens += len(trajectory.response_ids)
        self.counters.finish_reasons[str(trajectory.finish_reason)] += 1
        return Sample(
            prompt_ids=prompt.input_ids if trajectory.prompt_ids is None else trajectory.prompt_ids,
            response_ids=trajectory.response_ids,
            logprobs=trajectory.logprobs,
            versions=trajectory.versions,
            loss_mask=trajectory.loss_mask,
            reward=float(reward or 0.0),
            finish_reason=trajectory.finish_reason,
            status=status,
            response_text=trajectory.text,
            metadata=metadata,
            turn_starts=trajectory.turn_starts,
        )
