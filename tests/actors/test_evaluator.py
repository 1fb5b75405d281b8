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
