"""One request's state inside the engine, and the rules that finish it.

A `Sequence` is owned by the scheduler thread: nothing else reads or writes it
while it runs. Invariants:
- ``tokens == prompt_ids + output_ids``; ``len(output_ids) == len(logprobs) == len(versions)``.
- ``slot`` is the KV slot it occupies (compact runner) or None when it holds no KV.
- once ``finish_reason`` is set, the sequence never changes again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    RUNNING = "running"  # holds a slot; its last token still awaits its KV write
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: Any  # core.SamplingParams
    seed: int  # per-request sampling seed: the request's own or one drawn by the engine
    on_finish: Callable[[Sequence], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    slot: int | None = None
    cached_tokens: int = 0
    stop_checker: StopStringChecker | None = None
    return_routed_experts: bool = False
    routed_experts: list[Any] | None = None  # per fed token: [layers, top_k] expert ids (hf runner)
    on_token: Callable[[int, float, str], None] | None = None
    """Called on the engine thread with (token, logprob, version) after each output token
    (streamed requests); must not block."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class StopStringChecker:
    """Finds stop strings in the decoded output, looking only at its recent tail.

    A stop string of ``c`` characters spans at most ``4 * c`` byte-level tokens
    (UTF-8 characters are at most 4 bytes), so decoding that many trailing tokens
    (plus margin) each step finds a match the step it completes.
    """

    def __init__(self, stops: Iterable[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(s for s in stops if s)
        self.decode = decode
        self.window_tokens = 4 * max((len(s) for s in self.stops), default=0) + 4

    def match(self, output_ids: list[int]) -> str | None:
        if not self.stops:
            return None
        tail = self.decode(output_ids[-self.window_tokens :])
        for stop in self.stops:
            if stop in tail:
                return stop
        return None


def finish_reason_after_append(
    seq: Sequence, token: int, eos_token_ids: frozenset[int], max_seq_len: int
) -> dict | None:
    """Why ``seq`` finishes now that ``token`` is its newest output, or None.

    Order: stop token (EOS unless ignore_eos, then stop_token_ids), stop string,
    then length (max_new_tokens, then max_seq_len). Stops count only once
    ``min_new_tokens`` outputs exist; they are never masked out of sampling, so
    logprobs stay those of the unmodified distribution.
    """
    params = seq.params
    num_out = len(seq.output_ids)
    if num_out >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return {"type": "stop", "matched": token}
        if seq.stop_checker is not None:
            matched = seq.stop_checker.match(seq.output_ids)
            if matched is not None:
                return {"type": "stop", "matched": matched}
    if num_out >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if seq.num_tokens >= max_seq_len:
        return {"type": "length", "length": num_out}
    return None
