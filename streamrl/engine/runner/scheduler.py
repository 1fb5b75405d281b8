"""Continuous batching: which sequences run, and what each step's tokens mean.

Lives on the engine thread; everything here is single-threaded. One `step`:
1. if a decode step is in flight and the lane set must change (finished
   sequences to release, or waiting ones that fit), collect it first;
2. with nothing in flight: release finished slots, admit waiting sequences
   (FIFO, within free slots and the prefill token budget; identical token
   lists are prefilled once) and append their first tokens;
3. launch one decode step over all running sequences, then process the
   previous step's results while this one runs on the device (overlap).
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
        self, runner: Runner, *, eos_token_ids, max_seq_len: int, weight_version: str, seed: int
    ):
        self.runner = runner
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
        if self.pending is not None and (self.to_release or self.can_admit()):
            self.drain()
        if self.pending is None:
            self.drain()
            if self.can_admit():
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
        if seq.on_token is not None:
            seq.on_token(token, logprob, version)
        reason = finish_reason_after_append(seq, token, self.eos_token_ids, self.max_seq_len)
        if reason is not None:
            self._finish(seq, reason)

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
