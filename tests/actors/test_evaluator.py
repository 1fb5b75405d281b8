"""The evaluator's episodes: what reaches the generate function."""

from __future__ import annotations

import anyio

from streamrl.actors.evaluator import Evaluator
from streamrl.agents.api import Trajectory
from streamrl.config import DataConfig, EvalDataset, SamplingConfig


def test_the_evaluators_sampling_params_reach_the_generate_function_with_stop_token_ids(
    tiny_model_dir,
):
    from streamrl.models import load_tokenizer

    seen: list[dict] = []

    async def recording_generate(ctx, prompt) -> Trajectory:
        seen.append(dict(ctx.sampling_params))
        return Trajectory(response_ids=[7], loss_mask=[1], logprobs=[-1.0], versions=[0], text="x")

    sampling = SamplingConfig(
        max_new_tokens=5, temperature=0.0, stop=["\n\n"], stop_token_ids=[11, 13]
    )
    dataset = EvalDataset(
        name="capitals",
        path="builtin:capitals?n=3&seed=1",
        sampling=sampling,
        reward_fn="streamrl.tasks.capitals:capital_reward",
    )
    evaluator = Evaluator(
        [dataset],
        data_cfg=DataConfig(path="x", apply_chat_template=False),
        interval=1,
        tokenizer=load_tokenizer(tiny_model_dir),
        engines=None,
        sender=None,
        default_reward_fn="streamrl.tasks.capitals:capital_reward",
        reward_timeout_s=10.0,
        generate_fn=recording_generate,
    )
    ((_, prompts, reward_fn),) = evaluator.sets
    report = anyio.run(evaluator.evaluate, dataset, prompts, reward_fn)
    assert report["num_samples"] == 3 and len(seen) == 3
    for params in seen:
        assert params == sampling.to_sglang()
        assert params["stop_token_ids"] == [11, 13]
        assert params["stop"] == ["\n\n"]


class FakeSender:
    """The evaluator's view of the stream: the version served, stop, reports."""

    def __init__(self) -> None:
        self.version = 4
        self.is_stopped = False
        self.reports: list[dict] = []
        self._stopped = anyio.Event()

    async def wait_version(self, version: int) -> None:
        if version > self.version:
            await self._stopped.wait()

    async def send_report(self, kind: str, payload: dict) -> None:
        self.reports.append(payload)

    def stop(self) -> None:
        self.is_stopped = True
        self._stopped.set()


def test_a_stopping_rollout_waits_for_the_evaluation_under_way_to_be_reported(tiny_model_dir):
    """The last version is often evaluated while the run stops: `finish_current` returns once
    that evaluation's report is sent, and at once when none is under way."""
    from streamrl.models import load_tokenizer

    release = anyio.Event()

    async def slow_generate(ctx, prompt) -> Trajectory:
        await release.wait()
        return Trajectory(response_ids=[7], loss_mask=[1], logprobs=[-1.0], versions=[4], text="x")

    sender = FakeSender()
    evaluator = Evaluator(
        [EvalDataset(name="capitals", path="builtin:capitals?n=2&seed=1")],
        data_cfg=DataConfig(path="x", apply_chat_template=False),
        interval=4,
        tokenizer=load_tokenizer(tiny_model_dir),
        engines=None,
        sender=sender,
        default_reward_fn="streamrl.tasks.capitals:capital_reward",
        reward_timeout_s=10.0,
        generate_fn=slow_generate,
    )

    async def main() -> None:
        with anyio.fail_after(30):
            await evaluator.finish_current()  # nothing under way yet
            async with anyio.create_task_group() as tg:
                tg.start_soon(evaluator.run)
                await anyio.wait_all_tasks_blocked()
                sender.stop()  # the run stops while version 4 is being evaluated
                assert not sender.reports
                tg.start_soon(_release_later, release)
                await evaluator.finish_current()
                assert [r["version"] for r in sender.reports] == [4]
                tg.cancel_scope.cancel()

    anyio.run(main)


async def _release_later(event: anyio.Event) -> None:
    await anyio.wait_all_tasks_blocked()
    event.set()
