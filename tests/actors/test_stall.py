"""The learner's stall report (`streamrl.actors.stall`) and the step sources it asks
(`streamrl.queues.source.StepSource`): what became of the groups since the last batch,
said on the terminal when the learner waits too long, with a clock the tests drive."""

from __future__ import annotations

import logging

import anyio
import pytest

from streamrl import checkpoint
from streamrl.actors.learner import LearnerLoop
from streamrl.actors.stall import StallWatch, describe_stall, stall_record
from streamrl.config import config_from_dict
from streamrl.metrics import MetricsWriter, read_metrics
from streamrl.queues.buffer import BufferStats
from streamrl.queues.intake import Intake, IntakeState
from streamrl.queues.progress import ProgressReport, RewardStats, SourceStats, StepProgress
from streamrl.queues.protocol import Report
from streamrl.queues.rollout_files import ReplayIntake, RolloutWriter
from streamrl.queues.sender import StreamSender
from streamrl.queues.source import StepSource
from streamrl.types import Group, Sample, SampleStatus


def make_group(seq: int, rewards: list[float], *, status: SampleStatus = SampleStatus.OK) -> Group:
    samples = [
        Sample(
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            logprobs=[-0.5] * 3,
            versions=[0] * 3,
            loss_mask=[1] * 3,
            reward=reward,
            status=status,
        )
        for reward in rewards
    ]
    return Group(group_id=f"g{seq}", prompt_seq=seq, prompt_index=seq, samples=samples)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def all_zero_report(num_groups: int = 3, samples_per_group: int = 4) -> ProgressReport:
    progress = StepProgress()
    for seq in range(num_groups):
        group = make_group(seq, [0.0] * samples_per_group)
        progress.on_arrived(group)
        progress.on_discarded(group, "filtered:zero_std")
    return progress.report(num_needed=4, num_buffered=0, num_in_flight=8, num_startable=0)


# ---- what became of the groups ------------------------------------------------


def test_the_rewards_of_dropped_groups_are_summarised_under_the_filter_that_dropped_them():
    progress = StepProgress()
    dropped = {
        "zero_std": [make_group(0, [1.0, 1.0]), make_group(1, [0.0, 0.0])],
        "truncated": [make_group(2, [0.25, 0.75])],
    }
    for name, groups in dropped.items():
        for group in groups:
            progress.on_arrived(group)
            progress.on_discarded(group, f"filtered:{name}")
    kept = make_group(3, [0.0, 1.0])
    progress.on_arrived(kept)
    progress.on_discarded(make_group(4, [0.5, 0.5]), "evicted:stale")

    report = progress.report(num_needed=2, num_buffered=1)
    zero_std = report.filtered["zero_std"]
    assert (zero_std.num_groups, zero_std.num_samples) == (2, 4)
    assert (zero_std.mean, zero_std.std, zero_std.min, zero_std.max) == (0.5, 0.5, 0.0, 1.0)
    assert report.filtered["truncated"].mean == 0.5
    assert report.num_arrived == 4 and report.num_samples == 8
    assert report.num_filtered == 3 and report.evicted == {"stale": 1}


def test_failed_samples_are_counted_as_they_arrive():
    progress = StepProgress()
    progress.on_arrived(make_group(0, [0.0, 0.0], status=SampleStatus.REWARD_FAILED))
    progress.on_arrived(make_group(1, [0.0], status=SampleStatus.GENERATION_FAILED))
    report = progress.report(num_needed=1, num_buffered=0)
    assert (report.num_reward_failed, report.num_generation_failed) == (2, 1)


def test_the_window_starts_again_when_the_learner_takes_a_batch():
    progress = StepProgress()
    group = make_group(0, [0.0, 0.0])
    progress.on_arrived(group)
    progress.on_discarded(group, "filtered:zero_std")
    before = progress.report(num_needed=1, num_buffered=0)
    progress.on_taken()
    after = progress.report(num_needed=1, num_buffered=0)
    assert before.num_filtered == 1 and before.filtered["zero_std"].num_groups == 1
    assert after.num_arrived == after.num_filtered == 0 and after.filtered == {}


def test_reward_statistics_of_no_sample_say_so():
    assert RewardStats().describe() == "no samples"
    assert RewardStats().mean == RewardStats().std == 0.0


# ---- when to say it -----------------------------------------------------------


def test_a_stall_warning_is_due_once_the_wait_reaches_the_threshold_and_not_before():
    clock = FakeClock()
    watch = StallWatch(60.0, clock=clock)
    assert watch.poll() is None  # not waiting
    watch.waiting()
    clock.now += 59.0
    assert watch.poll() is None and watch.seconds_to_due() == 1.0
    clock.now += 1.0
    assert watch.poll() == 60.0


