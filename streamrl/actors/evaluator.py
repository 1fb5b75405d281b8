"""Evaluation alongside training: every `eval.interval` versions, score each eval data set
through the same engines (training generation goes on) and report to the learner.

Episodes are played by the run's own generate function (`rollout.generate_fn` with
`rollout.generate_kwargs`), so multi-turn and tool tasks are evaluated as they train;
only the sampling parameters and the number of samples are the eval data set's."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import numpy as np

from streamrl.actors.samples import score_trajectory
from streamrl.agents.api import GenerateContext
from streamrl.config import DataConfig, EvalDataset
from streamrl.data.source import PromptSource
from streamrl.fleet.engine_set import EngineSet
from streamrl.queues.sender import StreamSender
from streamrl.rewards import load_reward_fn

log = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 64


class Evaluator:
    def __init__(
        self,
        datasets: list[EvalDataset],
        *,
        data_cfg: DataConfig,
        interval: int,
        tokenizer: Any,
        engines: EngineSet,
        sender: StreamSender,
        default_reward_fn: str,
        reward_timeout_s: float,
        generate_fn: Any,
        generate_kwargs: dict[str, Any] | None = None,
        default_reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.generate_fn = generate_fn
        self.generate_kwargs = generate_kwargs or {}
        self.interval = interval
        self.engines = engines
        self.sender = sender
        self._done = anyio.Event()
        self._done.set()
        """Set while no evaluation is under way."""
        self.tokenizer = tokenizer
        self.reward_timeout_s = reward_timeout_s
        self.sets = []
        for index, dataset in enumerate(datasets):
            source = PromptSource.for_eval(dataset, data_cfg, tokenizer)
            count = (
                len(source) if not dataset.max_prompts else min(dataset.max_prompts, len(source))
            )
            prompts = [source.get(seq) for seq in range(count)]
            if dataset.reward_fn:
                reward_fn = load_reward_fn(
                    dataset.reward_fn,
                    dict(dataset.reward_kwargs),
                    key=f"eval.datasets[{index}].reward_fn",
                )
            else:
                reward_fn = load_reward_fn(default_reward_fn, default_reward_kwargs)
            self.sets.append((dataset, prompts, reward_fn))

    async def run(self) -> None:
        """Evaluate at version 0, interval, 2 * interval, ... until the stream stops."""
        next_version = self.sender.version
        while True:
            await self.sender.wait_version(next_version)
            if self.sender.is_stopped:
                return
            version = self.sender.version
            self._done = anyio.Event()
            for dataset, prompts, reward_fn in self.sets:
                report = await self.evaluate(dataset, prompts, reward_fn)
                report["version"] = version
                await self.sender.send_report("eval", report)
            self._done.set()
            next_version = (version // self.interval + 1) * self.interval

    async def finish_current(self) -> None:
        """Wait until the evaluation under way, if any, is reported (the run's last version is
        often evaluated while the run stops)."""
        await self._done.wait()

    async def evaluate(self, dataset: EvalDataset, prompts: list, reward_fn) -> dict[str, Any]:
        started = time.perf_counter()
        sampling = dataset.sampling.to_sglang()
        rewards = np.zeros((len(prompts), dataset.n_samples_per_prompt))
        lengths = np.zeros_like(rewards)
        versions: list[int] = []
        limit = anyio.Semaphore(MAX_CONCURRENT_REQUESTS)

        async def one(row: int, column: int) -> None:
            prompt = prompts[row]
            async with limit:
                ctx = GenerateContext(
                    engines=self.engines,
                    tokenizer=self.tokenizer,
                    sampling_params=dict(sampling),
                    kwargs=self.generate_kwargs,
                    session_key=f"eval-{dataset.name}-{row}-{column}",
                )
                trajectory = await self.generate_fn(ctx, prompt)
            reward = trajectory.reward
            if reward is None:
                outcome = await score_trajectory(
                    reward_fn, prompt, trajectory, timeout_s=self.reward_timeout_s
                )
                reward = outcome.reward
            rewards[row, column] = reward
            lengths[row, column] = len(trajectory.response_ids)
            versions.extend(v for v in trajectory.versions[:1] if v >= 0)

        async with anyio.create_task_group() as tg:
            for row in range(len(prompts)):
                for column in range(dataset.n_samples_per_prompt):
                    tg.start_soon(one, row, column)
        return {
            "dataset": dataset.name,
            "reward_mean": float(rewards.mean()),
            "pass_at_1": float((rewards > 0).mean()),
            f"pass_at_{dataset.n_samples_per_prompt}": float((rewards > 0).any(axis=1).mean()),
            "num_prompts": len(prompts),
            "num_samples": int(rewards.size),
            "response_len_mean": float(lengths.mean()),
            "token_version_min": min(versions, default=-1),
            "seconds": time.perf_counter() - started,
        }
