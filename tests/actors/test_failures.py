"""Systematic failures: every one of the last N samples failed stops the rollout with the first
one's error, sent to the trainer's intake as a `Fatal`; occasional failures do not."""

from __future__ import annotations

import anyio
import e2e_rewards
import pytest

from streamrl.actors.failures import (
    Failure,
    FailureWindow,
    Stage,
    SystematicFailure,
    generation_failure,
    is_engine_outage,
)
from streamrl.actors.rollout import RolloutWorker
from streamrl.agents.api import Trajectory
from streamrl.config import RunConfig
from streamrl.config.sections import DataConfig, RolloutConfig
from streamrl.data.rows import DataError
from streamrl.fleet.client import EngineError
from streamrl.mains.rollout import fatal_of
from streamrl.queues.accounting import DataPosition
from streamrl.queues.intake import Intake
from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits
from streamrl.queues.sender import StreamSender
from streamrl.types import Prompt


def failure(number: int) -> Failure:
    return Failure(Stage.GENERATION, f"RuntimeError: call {number}", f"prompt {number} sample 0")


def test_the_window_trips_on_the_nth_failure_in_a_row_and_keeps_the_first():
    window = FailureWindow(3)
    assert not window.failed(failure(0))
    assert not window.failed(failure(1))
    assert window.failed(failure(2))
    error = window.error()
    assert error.first == failure(0) and error.num_failures == 3
    assert "every one of the last 3 samples" in str(error)
    assert "rollout.max_consecutive_failures" in str(error)


def test_a_success_in_between_starts_the_count_again():
    window = FailureWindow(3)
    for number in range(100):
        window.failed(failure(number))
        if number % 2:
            window.succeeded()
        assert not window.is_systematic
    window.failed(failure(100))
    assert window.first == failure(100)


def test_a_window_of_zero_never_trips():
    window = FailureWindow(0)
    assert not any(window.failed(failure(number)) for number in range(1000))


def test_engines_that_do_not_answer_are_an_outage_but_a_refused_request_is_not():
    assert is_engine_outage(EngineError("http://e", "/generate", None, "connect failed"))
    assert is_engine_outage(EngineError("http://e", "/generate", 503, "restarting"))
    assert not is_engine_outage(EngineError("http://e", "/generate", 400, "bad request"))
    assert not is_engine_outage(RuntimeError("a bug"))


def test_a_generation_failure_keeps_its_traceback():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        recorded = generation_failure(exc, "prompt 3 sample 1")
    assert recorded.error == "KeyError: 'missing'"
    assert recorded.traceback.startswith("Traceback (most recent call last):")
    assert "test_a_generation_failure_keeps_its_traceback" in recorded.traceback


# ---- the worker, on a real stream (no engine: the generate functions never call one)


class Counting:
    """Prompts 0, 1, 2, ... with three tokens each; `reached` is set when prompt `until` is
    handed out."""

    def __init__(self, until: int = 0) -> None:
        self.next_seq = 0
        self.too_long_seqs: set[int] = set()
        self.until = until
        self.reached = anyio.Event()

    @property
    def position(self) -> DataPosition:
        return DataPosition(next_seq=self.next_seq)

    def next(self) -> Prompt:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if seq == self.until:
            self.reached.set()
        return Prompt(seq=seq, index=seq, epoch=0, text=f"p{seq}", input_ids=[1, 2, 3])


async def always_raises(ctx, prompt: Prompt) -> Trajectory:
    raise RuntimeError(f"bug on prompt {prompt.seq}")


async def odd_prompts_fail(ctx, prompt: Prompt) -> Trajectory:
    if prompt.seq % 2:
        raise RuntimeError(f"bug on prompt {prompt.seq}")
    return Trajectory(text="ok")


async def engines_down(ctx, prompt: Prompt) -> Trajectory:
    raise EngineError("http://127.0.0.1:1", "/generate", None, "no engine answers")


async def reward_one(inp) -> float:
    return 1.0


async def generate_ok(ctx, prompt: Prompt) -> Trajectory:
    return Trajectory(text="ok")


def worker(
    sender: StreamSender,
    generate_fn,
    *,
    n: int,
    window: int,
    until: int = 0,
    reward_fn=reward_one,
) -> RolloutWorker:
    return RolloutWorker(
        worker_id="rollout-test",
        source=Counting(until),
        sender=sender,
        engines=None,
        tokenizer=None,
        generate_fn=generate_fn,
        reward_fn=reward_fn,
        n_samples_per_prompt=n,
        sampling_params={},
        max_consecutive_failures=window,
    )


