"""A snapshot reads every group in flight at its tokens, and a new worker continues them."""

from __future__ import annotations

import json

import anyio
import msgspec
import pytest
from engine_helpers import engine_load

from streamrl.actors.in_flight import InFlight
from streamrl.actors.rollout import RolloutWorker
from streamrl.agents import single_turn
from streamrl.agents.synthetic import confidence_reward, generate_scored
from streamrl.data.source import PromptSource
from streamrl.fleet.client import EngineError
from streamrl.fleet.engine_set import EngineSet, EngineSetError
from streamrl.models import load_tokenizer
from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits
from streamrl.queues.sender import StreamSender
from streamrl.types import PartialGroup

pytestmark = pytest.mark.anyio

BUDGET = 200


def worker(
    source, sender, engines, tokenizer, generate_fn=single_turn.generate, **kwargs
) -> RolloutWorker:
    return RolloutWorker(
        worker_id="rollout-test",
        source=source,
        sender=sender,
        engines=engines,
        tokenizer=tokenizer,
        generate_fn=generate_fn,
        reward_fn=lambda inp: 1.0,
        n_samples_per_prompt=2,
        sampling_params={"max_new_tokens": BUDGET, "ignore_eos": True, "temperature": 1.0},
        max_consecutive_failures=0,
        **kwargs,
    )


async def test_a_snapshot_holds_the_tokens_in_flight_and_a_restart_continues_from_them(
    tiny_engine, tiny_model_dir, tmp_path
):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(4)))
    tokenizer = load_tokenizer(tiny_model_dir)
    groups, reports = [], []
    receiver = StreamReceiver(
        "tcp://127.0.0.1:0",
        credits=UnlimitedCredits(2),
        on_group=groups.append,
        on_report=lambda report: reports.append(report),
    )
    async with EngineSet([tiny_engine.url]) as engine_set:
        async with anyio.create_task_group() as tg:
            address = await tg.start(receiver.run)
            sender = StreamSender(address, sender_id="rollout-test")
            await tg.start(sender.run)
            first = worker(
                PromptSource(str(data), tokenizer=tokenizer, seed=0),
                sender,
                engine_set,
                tokenizer,
            )
            tg.start_soon(first.run)
            tg.start_soon(first.in_flight_loop)
            with anyio.fail_after(60):  # readiness: both groups are decoding
                while len(first.in_flight.hold.active) < 4:
                    await anyio.sleep(0.02)
                url = tiny_engine.url  # and two decode steps of all four after that
                tokens = engine_load(url)["generated_tokens"]
                while engine_load(url)["generated_tokens"] < tokens + 8:
                    await anyio.sleep(0.02)
                await receiver.request_in_flight(7)
                while not [r for r in reports if r.kind == "in_flight"]:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        (report,) = [r for r in reports if r.kind == "in_flight"]
        assert report.payload["step"] == 7 and report.payload["complete"]
        saved = msgspec.convert(report.payload["groups"], list[PartialGroup])
        assert len(saved) == 2 and all(len(g.samples) == 2 for g in saved)
        partial = [s for g in saved for s in g.samples]
        assert all(0 < len(s.output_ids) < BUDGET and not s.finish_reason for s in partial)
        assert all(len(s.logprobs) == len(s.versions) == len(s.output_ids) for s in partial)

        # A new process continues them before any new prompt, with a generate function
        # that scores its one completion itself (`finish` runs on a continued sample).
        groups.clear()
        receiver = StreamReceiver(
            "tcp://127.0.0.1:0", credits=UnlimitedCredits(2), on_group=groups.append
        )
        async with anyio.create_task_group() as tg:
            address = await tg.start(receiver.run)
            sender = StreamSender(address, sender_id="rollout-test-2")
            await tg.start(sender.run)
            source = PromptSource(str(data), tokenizer=tokenizer, seed=0)
            second = worker(source, sender, engine_set, tokenizer, generate_scored, resume=saved)
            tg.start_soon(second.run)
            with anyio.fail_after(120):
                while len(groups) < 2:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    by_seq = {g.prompt_seq: g for g in groups[:2]}
    assert set(by_seq) == {g.prompt_seq for g in saved}
    for group in saved:
        for sample, kept in zip(by_seq[group.prompt_seq].samples, group.samples, strict=True):
            assert len(sample.response_ids) == BUDGET
            assert list(sample.response_ids[: len(kept.output_ids)]) == kept.output_ids
            assert list(sample.logprobs[: len(kept.logprobs)]) == pytest.approx(kept.logprobs)
            assert sample.reward == pytest.approx(confidence_reward(list(sample.logprobs)))
    assert second.counters.resumed_samples == 4
    assert second.counters.resumed_tokens == sum(len(s.output_ids) for s in partial)


class _OneEngineLoading:
    """An engine set whose second engine is restarting (a fake: the test is of InFlight)."""

    async def abort_all(self) -> None:
        loading = EngineError("http://b", "/abort_request", 503, "the engine is still loading")
        raise EngineSetError("abort_all", {"http://b": loading}, 2)


async def test_a_snapshot_goes_on_when_an_engine_is_restarting():
    """A restarting engine answers 503 to abort: it holds no call, so the snapshot is taken
    (once this killed the rollout process during an engine restart)."""
    in_flight = InFlight(resumable=True)
    in_flight.started(3)
    groups, cost = await in_flight.collect(_OneEngineLoading(), 2)
    assert [group.prompt_seq for group in groups] == [3] and cost["complete"]


class _CallArrivingAfterTheAbort:
    """One engine call that reaches its engine just after the first abort, so only a later
    abort stops it (a fake engine set: the test is of InFlight)."""

    def __init__(self, hold) -> None:
        self.hold = hold
        self.aborts = 0
        self._at_engine = False
        self._aborted = anyio.Event()

    async def abort_all(self) -> None:
        self.aborts += 1
        if self._at_engine:
            self._aborted.set()

    async def call(self) -> None:
        completion = object()
        self.hold.begin(completion)
        while self.aborts == 0:  # it passed the hold before it closed, and is on its way
            await anyio.sleep(0.01)
        self._at_engine = True
        await self._aborted.wait()  # it decodes until an abort reaches it
        await self.hold.checkpoint(completion)
        self.hold.end(completion)


async def test_a_call_that_reaches_its_engine_after_the_abort_is_aborted_again():
    """Without a second abort such a call decodes to the end of its budget while generation
    is held (2.8 s of a checkpoint's cut on the H200): the collection aborts again until
    every call has parked."""
    in_flight = InFlight(resumable=True)
    in_flight.started(3)
    engines = _CallArrivingAfterTheAbort(in_flight.hold)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engines.call)
        while not in_flight.hold.active:
            await anyio.sleep(0.01)
        with anyio.fail_after(20):
            groups, cost = await in_flight.collect(engines, 2)
    assert cost["complete"] and [group.prompt_seq for group in groups] == [3]
    assert cost["aborts"] == engines.aborts >= 2
