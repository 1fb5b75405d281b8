"""The scheduler's admission rule, step by step over a fake runner (no model, no threads):
a burst that arrives over several steps while others decode is prefilled together."""

from __future__ import annotations

import pytest

from streamrl.engine.core import SamplingParams
from streamrl.engine.runner.base import Pending
from streamrl.engine.runner.scheduler import Scheduler
from streamrl.engine.runner.sequence import Sequence, Status

LONG = SamplingParams(max_new_tokens=1000, ignore_eos=True)


class FakeRunner:
    """Slots and results without a model: every step samples token 7; prefills are recorded."""

    name = "fake"
    shares_prefill = False
    max_seq_len = 4096
    max_prefill_tokens = 1 << 20

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.lanes: list[Sequence] = []
        self.prefill_sizes: list[int] = []

    def num_free_slots(self) -> int:
        return self.max_batch_size - len(self.lanes)

    def prefill(self, groups):
        seqs = [seq for group in groups for seq in group]
        for seq in seqs:
            seq.slot = len(self.lanes)
            self.lanes.append(seq)
        self.prefill_sizes.append(len(seqs))
        return [7] * len(seqs), [-1.0] * len(seqs)

    def launch_decode(self) -> Pending:
        return Pending(seqs=list(self.lanes))

    def collect(self, pending: Pending):
        return [7] * len(pending.seqs), [-1.0] * len(pending.seqs)

    def release(self, seqs) -> None:
        leaving = {id(seq) for seq in seqs}
        self.lanes = [seq for seq in self.lanes if id(seq) not in leaving]
        for seq in seqs:
            seq.slot = None
        for slot, seq in enumerate(self.lanes):
            seq.slot = slot

    def reset(self) -> None:
        self.lanes.clear()


def scheduler(*, max_batch_size: int = 64, admit_hold_steps: int = 16) -> Scheduler:
    return Scheduler(
        FakeRunner(max_batch_size),
        eos_token_ids={2},
        max_seq_len=4096,
        weight_version="v0",
        seed=0,
        admit_hold_steps=admit_hold_steps,
    )


def arrivals(count: int, params: SamplingParams = LONG) -> list[Sequence]:
    return [
        Sequence(
            rid=f"r{i}", prompt_ids=[10 + i, 11], params=params, seed=i, on_finish=lambda s: None
        )
        for i in range(count)
    ]


def test_a_request_reaching_an_idle_engine_is_prefilled_at_the_next_step():
    sched = scheduler()
    sched.add(arrivals(1))
    sched.step()
    assert sched.runner.prefill_sizes == [1] and len(sched.running) == 1


def test_a_burst_arriving_over_several_steps_is_held_back_and_prefilled_in_one_go():
    sched = scheduler()
    sched.add(arrivals(1))
    sched.step()
    for _ in range(5):  # three more arrive before each of five steps: all held back
        sched.add(arrivals(3))
        sched.step()
    assert sched.runner.prefill_sizes == [1]
    assert len(sched.waiting) == 15 and sched.stats["held_steps"] == 5
    assert sched.stats["decode_steps"] == 6  # the running one kept decoding meanwhile
    sched.step()  # a step with no new arrival: the burst is over
    assert sched.runner.prefill_sizes == [1, 15]
    assert not sched.waiting and all(seq.status is Status.RUNNING for seq in sched.running)


def test_a_burst_that_fills_every_free_slot_is_admitted_without_waiting_for_a_quiet_step():
    sched = scheduler(max_batch_size=8)
    sched.add(arrivals(1))
    sched.step()
    sched.add(arrivals(4))
    sched.step()
    assert sched.runner.prefill_sizes == [1]
    sched.add(arrivals(3))  # 7 waiting for 7 free slots
    sched.step()
    assert sched.runner.prefill_sizes == [1, 7]


def test_a_burst_whose_tokens_fill_half_the_prefill_budget_is_admitted_as_one_chunk():
    sched = scheduler()
    sched.runner.max_prefill_tokens = 40  # prompts are 2 tokens: 10 sequences fill half
    sched.add(arrivals(1))
    sched.step()
    sched.add(arrivals(6))
    sched.step()
    assert sched.runner.prefill_sizes == [1]
    sched.add(arrivals(4))  # 10 waiting, 20 tokens
    sched.step()
    assert sched.runner.prefill_sizes == [1, 10]


def test_arrivals_that_never_pause_are_held_back_at_most_admit_hold_steps():
    sched = scheduler(admit_hold_steps=3)
    sched.add(arrivals(1))
    sched.step()
    for _ in range(8):
        sched.add(arrivals(1))
        sched.step()
    # Held 3 steps, admitted at the 4th; again for the next ones.
    assert sched.runner.prefill_sizes == [1, 4, 4]


def test_with_no_hold_each_step_admits_what_has_arrived():
    sched = scheduler(admit_hold_steps=0)
    sched.add(arrivals(1))
    sched.step()
    for _ in range(3):
        sched.add(arrivals(2))
        sched.step()
    assert sched.runner.prefill_sizes == [1, 2, 2, 2]
    assert sched.stats["held_steps"] == 0


@pytest.mark.parametrize("admit_hold_steps", [0, 16])
def test_retracted_sequences_rejoin_at_once_after_resume(admit_hold_steps):
    sched = scheduler(admit_hold_steps=admit_hold_steps)
    sched.add(arrivals(4))
    sched.step()
    sched.pause("retract")
    sched.drain()
    assert len(sched.waiting) == 4 and not sched.running
    sched.resume()
    sched.step()
    assert sched.runner.prefill_sizes == [4, 4] and len(sched.running) == 4
