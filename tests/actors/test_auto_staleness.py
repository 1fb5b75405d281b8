"""`buffer.max_staleness = "auto"`: the controller driven by a synthetic pipeline (it converges,
holds, backs off when the budget is exceeded), the promise to groups admitted under a higher
bound (`BoundHistory`, and a real intake over ZeroMQ), and the config's rules. The run
itself: tests/runs/test_run.py."""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest

from streamrl.actors.auto_staleness import AutoStaleness, Observation, Reason, start_bound
from streamrl.config import ConfigError, config_from_dict
from streamrl.config.sections import AutoStalenessConfig
from streamrl.queues.admission import BoundHistory
from streamrl.queues.intake import Intake
from streamrl.queues.sender import StreamSender
from tests.queues.test_buffer import make_group


class Pipeline:
    """A run reduced to its rates. The learner trains a step in `train_s`; generation gets
    faster with the groups it may keep in flight, up to `saturates_at` (an engine's batch is
    full), so the learner's wait per step is `gen_s / min(bound + 1, saturates_at) - train_s`
    when positive. The mismatch KL grows with the bound (`kl_per_version`). `noise` scales
    every duration by a random factor in [1 - noise, 1 + noise]."""

    def __init__(self, *, train_s=1.0, gen_s=4.0, saturates_at=4, kl_base=0.002,
                 kl_per_version=0.001, noise=0.0, seed=0):  # fmt: skip
        self.train_s, self.gen_s, self.saturates_at = train_s, gen_s, saturates_at
        self.kl_base, self.kl_per_version = kl_base, kl_per_version
        self.noise = noise
        self.rng = random.Random(seed)

    def step(self, bound: int) -> Observation:
        jitter = 1 + self.rng.uniform(-self.noise, self.noise)
        batch_s = self.gen_s / min(bound + 1, self.saturates_at) * jitter
        train_s = self.train_s * (1 + self.rng.uniform(-self.noise, self.noise))
        idle_s = max(0.0, batch_s - train_s)
        kl = self.kl_base + self.kl_per_version * bound
        return Observation(idle_s=idle_s, step_s=idle_s + train_s, mismatch_kl=kl,
                           importance_ess=1.0 - 10 * kl)  # fmt: skip


def drive(controller: AutoStaleness, pipeline: Pipeline, num_steps: int):
    """Run the pipeline under the controller; returns every step's decision."""
    decisions = []
    for _ in range(num_steps):
        decisions.append(controller.observe(pipeline.step(controller.bound)))
    return decisions


def settings(**overrides) -> AutoStalenessConfig:
    return AutoStalenessConfig(**{"start": 1, "limit": 8, **overrides})


def test_the_bound_rises_while_the_learner_waits_and_stops_where_generation_saturates():
    # Generation saturates at 4 groups in flight (bound 3): bound 3 makes the learner idle
    # 0 s; nothing is gained above it.
    controller = AutoStaleness(settings(raise_idle_share=0.05))
    decisions = drive(controller, Pipeline(gen_s=4.0, train_s=1.0, saturates_at=4), 200)
    bounds = [d.bound for d in decisions]
    assert bounds[0] == 1 and max(bounds) == 3
    assert [d.change for d in decisions if d.change][:2] == [1, 1]
    assert all(d.reason == Reason.LEARNER_WAITS for d in decisions if d.change == 1)
    # Converged: from step 60 on the bound is 3 throughout, held because the learner no
    # longer waits.
    assert set(bounds[60:]) == {3}
    assert Reason.BALANCED in {d.reason for d in decisions[60:]}


