"""slime's generate and reward functions run under streamrl (`streamrl.compat.slime`).

The engine tests start a real embedded engine (`streamrl engine serve`) on a tiny random
model: a slime-style function must give what streamrl's own path gives for the same
engine and seeds (tokens, logprobs, loss mask, per-token versions), including a multi-turn
tool loop whose tool moves the engine to a new weight version between turns.
"""

from __future__ import annotations

import numpy as np
import pytest
import slime_functions

from streamrl.actors.rollout import RolloutWorker
from streamrl.agents import env as agent_env
from streamrl.agents import single_turn
from streamrl.agents.api import Completion, GenerateContext
from streamrl.compat import slime
from streamrl.compat.slime.engine_calls import EngineCall
from streamrl.compat.slime.sample import Sample
from streamrl.compat.slime.trajectory import SampleError, to_trajectory
from streamrl.types import NO_VERSION, FinishReason, Prompt, SampleStatus

pytestmark = pytest.mark.anyio
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from streamrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


def make_prompt(tokenizer, text: str = "What is 2 + 2?", seq: int = 0) -> Prompt:
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return Prompt(seq=seq, index=seq, epoch=0, text=rendered, input_ids=ids, label="4")


def worker(engine_set, tokenizer, generate_fn, **generate_kwargs) -> RolloutWorker:
    return RolloutWorker(
        worker_id="w",
        source=None,
        sender=None,
        engines=engine_set,
        tokenizer=tokenizer,
        generate_fn=generate_fn,
        reward_fn=lambda inp: 0.5,
        n_samples_per_prompt=2,
        sampling_params=dict(SAMPLING),
        max_consecutive_failures=0,
        generate_kwargs=generate_kwargs,
        seed=7,  # every sample its own sampling_seed: seeded sampling, reproducible
    )


def same_tokens(a, b) -> None:
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.versions, b.versions)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.turn_starts == b.turn_starts and a.versions_exact and b.versions_exact


# ---------------------------------------------------------------- against the native path


async def test_a_slime_single_turn_function_gives_the_native_tokens_logprobs_and_versions(
    engine, tokenizer
):
    from streamrl.fleet.engine_set import EngineSet

    prompt = make_prompt(tokenizer)
    async with EngineSet([engine.url]) as engine_set:
        native = worker(engine_set, tokenizer, single_turn.generate)
        compat = worker(
            engine_set, tokenizer, slime.generate, function="slime_functions:single_turn"
        )
        for index in range(2):
            expected = await native.run_sample(prompt, index)
            got = await compat.run_sample(prompt, index)
            assert got.status is SampleStatus.OK and len(got.response_ids) > 0
            same_tokens(got, expected)
            assert got.response_text == expected.response_text
            assert got.metadata["slime/engine_calls"] == 1


async def test_a_slime_multi_turn_tool_function_matches_the_native_environment_loop(
    engine, tokenizer, tiny_model_dir
):
    """Three model turns, two tool outputs (loss mask 0); the tool moves the engine to
    version 1, then 2, so the turns carry versions 0, 1, 2 in both paths."""
    from streamrl.fleet.engine_set import EngineSet

    prompt = make_prompt(tokenizer, "Find the capital of France.")
    where = {"engine_url": engine.url, "model_dir": tiny_model_dir}
    async with EngineSet([engine.url]) as engine_set:
        samples = []
        for generate_fn, kwargs in [
            (
                agent_env.generate,
                {
                    "env": "slime_functions:TurnTool",
                    "env_kwargs": {**where, "max_turns": 3},
                    "max_turns": 3,
                    "reward": "reward_fn",
                },
            ),
            (
                slime.generate,
                {
                    "function": "slime_functions:tool_turns",
                    "args": {**where, "max_turns": 3},
                },
            ),
        ]:
            await slime_functions.set_engine_version(engine.url, tiny_model_dir, 0)
            samples.append(
                await worker(engine_set, tokenizer, generate_fn, **kwargs).run_sample(prompt, 0)
            )
    native, compat = samples
    same_tokens(compat, native)
    assert compat.metadata["num_turns"] == native.metadata["num_turns"] == 3
    model_versions = [int(v) for v in compat.versions if v != NO_VERSION]
    assert sorted(set(model_versions)) == [0, 1, 2]
    assert (compat.versions[compat.loss_mask == 0] == NO_VERSION).all()
    assert (compat.logprobs[compat.loss_mask == 0] == 0).all()


# ---------------------------------------------------------------- versions of what no call made