def intake() -> Intake:
    return Intake(
        "tcp://127.0.0.1:0",
        batch_size=2,
        max_staleness=1,
        capacity=64,
        staleness_rule="episode",
        filters=(),
    )


@pytest.mark.anyio
async def test_a_worker_whose_every_sample_fails_stops_and_its_fatal_reaches_the_intake():
    receiver = intake()
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="rollout-test")
        await tg.start(sender.run)
        failing = worker(sender, always_raises, n=2, window=10)
        with anyio.fail_after(30), pytest.raises(SystematicFailure) as caught:
            await failing.run()
        cfg = RunConfig(
            data=DataConfig(path="builtin:arithmetic"),
            rollout=RolloutConfig(generate_fn="tests.e2e_generate:always_raises"),
        )
        fatal = fatal_of(caught.value, cfg)
        with anyio.fail_after(30):
            assert await sender.send_fatal(fatal, timeout_s=30)
        tg.cancel_scope.cancel()

    # Samples already started when the 10th failed may fail too: all are counted.
    assert failing.counters.generation_failures == caught.value.num_failures >= 10
    assert receiver.fatal == fatal
    assert fatal.error == "RuntimeError: bug on prompt 0"
    assert "RuntimeError: bug on prompt 0" in fatal.traceback
    assert fatal.look_at == "rollout.generate_fn = 'tests.e2e_generate:always_raises'"
    # Every group it started was received (filtered) or is counted in flight at the stop.
    summary = receiver.summary()
    assert receiver.accounting_problems() == []
    assert summary["groups_started"] == (
        summary["groups_received"] + summary["groups_in_flight_at_stop"]
    )
    assert summary["groups_filtered"] == summary["groups_received"] > 0
    assert summary["rollout"]["generation_failures"] == caught.value.num_failures


@pytest.mark.anyio
async def test_a_reward_that_always_raises_stops_a_worker_with_its_traceback():
    receiver = intake()
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="rollout-test")
        await tg.start(sender.run)
        scoring = worker(sender, generate_ok, n=2, window=6, reward_fn=e2e_rewards.always_raises)
        with anyio.fail_after(30), pytest.raises(SystematicFailure) as caught:
            await scoring.run()
        tg.cancel_scope.cancel()
    first = caught.value.first
    assert first.stage is Stage.REWARD
    assert first.error == "RuntimeError: this reward function always fails"
    assert "e2e_rewards.py" in first.traceback
    assert scoring.counters.reward_failures == caught.value.num_failures >= 6
    cfg = RunConfig(data=DataConfig(path="builtin:arithmetic"))
    assert fatal_of(caught.value, cfg).look_at.startswith("rollout.reward_fn = ")


@pytest.mark.anyio
@pytest.mark.parametrize("generate_fn", [odd_prompts_fail, engines_down])
async def test_occasional_failures_and_engine_outages_are_counted_and_never_stop_a_worker(
    generate_fn,
):
    receiver = StreamReceiver(
        "tcp://127.0.0.1:0", credits=UnlimitedCredits(), on_group=lambda group: None
    )
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="rollout-test", want=1)  # one group at a time
        await tg.start(sender.run)
        going = worker(sender, generate_fn, n=1, window=2, until=20)
        tg.start_soon(going.run)
        with anyio.fail_after(30):  # one group at a time: 20 groups have been sent
            await going.source.reached.wait()
        await receiver.stop("enough")
        tg.cancel_scope.cancel()
    assert going.counters.generation_failures >= 10
    assert not going.failures.is_systematic and receiver.stats.num_fatal == 0


def test_a_malformed_data_line_is_fatal_and_names_file_and_line():
    cfg = RunConfig(data=DataConfig(path="builtin:arithmetic"))
    error = ExceptionGroup("task group", [DataError("/data/x.jsonl:3: malformed JSON: truncated")])
    fatal = fatal_of(error, cfg)
    assert fatal is not None and "/data/x.jsonl:3: malformed JSON" in fatal.reason
    assert "data.path" in fatal.look_at
    assert fatal_of(RuntimeError("engine process died"), cfg) is None
