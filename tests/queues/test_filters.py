"""Dynamic sampling: the built-in and user group filters, their counts, and over-sampling
(admission lets rollout.over_sampling_batch_size groups start per step)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.mains.filters import load_filters
from streamrl.queues.admission import Admission
from streamrl.queues.buffer import Buffer
from streamrl.types import FinishReason, Group, Sample


def make_group(seq: int, *, version: int = 0, lengths=(3, 3), rewards=(0.0, 1.0), finish=None):
    samples = [
        Sample(
            prompt_ids=[1, 2],
            response_ids=[3] * length,
            logprobs=[-0.5] * length,
            versions=[version] * length,
            loss_mask=[1] * length,
            reward=reward,
            finish_reason=(finish or [FinishReason.STOP] * len(lengths))[i],
        )
        for i, (length, reward) in enumerate(zip(lengths, rewards, strict=True))
    ]
    return Group(group_id=f"s{seq}", prompt_seq=seq, prompt_index=seq, samples=samples)


def test_truncated_and_length_bounds_drop_groups_and_count_them_by_name():
    filters = load_filters(["truncated"], min_response_tokens=2, max_response_tokens=5)
    assert [name for name, _ in filters] == [
        "truncated",
        "min_response_tokens",
        "max_response_tokens",
    ]
    buffer = Buffer(capacity=10, max_staleness=1, filters=filters, staleness_rule="episode")
    cut_off = [FinishReason.STOP, FinishReason.LENGTH]
    assert buffer.put(make_group(0, finish=cut_off)) == "filtered:truncated"
    assert buffer.put(make_group(1, lengths=(1, 4))) == "filtered:min_response_tokens"
    assert buffer.put(make_group(2, lengths=(2, 6))) == "filtered:max_response_tokens"
    assert buffer.put(make_group(3, lengths=(2, 5))) == "accepted"  # the bounds are inclusive
    assert dict(buffer.stats.filtered) == {
        "truncated": 1,
        "min_response_tokens": 1,
        "max_response_tokens": 1,
    }
    assert buffer.stats.as_dict()["filtered_by"] == dict(buffer.stats.filtered)


def test_a_module_function_filter_is_imported_applied_and_counted_under_its_spec():
    spec = "tests.e2e_filters:drop_odd_prompts"
    buffer = Buffer(
        capacity=10,
        max_staleness=1,
        filters=load_filters(["zero_std", spec]),
        staleness_rule="episode",
    )
    results = [buffer.put(make_group(seq)) for seq in range(6)]
    assert results == ["accepted", f"filtered:{spec}"] * 3
    assert buffer.put(make_group(6, rewards=(1.0, 1.0))) == "filtered:zero_std"
    assert dict(buffer.stats.filtered) == {spec: 3, "zero_std": 1}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.e2e_filters:no_such_function", r"buffer\.filters\[1\].*has no attribute"),
        ("tests.no_such_module:f", r"buffer\.filters\[1\].*module not found"),
        ("tests.e2e_filters:not_callable", r"buffer\.filters\[1\].*not a callable"),
        ("streamrl.types:make_decoder", None),  # one argument: accepted
        ("streamrl.types:int_array", None),
        ("zero_sdt", r"buffer\.filters\[1\].*neither a built-in"),
    ],
)
def test_a_bad_filter_is_refused_at_startup_naming_its_index(spec, message):
    if message is None:
        load_filters(["zero_std", spec])
        return
    with pytest.raises(ValueError, match=message):
        load_filters(["zero_std", spec])


def test_a_filter_of_the_wrong_arity_or_an_async_one_is_refused_naming_its_index():
    with pytest.raises(ValueError, match=r"buffer\.filters\[0\].*one argument"):
        load_filters(["tests.e2e_filters:needs_two"])
    with pytest.raises(ValueError, match=r"buffer\.filters\[0\].*async"):
        load_filters(["tests.e2e_filters:is_async"])


def simulate(batch_size: int, groups_per_step: int, eta: int, steps: int, keep) -> dict:
    """Rounds of: start every group admission allows, let them all finish (the filter
    drops some), then train one step if the buffer holds a full batch."""
    admission = Admission(
        batch_size=batch_size,
        max_staleness=eta,
        capacity=(eta + 2) * groups_per_step,
        groups_per_step=groups_per_step,
    )
    buffer = Buffer(
        capacity=(eta + 2) * groups_per_step,
        max_staleness=eta,
        staleness_rule="episode",
        filters=[("keep", keep)],
        on_discard=lambda group, reason: admission.discarded(),
    )
    admission._num_buffered = lambda: len(buffer)
    version, seq, rounds, batches = 0, 0, 0, []
    while len(batches) < steps:
        rounds += 1
        assert rounds < 20 * steps, "no progress"
        started = []
        for _ in range(admission.available()):
            admission.granted(1)
            started.append(make_group(seq, version=version))
            seq += 1
        for group in started:
            admission.returned()
            buffer.put(group)
        batch = buffer.pop_batch(batch_size, version)
        if batch is not None:
            batches.append([(group.staleness(version), group.prompt_seq) for group in batch])
            version += 1
            admission.set_version(version)
    return {"rounds": rounds, "batches": batches, "evicted": buffer.stats.num_evicted}


def test_over_sampling_keeps_every_batch_full_while_half_the_groups_are_filtered():
    def keep_even(group: Group) -> bool:
        return group.prompt_seq % 2 == 0

    """At eta = 0 (on-policy) admission without over-sampling starts only B groups per
    version, half come back filtered, and the learner waits for further rounds of
    generation; with O = 2B a full batch is there every round. (At eta >= 1 the staleness
    budget's own slack also replaces the filtered groups in this idealised simulation,
    where every started group finishes within the round.)"""
    plain = simulate(4, 4, eta=0, steps=10, keep=keep_even)
    over = simulate(4, 8, eta=0, steps=10, keep=keep_even)
    for run in (plain, over):
        assert all(len(batch) == 4 for batch in run["batches"])
        assert all(stale == 0 and seq % 2 == 0 for b in run["batches"] for stale, seq in b)
    assert over["rounds"] == 10  # a full batch every round: filtered groups were replaced ahead
    assert plain["rounds"] >= 20  # without over-sampling the learner waits for more rounds
    assert simulate(4, 8, eta=1, steps=10, keep=keep_even)["rounds"] == 10


@settings(max_examples=150, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    extra=st.integers(0, 6),
    eta=st.integers(0, 2),
    drop=st.lists(st.booleans(), min_size=1, max_size=7),
)
def test_with_over_sampling_every_trained_group_stays_within_the_staleness_bound(
    batch_size, extra, eta, drop
):
    def keep(group: Group) -> bool:
        return not drop[group.prompt_seq % len(drop)]

    if all(drop):
        return
    run = simulate(batch_size, batch_size + extra, eta=eta, steps=6, keep=keep)
    assert all(len(batch) == batch_size for batch in run["batches"])
    assert all(stale <= eta for batch in run["batches"] for stale, _ in batch)