def call(output_ids, versions, *, exact: bool = True) -> EngineCall:
    completion = Completion(
        output_ids=list(output_ids),
        logprobs=[-0.1 * (i + 1) for i in range(len(output_ids))],
        versions=list(versions),
        versions_exact=exact,
    )
    return EngineCall(input_ids=[1, 2], completion=completion)


def test_every_trained_token_takes_the_version_of_the_engine_call_that_made_it():
    sample = Sample(tokens=[1, 2, 10, 11, 50, 51, 12, 13], response_length=6)
    sample.loss_mask = [1, 1, 0, 0, 1, 1]
    sample.rollout_log_probs = [-1.0, -2.0, 0.0, 0.0, -3.0, -4.0]
    sample.status = Sample.Status.COMPLETED
    calls = [call([10, 11], [3, 4]), call([12, 13, 14], [5, 5, 5])]  # the last token dropped
    trajectory = to_trajectory(sample, calls, floor_version=0)
    assert trajectory.versions == [3, 4, NO_VERSION, NO_VERSION, 5, 5]
    assert trajectory.logprobs == [-1.0, -2.0, 0.0, 0.0, -3.0, -4.0]
    assert trajectory.prompt_ids == [1, 2] and trajectory.turn_starts == [0, 4]
    assert trajectory.versions_exact and trajectory.finish_reason is FinishReason.STOP


def test_a_trained_token_no_call_produced_gets_the_oldest_possible_version_and_is_inexact():
    sample = Sample(tokens=[1, 2, 10, 99, 11], response_length=3, rollout_log_probs=[-1.0] * 3)
    trajectory = to_trajectory(sample, [call([10, 11], [6, 7])], floor_version=4)
    assert trajectory.versions == [6, 4, 7]  # 99 came from no call: the floor, a lower bound
    assert not trajectory.versions_exact
    assert trajectory.metadata["slime/unmatched_tokens"] == 1
    with pytest.raises(SampleError, match="no rollout_log_probs"):
        to_trajectory(Sample(tokens=[1, 99], response_length=1), [call([10], [0])], floor_version=0)


def test_a_sample_that_was_aborted_or_that_is_removed_is_never_trained():
    with pytest.raises(SampleError, match="status aborted"):
        to_trajectory(Sample(status=Sample.Status.ABORTED), [], floor_version=0)
    removed = Sample(tokens=[1, 10], response_length=1, remove_sample=True)
    trajectory = to_trajectory(removed, [call([10], [0])], floor_version=0)
    assert trajectory.loss_mask == [0] and trajectory.metadata["slime/remove_sample"]


async def test_a_text_payload_is_the_same_call_and_retokenized_text_is_never_silently_trained(
    engine, tokenizer
):
    from streamrl.fleet.engine_set import EngineSet

    prompt = make_prompt(tokenizer)
    async with EngineSet([engine.url]) as engine_set:

        async def run(function: str):
            compat = worker(engine_set, tokenizer, slime.generate, function=function)
            return await compat.run_sample(prompt, 0)

        by_ids = await run("slime_functions:single_turn")
        by_text = await run("slime_functions:text_payload")
        sample = await run("slime_functions:retokenized")
    # A text payload is encoded as the engine encodes it: the same call, the same tokens.
    same_tokens(by_text, by_ids)
    # Re-tokenized text: a token some call made keeps its version and logprob; one no call
    # made has no behaviour logprob (this function keeps none), which fails the sample.
    if sample.status is SampleStatus.OK:
        assert sample.metadata["slime/unmatched_tokens"] == 0 and sample.versions_exact
    else:
        assert "no rollout_log_probs" in sample.metadata["error"]


# ---------------------------------------------------------------- groups, rewards, failures


def context(engine_set, tokenizer, **kwargs) -> GenerateContext:
    return GenerateContext(
        engines=engine_set,
        tokenizer=tokenizer,
        sampling_params={**SAMPLING, "sampling_seed": 11},
        kwargs=kwargs,
    )


