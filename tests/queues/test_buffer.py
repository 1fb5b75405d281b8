"""Buffer and admission invariants, checked on random operation sequences (hypothesis)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.queues.admission import Admission
from streamrl.queues.buffer import Buffer
from streamrl.types import NO_VERSION, Group, Sample


def make_group(group_id: str, versions: list[int], rewards: list[float]) -> Group:
    samples = [
        Sample(
            prompt_ids=[1, 2],
            response_ids=[3] * len(versions),
            logprobs=[-0.5] * len(versions),
            versions=versions,
            loss_mask=[1] * len(versions),
            reward=reward,
        )
        for reward in rewards
    ]
    return Group(group_id=group_id, prompt_seq=0, prompt_index=0, samples=samples)


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.integers(0, 3),  # how far behind the current version the oldest token is
            st.integers(0, 2),  # extra versions the episode spans
            st.booleans(),  # rewards all equal (filtered by zero_std)
        ),
        st.tuples(st.just("take"), st.integers(1, 4)),
        st.tuples(st.just("advance"), st.integers(1, 2)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, capacity=st.integers(1, 8), max_staleness=st.integers(0, 3))
def test_buffer_never_exceeds_capacity_never_hands_out_stale_groups_and_loses_nothing(
    ops, capacity, max_staleness
):
    discarded: list[str] = []
    buffer = Buffer(
        capacity=capacity,
        max_staleness=max_staleness,
        staleness_rule="episode",
        filters=["zero_std"],
        on_discard=lambda group, reason: discarded.append(group.group_id),
    )
    version = 0
    accepted: list[str] = []
    handed_out: list[str] = []
    ids = itertools.count()
    for op in ops:
        if op[0] == "put":
            _, behind, span, equal = op
            oldest = max(0, version - behind)
            group = make_group(
                f"g{next(ids)}", [oldest, oldest + span], [1.0, 1.0] if equal else [0.0, 1.0]
            )
            buffer.put(group)
            accepted.append(group.group_id)
        elif op[0] == "take":
            batch = buffer.pop_batch(op[1], version)
            if batch is not None:
                assert len(batch) == op[1]
                for group in batch:
                    assert group.staleness(version) <= max_staleness
                    handed_out.append(group.group_id)
        else:
            version += op[1]
        assert len(buffer) <= capacity

    remaining = [g.group_id for g in buffer.drain()]
    # Every accepted group is accounted for exactly once.
    assert sorted(handed_out + discarded + remaining) == sorted(accepted)
    stats = buffer.stats
    assert stats.num_accepted == len(accepted)
    assert stats.num_handed_out == len(handed_out)
    assert stats.num_filtered + stats.num_evicted == len(discarded)
    assert sum(stats.staleness.values()) == len(handed_out)


def test_batches_go_out_oldest_token_version_first():
    buffer = Buffer(capacity=10, max_staleness=5, staleness_rule="episode", filters=())
    buffer.put(make_group("new", [4, 4], [0, 1]))
    buffer.put(make_group("old", [2, 5], [0, 1]))
    buffer.put(make_group("mid", [3, 3], [0, 1]))
    assert [g.group_id for g in buffer.pop_batch(3, version=5)] == ["old", "mid", "new"]


def test_staleness_is_measured_from_the_oldest_trained_token_only():
    group = make_group("g", [3, 4, 5], [0, 1])
    group.samples[0].versions = np.array([NO_VERSION, 4, 5], dtype=np.int32)
    group.samples[0].loss_mask = np.array([0, 1, 1], dtype=np.uint8)
    assert group.oldest_version == 3  # the second sample still has its version-3 token
    group.samples[1].loss_mask = np.array([0, 1, 1], dtype=np.uint8)
    assert group.oldest_version == 4
    assert group.num_versions_spanned == 2
    assert group.staleness(6) == 2


def test_a_group_past_the_bound_is_evicted_and_counted_not_handed_out():
    buffer = Buffer(capacity=4, max_staleness=1, staleness_rule="episode", filters=())
    buffer.put(make_group("stale", [0, 0], [0, 1]))
    buffer.put(make_group("fresh", [2, 2], [0, 1]))
    assert [g.group_id for g in buffer.pop_batch(1, version=2)] == ["fresh"]
    assert buffer.stats.evicted["stale"] == 1


def test_zero_variance_groups_are_filtered_and_counted():
    buffer = Buffer(capacity=4, max_staleness=1, filters=["zero_std"], staleness_rule="episode")
    assert buffer.put(make_group("same", [0], [1.0, 1.0])) == "filtered:zero_std"
    assert buffer.put(make_group("diff", [0], [0.0, 1.0])) == "accepted"
    assert len(buffer) == 1 and buffer.stats.filtered["zero_std"] == 1


def test_admission_follows_the_areal_rule():
    admission = Admission(batch_size=4, max_staleness=1, capacity=100)
    # (v + eta + 1) * B = 8 groups may start at version 0.
    assert admission.available() == 8
    admission.granted(8)
    assert admission.available() == 0
    for _ in range(8):
        admission.returned()
    assert admission.available() == 0  # returned groups still count until trained
    admission.set_version(1)
    assert admission.available() == 4
    admission.discarded(2)  # two were filtered: their budget comes back
    assert admission.available() == 6


def test_admission_never_lets_buffered_plus_in_flight_exceed_capacity():
    buffered = [0]
    admission = Admission(
        batch_size=4, max_staleness=4, capacity=6, num_buffered=lambda: buffered[0]
    )
    assert admission.available() == 6
    admission.granted(6)
    for _ in range(6):
        admission.returned()
    buffered[0] = 6
    assert admission.available() == 0
    buffered[0] = 2
    assert admission.available() == 4


def test_admission_is_rebased_on_resume():
    admission = Admission(batch_size=4, max_staleness=0, capacity=100, start_version=10)
    assert admission.available() == 4


@settings(max_examples=200, deadline=None)
@given(
    batch_size=st.integers(1, 5),
    eta=st.integers(0, 3),
    steps=st.lists(st.sampled_from(["grant", "finish", "train"]), max_size=60),
)
def test_groups_admitted_by_the_rule_are_never_too_stale_when_trained_in_order(
    batch_size, eta, steps
):
    """Simulate rollout + learner: every group trained within eta of the version it started on."""
    admission = Admission(batch_size=batch_size, max_staleness=eta, capacity=10_000)
    started_at: list[int] = []  # version each started group was admitted at, in start order
    finished = 0
    trained = 0
    for step in steps:
        if step == "grant" and admission.available() > 0:
            admission.granted(1)
            started_at.append(admission.version)
        elif step == "finish" and finished < len(started_at):
            admission.returned()
            finished += 1
        elif step == "train" and finished - trained >= batch_size:
            version = admission.version
            for index in range(trained, trained + batch_size):
                assert version - started_at[index] <= eta
            trained += batch_size
            admission.set_version(version + 1)
