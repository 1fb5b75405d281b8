"""The rollout worker against a real embedded engine and the real stream and buffer."""

from __future__ import annotations

import json

import anyio
import pytest

from streamrl.actors.rollout import RolloutWorker
from streamrl.agents import single_turn
from streamrl.data.source import PromptSource
from streamrl.fleet.engine_set import EngineSet
from streamrl.models import load_tokenizer
from streamrl.queues.admission import Admission
from streamrl.queues.buffer import Buffer
from streamrl.queues.receiver import StreamReceiver
from streamrl.queues.sender import StreamSender
from streamrl.rewards import RewardInput
from streamrl.types import SampleStatus

pytestmark = pytest.mark.anyio


class FlakyReward:
    """Raises on every third call, otherwise scores the response length."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, inp: RewardInput) -> float:
        self.calls += 1
        if self.calls % 3 == 0:
            raise ValueError("flaky reward")
        return min(len(inp.response) / 50, 1.0)


async def test_a_rollout_worker_fills_the_buffer_within_admission_and_survives_failing_rewards(
    tiny_engine, tiny_model_dir, tmp_path
):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Count to {i}.", "label": str(i)}) + "\n" for i in range(20))
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    batch_size, eta, n = 2, 1, 3
    buffer = Buffer(capacity=100, max_staleness=eta, staleness_rule="episode", filters=())
    admission = Admission(
        batch_size=batch_size, max_staleness=eta, capacity=100, num_buffered=lambda: len(buffer)
    )
    arrived = anyio.Event()

    def on_group(group) -> None:
        buffer.put(group)
        arrived.set()

    receiver = StreamReceiver("tcp://127.0.0.1:0", credits=admission, on_group=on_group)
    reward = FlakyReward()
    async with (
        EngineSet([tiny_engine.url]) as engine_set,
        anyio.create_task_group() as tg,
    ):
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="rollout-test")
        await tg.start(sender.run)
        worker = RolloutWorker(
            worker_id="rollout-test",
            source=PromptSource(str(data), tokenizer=tokenizer, seed=0),
            sender=sender,
            engines=engine_set,
            tokenizer=tokenizer,
            generate_fn=single_turn.generate,
            reward_fn=reward,
            n_samples_per_prompt=n,
            sampling_params={"max_new_tokens": 8, "temperature": 1.0},
            max_consecutive_failures=0,
        )
        tg.start_soon(worker.run)
        allowed = (0 + eta + 1) * batch_size
        with anyio.fail_after(120):
            while receiver.stats.num_groups < allowed:
                await arrived.wait()
                arrived = anyio.Event()
        # Admission holds: nothing more may start at version 0 (bounded check).
        with anyio.move_on_after(1.5):
            await arrived.wait()
        assert receiver.stats.num_groups == allowed
        assert worker.counters.groups_started == allowed
        # A new version lets exactly one more batch of groups start.
        admission.set_version(1)
        await receiver.grant()
        with anyio.fail_after(120):
            while receiver.stats.num_groups < allowed + batch_size:
                await arrived.wait()
                arrived = anyio.Event()
        assert worker.counters.groups_started == allowed + batch_size
        tg.cancel_scope.cancel()

    groups = buffer.drain()
    assert len(groups) == allowed + batch_size
    samples = [s for g in groups for s in g.samples]
    assert all(len(g.samples) == n for g in groups)
    for sample in samples:
        assert 0 < len(sample.response_ids) <= 8
        assert len(sample.logprobs) == len(sample.versions) == len(sample.response_ids)
        assert (sample.logprobs <= 0).all() and set(sample.versions.tolist()) == {0}
    failed = [s for s in samples if s.status == SampleStatus.REWARD_FAILED]
    assert len(failed) == reward.calls // 3 > 0
    assert worker.counters.reward_failures == len(failed)
    assert all(s.reward == 0.0 and "flaky reward" in s.metadata["reward_error"] for s in failed)


@pytest.mark.parametrize("pause_mode", ["abort", "retract_abort"])
async def test_a_sample_aborted_by_a_weight_update_pause_is_continued_from_its_tokens(
    tiny_engine, pause_mode
):
    from engine_helpers import engine_load

    from streamrl.agents.api import GenerateContext

    url = tiny_engine.url
    async with EngineSet([url]) as engine_set, anyio.create_task_group() as tg:
        ctx = GenerateContext(
            engines=engine_set,
            tokenizer=None,
            sampling_params={"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True},
        )
        result = {}

        async def generate() -> None:
            result["completion"] = await ctx.generate([1, 5, 6, 7])

        tg.start_soon(generate)
        with anyio.fail_after(60):  # readiness: the request is decoding on the engine
            while not engine_load(url)["num_running_reqs"]:
                await anyio.sleep(0.01)
        client = engine_set.engines[0]
        await client.pause(pause_mode)  # what the publisher does with weights.pause_mode
        await client.continue_generation()
    completion = result["completion"]
    assert completion.num_resumes >= 1
    assert completion.num_engine_calls >= 2
    assert len(completion.output_ids) == 400  # the budget counts the tokens kept from before
    assert str(completion.finish_reason) == "length"
    assert len(completion.logprobs) == len(completion.versions) == 400
