"""The accounting identity by prompt seq: every group in one fate, every started prompt
received or in flight."""

from __future__ import annotations

from streamrl.queues.accounting import Accounting, StreamState, runs


def state(**fields) -> StreamState:
    return StreamState(**{"first_seq": 0, "next_seq": 6, **fields})


def test_a_consistent_stream_has_no_problems():
    accounting = Accounting(received={0, 1, 2, 3})
    accounting.on_trained([0, 1])
    accounting.on_discarded(2, "filtered:zero_std")
    accounting.on_report(state(in_flight=[4], unacked=[5]))
    assert accounting.problems(buffered=[3]) == []
    assert accounting.as_metrics(buffered=[3]) == {
        "accounting/started": 6,
        "accounting/received": 4,
        "accounting/trained": 2,
        "accounting/filtered": 1,
        "accounting/evicted": 0,
        "accounting/buffered": 1,
        "accounting/in_flight": 2,
    }


def test_a_group_that_arrives_after_the_last_report_is_received_not_in_flight():
    """Seen at the end of runs (summary: started 10 = trained 6 + buffered 4, and 1 in
    flight): seq 9 was in flight at the worker's last report and arrived before the stop."""
    accounting = Accounting(received=set(range(9)))
    accounting.on_trained(range(6))
    accounting.on_report(state(next_seq=10, in_flight=[9]))
    assert accounting.in_flight == 1 and accounting.num_started == 10
    accounting.received.add(9)
    assert accounting.problems(buffered=[6, 7, 8, 9]) == []
    assert accounting.in_flight == 0 and accounting.num_started == 10


def test_a_started_prompt_neither_received_nor_in_flight_is_a_problem():
    accounting = Accounting(received={0, 1, 2, 3, 4})
    accounting.on_trained([0, 1, 2, 3, 4])
    accounting.on_report(state(in_flight=[]))  # seq 5 started, never sent: lost
    (problem,) = accounting.problems(buffered=[])
    assert "1 started seqs neither received nor in flight: 5" in problem


def test_prompts_skipped_before_the_start_or_for_length_were_never_started():
    accounting = Accounting(received={0, 1, 4})
    accounting.on_trained([0, 1, 4])
    accounting.on_report(state(start_skip=[2], too_long=[3], in_flight=[5]))
    assert accounting.problems(buffered=[]) == []


def test_a_prompt_trained_twice_or_in_two_fates_is_a_problem():
    accounting = Accounting(received={0, 1})
    accounting.on_trained([0])
    accounting.on_trained([0])
    accounting.on_discarded(1, "evicted:stale")
    problems = accounting.problems(buffered=[1])
    assert "1 seqs trained twice" in problems
    assert any("two fates" in p and "1" in p for p in problems)


def test_a_received_group_with_no_fate_is_a_problem():
    accounting = Accounting(received={0, 1, 2})
    accounting.on_trained([0])
    (problem,) = accounting.problems(buffered=[1])
    assert "received 3 != accounted 2" in problem and "unaccounted 2" in problem


def test_in_flight_seqs_that_were_never_started_are_a_problem():
    accounting = Accounting(received=set())
    accounting.on_report(state(first_seq=3, next_seq=5, in_flight=[3, 4, 9]))
    (problem,) = accounting.problems(buffered=[])
    assert "in flight that were never started: 9" in problem


def test_seqs_are_written_as_runs():
    assert runs({1, 2, 3, 7, 9, 10}) == [[1, 4], [7, 8], [9, 11]]
    assert runs(set()) == []