async def test_the_batch_form_and_a_group_reward_are_called_once_per_group(
    engine, tokenizer, monkeypatch
):
    from streamrl.fleet.client import EngineClient
    from streamrl.fleet.engine_set import EngineSet

    seeds: dict[tuple[int, ...], int] = {}  # response ids -> the sampling_seed they were drawn with
    generate = EngineClient.generate

    async def seen(self, input_ids, sampling_params=None, **kwargs):
        result = await generate(self, input_ids, sampling_params, **kwargs)
        seeds[tuple(result.output_ids)] = sampling_params["sampling_seed"]
        return result

    monkeypatch.setattr(EngineClient, "generate", seen)  # the real engine answers every call
    prompt = make_prompt(tokenizer, seq=3)
    kwargs = {
        "function": "slime_functions.batch_generate",  # slime's dotted form
        "reward": "slime_functions:rank_in_group",
        "group_reward": True,
    }
    async with EngineSet([engine.url]) as engine_set:
        group = await slime.generate_group.for_group(
            context(engine_set, tokenizer, **kwargs), prompt, 3
        )
        alone = await slime.generate_group.for_group(
            context(engine_set, tokenizer, function="slime_functions:single_turn"), prompt, 3
        )
    assert [t.reward for t in group] == [0.0, 1.0, 2.0]
    assert all(t.metadata["evaluation"] is False and t.num_turns == 1 for t in group)
    # Call k of the batch gets sampling_seed 11 + k, as sample k of the per-sample form does.
    # (Not their tokens compared: the two forms' calls meet different batches in the engine,
    # whose float sums differ in the last bits, and a draw that lands at the edge between two
    # tokens then picks its neighbour: 45625 against 45626 in one fresh clone's run.)
    assert [seeds[tuple(t.response_ids)] for t in group] == [11, 12, 13]
    assert [seeds[tuple(t.response_ids)] for t in alone] == [11, 12, 13]
    versions = {version for t in [*group, *alone] for version in t.versions}
    assert len(versions) == 1 and all(len(t.versions) == len(t.response_ids) for t in group)


async def test_a_failing_reward_scores_zero_and_an_aborted_sample_is_a_failed_generation(
    engine, tokenizer
):
    from streamrl.fleet.engine_set import EngineSet

    prompt = make_prompt(tokenizer)
    async with EngineSet([engine.url]) as engine_set:
        scored = await worker(
            engine_set, tokenizer, slime.generate, reward="slime_functions:response_length_reward"
        ).run_sample(prompt, 0)
        failed_reward = await worker(
            engine_set, tokenizer, slime.generate, reward="slime_functions:failing_reward"
        ).run_sample(prompt, 0)
        aborted = await worker(
            engine_set, tokenizer, slime.generate, function="slime_functions:gives_up"
        ).run_sample(prompt, 0)
    assert scored.status is SampleStatus.OK and scored.reward == 1.0  # the default function
    assert failed_reward.status is SampleStatus.REWARD_FAILED and failed_reward.reward == 0.0
    assert "the verifier is down" in failed_reward.metadata["reward_error"]
    assert aborted.status is SampleStatus.GENERATION_FAILED
    assert "status aborted" in aborted.metadata["error"]


async def test_args_answers_slimes_flags_and_names_the_key_for_one_it_does_not_fill(
    engine, tokenizer
):
    from urllib.parse import urlsplit

    from streamrl.compat.slime.args import RunFacts, build_args
    from streamrl.fleet.engine_set import EngineSet

    async with EngineSet([engine.url]) as engine_set:
        ctx = context(engine_set, tokenizer, args={"search_topk": 3})
        args = build_args(
            ctx, RunFacts(batch_size=8), options=slime.SlimeOptions(args={"search_topk": 3})
        )
    assert (args.sglang_router_ip, args.sglang_router_port) == (
        urlsplit(engine.url).hostname,
        urlsplit(engine.url).port,
    )
    assert args.rollout_max_response_len == 6 and args.rollout_temperature == 1.0
    assert args.rollout_batch_size == 8 and args.search_topk == 3
    with pytest.raises(AttributeError, match=r"rollout\.generate_kwargs\.args"):
        _ = args.search_url
    state = slime.GenerateState(args)
    assert state is slime.GenerateState(args) and state.tokenizer is tokenizer
    assert state.sampling_params["max_new_tokens"] == 6 and state.sampling_params["no_stop_trim"]


def test_streamrl_check_imports_the_slime_functions_named_in_generate_kwargs():
    from streamrl.check import find_problems
    from streamrl.config import config_from_dict

    def problems(kwargs):
        raw = {
            "data": {"path": "builtin:arithmetic"},
            "rollout": {"generate_fn": "streamrl.compat.slime:generate", "generate_kwargs": kwargs},
        }
        return find_problems(config_from_dict(raw), models=False)

    assert problems({"function": "slime_functions:tool_turns"}) == []
    (missing,) = problems({"function": "slime_functions:nowhere"})
    assert missing.startswith("rollout.generate_kwargs") and "nowhere" in missing
    (unknown,) = problems({"fucntion": "slime_functions:tool_turns"})
    assert "fucntion" in unknown
