"""Continuous batching: which sequences run, and what each step's tokens mean.

Lives on the engine thread; everything here is single-threaded. One `step`:
1. if a decode step is in flight and the lane set must change (finished
   sequences to release, or waiting ones that fit), collect it first;
2. with nothing in flight: release finished slots, admit waiting sequences
   (FIFO, within free slots and the prefill token budget; identical token
   lists are prefilled once) and append their first tokens;
3. launch one decode step over all running sequences, then process the
   previous step's results while this one runs on the device (overlap).

Admission takes a burst whole. Requests sent together reach the engine over
HTTP one by one, across several steps; admitting each step's share would run
one small prefill per step (each a pipeline drain and an eager forward) and
spread the burst's finishes over as many steps. So while others decode and
sequences keep arriving, the waiting ones are held back: they join at the
first step that saw no new arrival, once they fill every free slot, once their
tokens fill half the prefill budget (a prefill that large amortises its eager
launch, and the device computes it while the rest of the burst comes in), or
after `admit_hold_steps` held steps. With nothing decoding they join at once.

A token carries the weight version current when its step was launched;
weights change only between steps (`drain` first), so a version is exact.
"""

from __future__ import annotations

import logging
import random
from collections import deque

from streamrl.engine.runner.base import Pending, Runner
from streamrl.engine.runner.sequence import Sequence, Status, finish_reason_after_append

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        *,
        eos_token_ids,
        max_seq_len: int,
        weight_version: str,
        seed: int,
        admit_hold_steps: int = 0,
    ):
        self.runner = runner
        self.admit_hold_steps = admit_hold_steps
        """Most steps in a row that arrivals are held back while more keep coming (0: none)."""
        self.num_arrived = 0  # sequences queued since the last step
        self.num_held_steps = 0  # steps in a row that admission was held back
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.weight_version = weight_version
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending: Pending | None = None
        self.to_release: list[Sequence] = []
        self.is_paused = False
        self.seed_source = random.Random(seed)
        self.stats = {
            "prefills": 0,
            "held_steps": 0,
            "prefill_tokens": 0,
            "shared_prefill_tokens": 0,
            "decode_steps": 0,
            "generated_tokens": 0,
        }

    # -- queries ------------------------------------------------------------

    def can_admit(self) -> bool:
        return not self.is_paused and bool(self.waiting) and self.runner.num_free_slots() > 0

    def has_work(self) -> bool:
        return self.pending is not None or (
            not self.is_paused and bool(self.running or self.waiting)
        )

    # -- commands (call `drain` first) ----------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.seed < 0:
                seq.seed = self.seed_source.getrandbits(63)
            if seq.params.max_new_tokens <= 0:
                self._finish(seq, {"type": "length", "length": 0})
            else:
                self.waiting.append(seq)
                self.num_arrived += 1

    def abort(self, rid: str | None, message: str) -> None:
        """Finish matching waiting and running sequences with their partial output."""
        reason = {"type": "abort", "message": message}
        for seq in [s for s in self.waiting if rid is None or s.rid == rid]:
            self.waiting.remove(seq)
            self._finish(seq, reason)
        for seq in [s for s in self.running if rid is None or s.rid == rid]:
            self._finish(seq, reason)
        self._release_finished()

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self.is_paused = True
        if mode == "abort":
            self.abort(None, "aborted by pause_generation")
        elif mode == "retract":
            self.retract_all()

    def resume(self) -> None:
        self.is_paused = False

    def retract_all(self) -> None:
        """Running sequences drop their KV and wait again, ahead of newer arrivals."""
        self.runner.release(self.running)
        for seq in reversed(self.running):
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self.running.clear()

    def fail_all(self, message: str) -> None:
        """After a runner error: abort everything and forget every slot."""
        self.pending = None
        self.to_release.clear()
        self.runner.reset()
        self.abort(None, message)

    # -- stepping -----------------------------------------------------------

    def drain(self) -> None:
        """Collect the step in flight (if any) and free finished slots."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._process(pending)
        self._release_finished()

    def _release_finished(self) -> None:
        """Free the slots of finished sequences (only with no step in flight)."""
        if self.to_release:
            self.runner.release(self.to_release)
            self.to_release = []

    def step(self) -> None:
        is_due = self._is_admission_due()
        if self.pending is not None and (self.to_release or is_due):
            self.drain()
        if self.pending is None:
            self.drain()
            if is_due or (self.can_admit() and not self.running):  # the drain ended them all
                self._admit()
                self._release_finished()  # those done after their first token
        if self.is_paused or not self.running:
            self.drain()
            return
        launched = self.runner.launch_decode()
        launched.version = self.weight_version
        self.stats["decode_steps"] += 1
        previous, self.pending = self.pending, launched
        if previous is not None:
            self._process(previous)

    def _is_admission_due(self) -> bool:
        """Whether waiting sequences join this step: the burst rule of the module docstring.
        Called once per step (it counts the held steps)."""
        is_bursting, self.num_arrived = self.num_arrived > 0, 0
        if not self.can_admit():
            return False
        is_due = (
            not is_bursting
            or not self.running
            or len(self.waiting) >= self.runner.num_free_slots()
            or self.num_held_steps >= self.admit_hold_steps
            or 2 * sum(seq.num_tokens for seq in self.waiting) >= self.runner.max_prefill_tokens
        )
        if is_due:
            self.num_held_steps = 0
        else:
            self.num_held_steps += 1
            self.stats["held_steps"] += 1
        return is_due

    def _admit(self) -> None:
        free = self.runner.num_free_slots()
        budget = self.runner.max_prefill_tokens
        groups: dict[tuple[int, ...], list[Sequence]] = {}
        used = 0
        while self.waiting and free > 0:
            seq = self.waiting[0]
            key = tuple(seq.tokens) if self.runner.shares_prefill else (id(seq),)
            cost = 0 if key in groups else seq.num_tokens
            if groups and used + cost > budget:
                break
            self.waiting.popleft()
            groups.setdefault(key, []).append(seq)
            used += cost
            free -= 1
        ordered = list(groups.values())
        seqs = [seq for group in ordered for seq in group]
        for seq in seqs:  # running before the runner sees them: a failure aborts them too
            seq.status = Status.RUNNING
            self.running.append(seq)
        cached_before = sum(seq.cached_tokens for seq in seqs)
        tokens, logprobs = self.runner.prefill(ordered)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += used
        self.stats["shared_prefill_tokens"] += (
            sum(seq.cached_tokens for seq in seqs) - cached_before
        )
        version = self.weight_version
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            self._append(seq, token, logprob, version)

    def _process(self, pending: Pending) -> None:
        tokens, logprobs = self.runner.collect(pending)
        for seq, token, logprob in zip(pending.seqs, tokens, logprobs, strict=False):
            if seq is not None and seq.status is Status.RUNNING:
                self._append(seq, token, logprob, pending.version)

    def _append(self, seq: Sequence, token: int, logprob: float, version: str) -> None:
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        self.stats["generated_tokens"] += 1
        reason = finish_reason_after_append(seq, token, self.eos_token_ids, self.max_seq_len)
        if reason is not None:
            self._finish(seq, reason)  # the final output carries the last token to a stream
        elif seq.on_token is not None:
            seq.on_token(token, logprob, version)

    def _finish(self, seq: Sequence, reason: dict) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq.slot is not None:  # freed with no step in flight, see `_release_finished`
            self.to_release.append(seq)
        try:
            seq.on_finish(seq)
        except Exception:
            logger.exception("delivering the output of %s failed", seq.rid)