def test_the_warning_repeats_every_threshold_while_the_wait_lasts_not_on_every_check():
    clock = FakeClock()
    watch = StallWatch(30.0, clock=clock)
    watch.waiting()
    warnings = []
    for _ in range(100):  # a check every second for 100 s
        clock.now += 1.0
        if (waited := watch.poll()) is not None:
            warnings.append(waited)
    assert warnings == [30.0, 60.0, 90.0]


def test_no_warning_while_batches_come_sooner_than_the_threshold():
    clock = FakeClock()
    watch = StallWatch(60.0, clock=clock)
    for _ in range(10):  # ten steps of 50 s each: 500 s in all, no wait of 60 s
        watch.waiting()
        clock.now += 50.0
        assert watch.poll() is None
        watch.done()
    assert watch.poll() is None and watch.seconds_to_due() == float("inf")


# ---- what it says ------------------------------------------------------------


def test_a_run_whose_every_group_is_filtered_says_so_with_the_rewards_and_the_keys_to_change():
    message = describe_stall(all_zero_report(), waited_s=61.2, step=1)
    assert message.startswith("no training step for 61 s")
    assert "needs 4 groups, 0 are buffered" in message
    assert "3 groups arrived (12 samples" in message and "3 filtered" in message
    assert "8 in flight" in message
    assert (
        "filtered by zero_std: 3 groups, rewards mean 0.000 std 0.000 min 0.000 max 0.000 "
        "over 12 samples" in message
    )
    assert "every group that arrived was dropped by buffer.filters (zero_std)" in message
    for key in (
        "buffer.filters",
        "rollout.reward_fn",
        "rollout.sampling.temperature",
        "rollout.n_samples_per_prompt",
    ):
        assert key in message


def test_a_wait_with_nothing_arrived_points_at_the_groups_in_flight():
    report = ProgressReport(num_needed=4, num_buffered=1, num_in_flight=6, num_startable=0)
    message = describe_stall(report, waited_s=90.0, step=3)
    assert "no group arrived: 6 are being generated" in message
    assert "filtered by" not in message


def test_a_wait_that_admission_holds_names_the_staleness_and_capacity_keys():
    report = ProgressReport(num_needed=4, num_buffered=0)
    message = describe_stall(report, waited_s=90.0, step=3)
    assert "admission lets none start" in message and "buffer.max_staleness" in message


def test_a_wait_before_the_rollout_started_anything_says_it_may_still_be_starting():
    report = ProgressReport(num_needed=4, num_buffered=0, num_startable=8)
    message = describe_stall(report, waited_s=60.0, step=1)
    assert "the rollout process may still be starting" in message and "rollout.log" in message


def test_a_user_filter_and_evictions_and_failed_rewards_are_each_named():
    progress = StepProgress()
    for seq in range(4):
        group = make_group(seq, [0.0, 0.0], status=SampleStatus.REWARD_FAILED)
        progress.on_arrived(group)
        if seq < 2:
            progress.on_discarded(group, "filtered:my.filters:drop")
    progress.on_discarded(make_group(9, [1.0, 0.0]), "evicted:stale")
    message = describe_stall(progress.report(num_needed=4, num_buffered=2), waited_s=60, step=1)
    assert "2 of 4 groups that arrived were kept" in message
    assert "take 'my.filters:drop' out of buffer.filters" in message
    assert "evicted (stale)" in message and "buffer.max_staleness" in message
    assert "the reward function failed for 8 of 8 samples" in message


def test_the_stall_record_carries_the_counts_and_the_reward_statistics():
    record = stall_record(all_zero_report(), waited_s=61.0, step=0, elapsed_s=75.0)
    assert record["kind"] == "stall" and record["stall/waited_s"] == 61.0
    assert record["stall/groups_filtered"] == record["stall/filtered/zero_std"] == 3
    assert record["stall/filtered/zero_std/reward_max"] == 0.0
    assert record["stall/groups_needed"] == 4 and record["stall/groups_in_flight"] == 8


# ---- the step sources and the learner loop -------------------------------------


