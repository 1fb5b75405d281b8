"""Requests an engine cannot serve are refused by the client, counted, and never sent."""

from __future__ import annotations

import json

import anyio
import pytest
from engine_helpers import engine_load

from streamrl.actors.rollout import RolloutWorker
from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.data.source import PromptSource
from streamrl.engine.protocol import SamplingBody
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.limits import (
    SAMPLING_KEYS,
    RequestLimits,
    RequestRejected,
    context_length_of,
)
from streamrl.models import load_tokenizer
from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits
from streamrl.queues.sender import StreamSender
from streamrl.types import SampleStatus

LIMITS = RequestLimits(vocab_size=100, context_length=20)


@pytest.mark.parametrize(
    ("prompt", "params", "reason"),
    [
        ([1, 100], {}, "token_out_of_vocab"),
        ([-1, 5], {}, "token_out_of_vocab"),
        ([], {}, "empty_prompt"),
        ([1] * 11, {"max_new_tokens": 10}, "context_overflow"),
        ([1] * 19, {}, "context_overflow"),  # SGLang's default budget is 128 tokens
        ([1, 2], {"max_new_tokens": 4, "temprature": 0.5}, "unknown_sampling_param"),
    ],
)
def test_a_request_outside_the_limits_is_rejected_with_its_reason(prompt, params, reason):
    with pytest.raises(RequestRejected) as caught:
        LIMITS.check([prompt], params)
    assert caught.value.reason == reason


def test_a_request_within_the_limits_passes():
    LIMITS.check([[0, 99], [5] * 10], {"max_new_tokens": 10, "temperature": 0.7, "n": 2})


def test_the_client_knows_the_sampling_keys_the_embedded_engine_accepts():
    # The embedded engine refuses unknown keys itself: both sides must name the same set.
    assert set(SamplingBody.__struct_fields__) == SAMPLING_KEYS


def test_the_context_length_comes_from_sglang_or_the_embedded_engine_or_the_model():
    assert context_length_of({"context_length": 4096}, 32768) == 4096
    assert context_length_of({"context_length": None}, 32768) == 32768
    assert context_length_of({"max_seq_len": 2048}, 32768) == 2048
    assert context_length_of({}, 8192) == 8192


async def _oov_generate(ctx: GenerateContext, prompt) -> Trajectory:
    """A user generate function that appends a token id past the vocabulary."""
    trajectory = Trajectory()
    trajectory.add_completion(await ctx.generate([*prompt.input_ids, 10**6]))
    return trajectory


@pytest.mark.anyio
async def test_a_token_beyond_the_vocabulary_is_counted_and_never_reaches_the_engine(
    tiny_engine, tiny_model_dir, tmp_path
):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(3)))
    tokenizer = load_tokenizer(tiny_model_dir)
    groups = []
    receiver = StreamReceiver(
        "tcp://127.0.0.1:0", credits=UnlimitedCredits(3), on_group=groups.append
    )
    url = tiny_engine.url
    async with EngineSet([url]) as engine_set, anyio.create_task_group() as tg:
        engine_set.set_limits(await engine_set.read_limits(vocab_size=49152, model_max=4096))
        assert engine_set.limits == RequestLimits(vocab_size=49152, context_length=2048)
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="rollout-test")
        await tg.start(sender.run)
        worker = RolloutWorker(
            worker_id="rollout-test",
            source=PromptSource(str(data), tokenizer=tokenizer, seed=0),
            sender=sender,
            engines=engine_set,
            tokenizer=tokenizer,
            generate_fn=_oov_generate,
            reward_fn=lambda inp: 1.0,
            n_samples_per_prompt=2,
            sampling_params={"max_new_tokens": 4},
            max_consecutive_failures=0,
        )
        before = engine_load(url)["num_finished_reqs"]
        tg.start_soon(worker.run)
        with anyio.fail_after(60):
            while len(groups) < 3:
                await anyio.sleep(0.05)
        await engine_set.engines[0].health_generate()  # the engine still serves
        assert engine_load(url)["num_finished_reqs"] == before  # no /generate reached it
        tg.cancel_scope.cancel()
    assert set(worker.counters.rejected) == {"token_out_of_vocab"}
    assert worker.counters.rejected["token_out_of_vocab"] == worker.counters.generation_failures
    assert worker.counters.generation_failures >= 2 * len(groups) >= 6
    for group in groups:
        assert [s.status for s in group.samples] == [SampleStatus.GENERATION_FAILED] * 2
        assert all("token_out_of_vocab" in s.metadata["error"] for s in group.samples)
