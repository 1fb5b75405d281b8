"""Long horizons: the buffer's per-turn staleness rule (`buffer.staleness_rule = "per_turn"`,
streamrl/queues/horizon.py).

Random operation sequences (hypothesis) check its invariants, and that on single-turn
groups it hands out exactly what the episode rule does (the single-turn guarantee is
unchanged; tests/queues/test_buffer.py checks that guarantee itself). A 20-turn episode against
a real engine whose weights change every 3 turns spans 7 versions at max_staleness = 2:
the per-turn rule trains it (reporting each turn's staleness), the episode rule evicts
it, and a training step runs on it with each token's own behaviour logprob.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.queues import horizon
from streamrl.queues.buffer import Buffer
from streamrl.types import NO_VERSION, Group, Sample


def episode(turn_versions: list[int], reward: float = 0.0) -> Sample:
    """A sample whose model turns (2 tokens each) carry these versions, with one masked
    observation token between turns."""
    ids, versions, mask, starts = [], [], [], []
    for turn, version in enumerate(turn_versions):
        if turn:
            ids.append(9)
            versions.append(NO_VERSION)
            mask.append(0)
        starts.append(len(ids))
        ids += [5, 6]
        versions += [version, version]
        mask += [1, 1]
    return Sample(
        prompt_ids=[1, 2],
        response_ids=ids,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=versions,
        loss_mask=mask,
        reward=reward,
        turn_starts=starts,
    )


def group(group_id: str, *samples: Sample) -> Group:
    return Group(group_id=group_id, prompt_seq=0, prompt_index=0, samples=list(samples))


# ---------------------------------------------------------------- the rule


def test_turn_versions_and_the_bound_come_from_the_turn_offsets():
    sample = episode([0, 0, 1, 2, 2])
    assert horizon.turn_min_versions(sample) == [0, 0, 1, 2, 2]
    long_and_short = group("g", sample, episode([3]))
    assert horizon.bound_version(long_and_short, "per_turn") == 2  # min of the last turns
    assert horizon.bound_version(long_and_short, "episode") == 0
    assert horizon.max_turn_gap(long_and_short) == 1
    assert horizon.turn_staleness(long_and_short, 4) == [4, 4, 3, 2, 2, 1]
    legacy = episode([0, 3])
    legacy.turn_starts = []  # a sample without turn offsets is one turn
    assert horizon.turn_min_versions(legacy) == [0]


def test_an_episode_older_than_the_bound_is_trained_under_the_per_turn_rule_and_reported():
    long = group("long", episode([0, 1, 2, 3, 4, 5], 1.0), episode([5, 5], 0.0))
    strict = Buffer(capacity=4, max_staleness=2, staleness_rule="episode", filters=())
    strict.put(long)
    assert strict.pop_batch(1, version=6) is None and strict.stats.evicted == {"stale": 1}
    per_turn = Buffer(capacity=4, max_staleness=2, staleness_rule="per_turn", filters=())
    per_turn.put(long)
    assert per_turn.pop_batch(1, version=6) == [long]
    stats = per_turn.stats.as_dict()
    assert stats["staleness_histogram"] == {"6": 1}  # the oldest token, as always
    assert stats["turn_staleness_histogram"] == {"1": 3, "2": 1, "3": 1, "4": 1, "5": 1, "6": 1}
    assert stats["groups_trained_past_bound"] == 1
    assert horizon.step_metrics([long], 6, 2) == {
        "staleness/turn_mean": pytest.approx(23 / 8),
        "staleness/turn_max": 6,
        "staleness/last_turn_max": 1,
        "staleness/turn_gap_max": 1,
        "staleness/groups_past_bound": 1,
    }


def test_a_stale_last_turn_a_gap_past_the_bound_or_the_episode_cap_evict_and_are_counted():
    buffer = Buffer(capacity=4, max_staleness=2, staleness_rule="per_turn", filters=())
    assert buffer.put(group("gap", episode([0, 3]))) == "evicted:turn_stale"
    buffer.put(group("late", episode([0, 1, 2])))
    assert buffer.pop_batch(1, version=5) is None  # its last turn is 3 versions old
    capped = Buffer(
        capacity=4, max_staleness=2, staleness_rule="per_turn", filters=(), max_episode_staleness=4
    )
    capped.put(group("old", episode([0, 1, 2, 3, 4])))
    capped.put(group("young", episode([2, 3, 4])))
    assert [g.group_id for g in capped.pop_batch(1, version=5)] == ["young"]
    assert buffer.stats.evicted == {"turn_stale": 1, "stale": 1}
    assert capped.stats.evicted == {"episode_stale": 1}


turn_lists = st.lists(st.integers(0, 2), min_size=1, max_size=5)  # version steps between turns
operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.lists(turn_lists, min_size=1, max_size=2)),
        st.tuples(st.just("take"), st.integers(1, 3)),
        st.tuples(st.just("advance"), st.integers(1, 2)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, capacity=st.integers(1, 6), max_staleness=st.integers(0, 3))
def test_the_per_turn_rule_bounds_every_turn_when_it_was_passed_and_the_last_when_trained(
    ops, capacity, max_staleness
):
    discarded: list[str] = []
    buffer = Buffer(
        capacity=capacity,
        max_staleness=max_staleness,
        staleness_rule="per_turn",
        filters=(),
        on_discard=lambda g, reason: discarded.append(g.group_id),
    )
    version, accepted, handed_out, ids = 0, [], [], itertools.count()
    for op in ops:
        if op[0] == "put":
            _, behind, steps_per_sample = op
            samples = []
            for steps in steps_per_sample:
                start = max(0, version - behind - sum(steps))
                turns = itertools.accumulate(steps, initial=start)
                samples.append(episode([min(v, version) for v in list(turns)[1:]]))
            g = group(f"g{next(ids)}", *samples)
            buffer.put(g)
            accepted.append(g.group_id)
        elif op[0] == "take":
            for g in buffer.pop_batch(op[1], version) or []:
                handed_out.append(g.group_id)
                for s in g.samples:
                    turns = horizon.turn_min_versions(s)
                    assert version - turns[-1] <= max_staleness
                    assert all(b - a <= max_staleness for a, b in itertools.pairwise(turns))
        else:
            version += op[1]
        assert len(buffer) <= capacity
    remaining = [g.group_id for g in buffer.drain()]
    assert sorted(handed_out + discarded + remaining) == sorted(accepted)
    assert buffer.stats.num_handed_out == len(handed_out)
    assert buffer.stats.num_filtered + buffer.stats.num_evicted == len(discarded)


single_turn_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.integers(0, 2)),
        st.tuples(st.just("take"), st.integers(1, 3)),
        st.tuples(st.just("advance"), st.integers(1, 2)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=single_turn_ops, capacity=st.integers(1, 6), max_staleness=st.integers(0, 3))
def test_on_single_turn_groups_the_per_turn_rule_hands_out_exactly_what_the_episode_rule_does(
    ops, capacity, max_staleness
):
    """Single-turn samples whose tokens span versions (a turn across a weight update)."""
    buffers = {
        rule: Buffer(
            capacity=capacity, max_staleness=max_staleness, staleness_rule=rule, filters=()
        )
        for rule in ("episode", "per_turn")
    }
    outcomes: dict[str, list] = {rule: [] for rule in buffers}
    version, ids = 0, itertools.count()
    for op in ops:
        if op[0] == "put":
            oldest = max(0, version - op[1])
            one_turn = episode([oldest])
            one_turn.versions = np.array([oldest, oldest + op[2]], dtype=np.int32)
            g = group(f"g{next(ids)}", one_turn)
            for rule, buffer in buffers.items():
                outcomes[rule].append(buffer.put(g))
        elif op[0] == "take":
            for rule, buffer in buffers.items():
                batch = buffer.pop_batch(op[1], version)
                outcomes[rule].append(None if batch is None else [g.group_id for g in batch])
        else:
            version += op[1]
    assert outcomes["per_turn"] == outcomes["episode"]
    assert buffers["per_turn"].stats.evicted == buffers["episode"].stats.evicted


def test_the_staleness_rule_is_a_documented_buffer_key_and_the_episode_cap_is_checked():
    from streamrl.config import config_from_dict

    cfg = config_from_dict({"data": {"path": "builtin:arithmetic"}})
    assert cfg.buffer.staleness_rule == "per_turn" and cfg.buffer.max_episode_staleness == 0
    with pytest.raises(Exception, match="max_episode_staleness = 1 is below"):
        config_from_dict(
            {
                "data": {"path": "builtin:arithmetic"},
                "buffer": {"max_staleness": 2, "max_episode_staleness": 1},
            }
        )


# ---------------------------------------------------------------- 20 turns, a real engine


@pytest.mark.anyio
async def test_a_20_turn_episode_across_7_versions_at_eta_2_is_trained_with_per_turn_staleness(
    tiny_engine, tiny_model_dir
):

    from streamrl.actors.rollout import RolloutWorker
    from streamrl.agents import gateway
    from streamrl.backends.step import train_step
    from streamrl.backends.torch import TorchBackend
    from streamrl.config import config_from_dict
    from streamrl.fleet.engine_set import EngineSet
    from streamrl.models import load_tokenizer
    from streamrl.types import Prompt

    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = Prompt(seq=0, index=0, epoch=0, text="count", input_ids=[1])
    url = tiny_engine.url
    async with EngineSet([url]) as engine_set:

        def worker(**agent_kwargs) -> RolloutWorker:
            return RolloutWorker(
                worker_id="w",
                source=None,
                sender=None,
                engines=engine_set,
                tokenizer=tokenizer,
                generate_fn=gateway.generate,
                reward_fn=lambda inp: float(len(inp.response)),
                n_samples_per_prompt=2,
                sampling_params={"max_new_tokens": 3, "temperature": 1.0},
                max_consecutive_failures=0,
                generate_kwargs={
                    "agent": "gateway_agents:long_episode",
                    "agent_kwargs": {"turns": 20, **agent_kwargs},
                },
            )

        # Weights reloaded as versions 1..6 after turns 3, 6, ..., 18 (the last at 6).
        long = await worker(engine_url=url, model_dir=tiny_model_dir).run_sample(prompt, 0)
        fresh = await worker().run_sample(prompt, 1)  # 20 turns, all at version 6
    turns = horizon.turn_min_versions(long)
    assert turns == [t // 3 for t in range(20)] and len(long.turn_starts) == 20
    assert horizon.turn_min_versions(fresh) == [6] * 20
    episodes = group("g", long, fresh)
    assert episodes.num_versions_spanned == 7

    # The learner is at version 7: the first turn is 7 versions old, the last 1.
    strict = Buffer(capacity=2, max_staleness=2, staleness_rule="episode", filters=())
    strict.put(episodes)
    assert strict.pop_batch(1, version=7) is None and strict.stats.evicted == {"stale": 1}
    buffer = Buffer(capacity=2, max_staleness=2, staleness_rule="per_turn", filters=())
    assert buffer.put(episodes) == "accepted"
    (trained,) = buffer.pop_batch(1, version=7)
    assert trained is episodes and buffer.stats.num_evicted == 0
    expected = {7 - v: 3 for v in range(6)} | {1: 2 + 20}
    assert dict(buffer.stats.turn_staleness) == expected
    metrics = horizon.step_metrics([episodes], 7, 2)
    assert metrics["staleness/turn_max"] == 7 and metrics["staleness/last_turn_max"] == 1
    assert metrics["staleness/turn_gap_max"] == 1 and metrics["staleness/groups_past_bound"] == 1

    # A training step on it: every token keeps its own behaviour logprob. The reloaded
    # weights were the same each time, so pi_prox / pi_behav is 1 up to numerics.
    cfg = config_from_dict(
        {
            "data": {"path": "builtin:arithmetic"},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
            "buffer": {"max_staleness": 2},
            "learner": {"lr": 1e-3, "num_threads": 1},
        }
    )
    torch.manual_seed(0)
    backend = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    )
    step = train_step(backend, [episodes], cfg, pad_id=0)
    assert step["train/trained_tokens"] == long.num_trained_tokens + fresh.num_trained_tokens
    assert step["train/logprob_abs_diff_mean"] < 1e-4