def test_a_raise_that_does_not_make_steps_faster_is_undone_and_not_retried_at_once():
    # Generation saturates at bound 1 (2 groups in flight), but the learner still waits
    # there: raising to 2 changes nothing, so it is undone; the ceiling keeps the bound at 1
    # for a while, after which it is probed again, rarely.
    controller = AutoStaleness(settings(raise_idle_share=0.05))
    decisions = drive(controller, Pipeline(gen_s=6.0, train_s=1.0, saturates_at=2), 300)
    bounds = [d.bound for d in decisions]
    assert max(bounds) == 2
    undone = [i for i, d in enumerate(decisions) if d.reason == Reason.RAISE_DID_NOT_PAY]
    assert undone, "the useless raise was never undone"
    assert sum(b == 1 for b in bounds) > 0.75 * len(bounds)
    # No oscillation: changes are rare (a probe and its undoing per ceiling period).
    changes = sum(1 for d in decisions if d.change)
    assert changes <= 2 * (1 + len(bounds) // 40)
    assert Reason.AT_LIMIT in {d.reason for d in decisions}


class SlowEveryTenth(Pipeline):
    """Every tenth step takes 8 s longer (an evaluation or a checkpoint on the way)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_steps = 0

    def step(self, bound: int) -> Observation:
        observation = super().step(bound)
        self.num_steps += 1
        if self.num_steps % 10:
            return observation
        return Observation(idle_s=observation.idle_s + 8.0, step_s=observation.step_s + 8.0,
                           mismatch_kl=observation.mismatch_kl,
                           importance_ess=observation.importance_ess)  # fmt: skip


def test_one_slow_step_in_the_window_does_not_undo_a_raise_that_paid():
    # Each raise up to bound 3 makes steps 1.5 to 2 times faster; a slow step falls into the
    # eight steps that judge the raise to 2 (step 10 here), and in their mean it would hide
    # the gain. The raises to 2 and 3 are kept; a later slow step makes the learner wait, so
    # 4 is tried, and undone because it did not pay: neither steps/s nor the waits (once
    # the slow step is left out) were better than at 3.
    controller = AutoStaleness(settings(raise_idle_share=0.05))
    decisions = drive(controller, SlowEveryTenth(gen_s=4.0, train_s=1.0, saturates_at=4), 60)
    bounds = [d.bound for d in decisions]
    reached_3 = bounds.index(3)
    assert reached_3 <= 16 and min(bounds[reached_3:]) == 3
    undone = [d for d in decisions if d.reason == Reason.RAISE_DID_NOT_PAY]
    assert [d.bound for d in undone] == [3]
    assert bounds[-1] == 3


class SharedGpu(Pipeline):
    """Engine and learner on one GPU: from bound 2 on, generation running further ahead
    slows each training step by `contention` of it, taking back part of the wait it saved."""

    def __init__(self, *, contention: float, **kwargs):
        super().__init__(**kwargs)
        self.contention = contention

    def step(self, bound: int) -> Observation:
        observation = super().step(bound)
        if bound < 2:
            return observation
        slower_s = self.train_s * self.contention
        idle_s = max(0.0, observation.idle_s - slower_s)
        step_s = observation.step_s - observation.idle_s + slower_s + idle_s
        return Observation(idle_s=idle_s, step_s=step_s, mismatch_kl=observation.mismatch_kl,
                           importance_ess=observation.importance_ess)  # fmt: skip


def test_a_raise_that_stops_the_waits_on_a_shared_gpu_is_kept_though_steps_gain_little():
    # At bound 1 the learner waits 13% of its steps; at 2 it stops waiting but trains 8%
    # slower beside the busier engine: steps/s rise about 6%, under min_gain (10%) and
    # within the steps' 15% noise. The cut in the waits, measured against every step at
    # bound 1, keeps the raise (the H200 run that undid such a raise: docs/benchmarks.md).
    num_kept = 0
    share_at_2 = []
    for seed in range(8):
        controller = AutoStaleness(settings(raise_idle_share=0.1))
        pipeline = SharedGpu(contention=0.08, gen_s=2.3, train_s=1.0, saturates_at=100,
                             noise=0.15, seed=seed)  # fmt: skip
        decisions = drive(controller, pipeline, 120)
        bounds = [d.bound for d in decisions]
        assert max(bounds) == 2, seed  # at 2 the learner no longer waits: no raise to 3
        num_kept += all(d.reason != Reason.RAISE_DID_NOT_PAY for d in decisions)
        share_at_2.append(sum(b == 2 for b in bounds[15:]) / len(bounds[15:]))
    assert num_kept >= 5
    assert sum(share_at_2) / len(share_at_2) > 0.85


def test_the_bound_backs_off_when_the_mismatch_kl_leaves_the_budget_and_stays_below_it():
    # The learner always waits (generation never saturates), but each version of staleness
    # adds 0.004 nats of mismatch KL: bound 4 would be 0.018 > budget 0.015.
    controller = AutoStaleness(settings(max_mismatch_kl=0.015, raise_idle_share=0.05))
    pipeline = Pipeline(gen_s=40.0, train_s=1.0, saturates_at=100, kl_per_version=0.004)
    decisions = drive(controller, pipeline, 300)
    bounds = [d.bound for d in decisions]
    lowered = [d for d in decisions if d.reason == Reason.OVER_BUDGET]
    assert lowered and all(d.mismatch_kl > 0.015 and d.change == -1 for d in lowered)
    assert max(bounds) == 4  # tried once, backed off
    assert sum(b == 3 for b in bounds[100:]) > 0.8 * len(bounds[100:])
    assert all(d.mismatch_kl <= 0.015 for d in decisions if d.reason == Reason.LEARNER_WAITS)


class EarlyFastPolicy(Pipeline):
    """The policy moves ten times faster per version over the run's first 20 steps than
    after them (the mismatch KL per version of staleness: 0.03, then 0.003)."""

    def __init__(self, **kwargs):
        super().__init__(kl_base=0.0, **kwargs)
        self.num_steps = 0

    def step(self, bound: int) -> Observation:
        self.num_steps += 1
        self.kl_per_version = 0.03 if self.num_steps <= 20 else 0.003
        return super().step(bound)


def test_a_bound_lowered_for_the_early_runs_kl_is_tried_again_once_the_kl_leaves_room():
    # Bound 2 breaks the KL budget (0.06 > 0.05) while the policy moves fast and is lowered;
    # once the KL at bound 1 (0.003) scaled to bound 2 is within half the budget, the
    # ceiling is lifted instead of waiting its 24 steps out, and bound 2 then holds.
    for noise, seed in [(0.0, 0), (0.15, 1), (0.15, 2)]:
        controller = AutoStaleness(settings(raise_idle_share=0.1, max_mismatch_kl=0.05))
        pipeline = EarlyFastPolicy(gen_s=3.0, train_s=1.0, saturates_at=3, noise=noise, seed=seed)
        decisions = drive(controller, pipeline, 80)
        lowered = [i for i, d in enumerate(decisions) if d.reason == Reason.OVER_BUDGET]
        assert len(lowered) == 1 and decisions[lowered[0]].bound == 1, seed
        raised_again = next(i for i, d in enumerate(decisions) if i > lowered[0] and d.change)
        assert decisions[raised_again].bound == 2 and raised_again <= lowered[0] + 12, seed
        assert min(d.bound for d in decisions[raised_again:]) == 2, seed


def test_a_budget_broken_at_the_current_bound_lowers_it_to_the_floor_and_says_so_there():
    controller = AutoStaleness(settings(start=3, max_mismatch_kl=0.01), floor=1)
    pipeline = Pipeline(gen_s=40.0, saturates_at=100, kl_base=0.05)  # over budget at any bound
    decisions = drive(controller, pipeline, 60)
    assert [d.bound for d in decisions if d.change] == [2, 1]
    assert decisions[-1].bound == 1 and decisions[-1].reason == Reason.OVER_BUDGET_AT_FLOOR


def test_the_importance_ess_floor_is_a_second_budget():
    controller = AutoStaleness(settings(max_mismatch_kl=1.0, min_importance_ess=0.95))
    pipeline = Pipeline(gen_s=40.0, saturates_at=100, kl_per_version=0.002)  # ESS 1 - 10 KL
    bounds = [d.bound for d in drive(controller, pipeline, 200)]
    assert max(bounds) == 2  # ESS 0.94 at bound 2: lowered back to 1, probed again rarely
    assert sum(b == 1 for b in bounds[50:]) > 0.8 * len(bounds[50:])


def test_with_noisy_steps_the_controller_still_converges_without_oscillating():
    for seed in range(5):
        controller = AutoStaleness(settings(raise_idle_share=0.1))
        pipeline = Pipeline(gen_s=4.0, train_s=1.0, saturates_at=4, noise=0.15, seed=seed)
        decisions = drive(controller, pipeline, 300)
        bounds = [d.bound for d in decisions]
        assert set(bounds[100:]) <= {3, 4}, seed
        assert sum(b == 3 for b in bounds[100:]) > 0.8 * 200, seed
        assert sum(1 for d in decisions[100:] if d.change) <= 6, seed


def test_the_bound_stays_between_its_floor_and_limit_and_decisions_are_metrics():
    controller = AutoStaleness(settings(start=0, limit=2), floor=1)
    assert controller.bound == 1  # start below the floor: the floor
    decisions = drive(controller, Pipeline(gen_s=40.0, saturates_at=100), 100)
    assert {d.bound for d in decisions} == {1, 2}
    assert decisions[-1].reason == Reason.AT_LIMIT
    metrics = decisions[-1].metrics()
    assert metrics["staleness/bound"] == 2 and metrics["staleness/auto_reason"] == Reason.AT_LIMIT
    assert metrics["staleness/auto_idle_share"] > 0.9
    assert "staleness/auto_mismatch_kl" in metrics


def test_a_resumed_run_starts_from_the_bound_it_had_reached():
    cfg = config_from_dict(
        {"data": {"path": "builtin:arithmetic"}, "buffer": {"max_staleness": "auto"}}
    )
    assert start_bound(cfg, None) == 1 and start_bound(cfg, 5) == 5
    assert start_bound(cfg, 50) == 8  # clamped to auto.limit
    assert AutoStaleness.for_run(cfg, start=5).bound == 5
    fixed = config_from_dict({"data": {"path": "builtin:arithmetic"}})
    assert AutoStaleness.for_run(fixed) is None and start_bound(fixed, 5) == 1


# ---------------------------------------------------------------- the promise to admitted groups


def test_a_lowered_bound_still_owes_each_higher_bound_until_its_groups_are_due():
    history = BoundHistory(4)
    history.set(1, version=10)  # bound 4 admitted groups while the engines served 10
    assert [history.eviction_bound(v) for v in (10, 14, 15)] == [4, 4, 1]
    history.set(3, version=20)  # raising owes nothing: the new bound is the larger
    assert history.eviction_bound(21) == 3
    history.set(0, version=22)
    assert [history.eviction_bound(v) for v in (25, 26)] == [3, 0]


async def _send(sender: StreamSender, groups) -> None:
    for group in groups:
        assert await sender.acquire()
        await sender.send(group)
    await sender.flush()


def _group(seq: int, version: int):
    return msgspec.structs.replace(make_group(f"g{seq}", [version] * 2, [0.0, 1.0]), prompt_seq=seq)


@pytest.mark.anyio
@pytest.mark.parametrize("lowered", [True, False])
async def test_the_live_intake_trains_groups_admitted_under_the_higher_bound_after_lowering(
    lowered,
):
    """Two groups of version 0 admitted at bound 4. Lowered to 1 while the engines serve 0, the
    intake admits no new group until the live count fits the new bound, and still trains both
    at versions 3 and 4 (owed until 0 + 4). At bound 1 from the start, both are evicted."""
    intake = Intake(
        "tcp://127.0.0.1:0",
        batch_size=1,
        max_staleness=4 if lowered else 1,
        capacity=8,
        staleness_rule="episode",
        filters=[],
    )
    async with anyio.create_task_group() as tg:
        address = await tg.start(intake.run)
        sender = StreamSender(address, sender_id="w")
        await tg.start(sender.run)
        with anyio.fail_after(30):
            await _send(sender, [_group(0, 0), _group(1, 0)])
            if lowered:
                await intake.set_max_staleness(1)
                assert intake.progress(1).num_startable == 0
            await intake.on_published(3)
            await _send(sender, [_group(9, 3)])
            first = await intake.take(1, 3)
            if lowered:
                assert [g.prompt_seq for g in first] == [0]
                assert [g.prompt_seq for g in await intake.take(1, 4)] == [1]
                assert intake.stats().buffer.evicted.get("stale", 0) == 0
            else:
                assert [g.prompt_seq for g in first] == [9]
                assert intake.stats().buffer.evicted["stale"] == 2
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------- config


def _config(**sections):
    return config_from_dict({"data": {"path": "builtin:arithmetic"}, **sections})


def test_auto_is_refused_outside_async_mode_and_sizes_the_buffer_for_its_limit():
    cfg = _config(buffer={"max_staleness": "auto", "auto": {"limit": 6}})
    assert cfg.buffer.is_auto and cfg.effective_max_staleness == 1
    assert cfg.buffer_capacity == (6 + 2) * cfg.rollout.batch_size
    with pytest.raises(ConfigError, match=r"buffer\.max_staleness = 'auto' needs train\.mode"):
        _config(buffer={"max_staleness": "auto"}, train={"mode": "sync"})
    with pytest.raises(ConfigError, match=r"buffer\.auto\.start = 9 is above buffer\.auto\.limit"):
        _config(buffer={"max_staleness": "auto", "auto": {"start": 9}})
    with pytest.raises(ConfigError, match=r"needs an off-policy correction"):
        _config(
            buffer={"max_staleness": "auto", "auto": {"start": 0}},
            algorithm={"off_policy_correction": "none"},
        )
    with pytest.raises(ConfigError, match=r"buffer\.auto\.start \+ 1"):
        _config(buffer={"max_staleness": "auto"}, weights={"update_interval": 3})