class StalledSource:
    """A step source whose batch comes only after the learner asked for its progress twice
    (it warned twice)."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups
        self.num_progress_calls = 0
        self._warned_twice = anyio.Event()

    async def take(self, num_groups: int, version: int) -> list[Group]:
        await self._warned_twice.wait()
        return self.groups[:num_groups]

    def stats(self) -> SourceStats:
        return SourceStats(buffer=BufferStats(), num_buffered=0, max_staleness=1)

    def progress(self, num_needed: int) -> ProgressReport:
        self.num_progress_calls += 1
        if self.num_progress_calls == 2:
            self._warned_twice.set()
        return all_zero_report()

    async def cut(self, step: int, *, timeout_s: float) -> IntakeState:
        return IntakeState(is_complete=True)

    @property
    def done_seqs(self) -> set[int]:
        return set()

    def pop_eval_reports(self) -> list[Report]:
        return []


@pytest.mark.anyio
async def test_a_learner_that_waits_past_the_threshold_warns_again_until_its_batch_comes(
    tmp_path, caplog
):
    cfg = config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": "x"},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
            "train": {"steps": 1, "stall_warning_s": 0.01},
        }
    )
    source = StalledSource([make_group(0, [0.0, 1.0])])
    assert isinstance(source, StepSource)
    metrics = MetricsWriter(tmp_path, tensorboard=False, progress=False)
    loop = LearnerLoop(
        cfg,
        backend=None,
        source=source,
        publisher=None,
        metrics=metrics,
        run_dir=tmp_path,
        state=checkpoint.TrainState(),
        pad_id=0,
    )
    with caplog.at_level(logging.WARNING, logger="streamrl.actors.learner"), anyio.fail_after(30):
        state = await loop.run()
    metrics.close()

    records = read_metrics(tmp_path / "metrics.jsonl")
    stalls = [r for r in records if r.get("kind") == "stall"]
    assert state.step == 1 and len(stalls) == 2
    assert [r["step"] for r in records if "kind" not in r] == [1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("filtered by zero_std" in w for w in warnings)


class BrokenSource(StalledSource):
    async def take(self, num_groups: int, version: int) -> list[Group]:
        raise ValueError("step_000001.msgpack: 2 groups, but rollout.batch_size = 1")


@pytest.mark.anyio
async def test_an_error_of_the_step_source_reaches_the_caller_as_itself(tmp_path):
    cfg = config_from_dict(
        {"data": {"path": "x"}, "model": {"path": "x"}, "train": {"stall_warning_s": 60.0}}
    )
    metrics = MetricsWriter(tmp_path, tensorboard=False, progress=False)
    loop = LearnerLoop(
        cfg,
        backend=None,
        source=BrokenSource([]),
        publisher=None,
        metrics=metrics,
        run_dir=tmp_path,
        state=checkpoint.TrainState(),
        pad_id=0,
    )
    with pytest.raises(ValueError, match=r"rollout\.batch_size"):  # not an ExceptionGroup
        await loop.run()
    metrics.close()


@pytest.mark.anyio
async def test_the_live_intake_reports_what_its_filters_dropped_and_starts_again_after_take():
    intake = Intake(
        "tcp://127.0.0.1:0",
        batch_size=1,
        max_staleness=4,
        capacity=8,
        staleness_rule="episode",
        filters=["zero_std"],
    )
    assert isinstance(intake, StepSource)
    async with anyio.create_task_group() as tg:
        address = await tg.start(intake.run)
        sender = StreamSender(address, sender_id="w")
        await tg.start(sender.run)
        groups = [make_group(seq, [0.0] * 4) for seq in range(3)] + [make_group(3, [0.0, 1.0])]
        with anyio.fail_after(30):
            for group in groups:
                assert await sender.acquire()
                await sender.send(group)
            await sender.flush()  # acknowledged: the intake has offered them to its buffer
        report = intake.progress(2)
        assert (report.num_needed, report.num_buffered, report.num_arrived) == (2, 1, 4)
        assert report.filtered["zero_std"].num_groups == 3
        assert report.filtered["zero_std"].max == 0.0
        assert [g.prompt_seq for g in await intake.take(1, 0)] == [3]
        assert intake.progress(1).num_arrived == 0
        stats = intake.stats()
        assert stats.buffer.filtered == {"zero_std": 3} and stats.num_buffered == 0
        assert stats.generated_reward_mean == pytest.approx(1 / 14)
        assert not stats.accounting_problems
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_replay_source_takes_step_k_from_file_k_and_reports_its_buffer(tmp_path):
    writer = RolloutWriter(tmp_path)
    writer.write(1, [make_group(0, [0.0, 1.0])])
    writer.write(2, [make_group(1, [1.0, 0.0])])
    source = ReplayIntake(writer.directory, start_step=1)
    assert isinstance(source, StepSource)
    assert [g.prompt_seq for g in await source.take(1, 0)] == [1]
    stats = source.stats()
    assert stats.buffer.num_handed_out == 1 and stats.generated_reward_mean is None
    assert stats.accounting == {"accounting/trained": 1} and not stats.accounting_problems
    assert source.progress(1) == ProgressReport(num_needed=1, num_buffered=0)
    assert source.done_seqs == {1}
