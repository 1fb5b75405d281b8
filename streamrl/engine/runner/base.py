"""What the scheduler needs from a runner (compact or transformers).

Call order, all on the engine thread: ``prefill`` and ``release`` only while no
decode step is in flight; ``launch_decode`` may run while the previous step is
still in flight (its inputs then come from that step's outputs on the device);
``collect`` each launched step exactly once, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from streamrl.engine.runner.sequence import Sequence


@dataclass
class Pending:
    """A launched decode step: results for ``seqs`` (None: an idle lane) arrive on collect."""

    seqs: list[Sequence | None]
    version: str = ""
    handle: Any = None  # runner-private: event, host buffer index, device tensors
    extra: dict = field(default_factory=dict)


class Runner(Protocol):
    name: str
    max_batch_size: int
    max_seq_len: int
    max_prefill_tokens: int
    shares_prefill: bool  # identical prompts in one prefill are computed once

    def num_free_slots(self) -> int: ...

    def prefill(self, groups: list[list[Sequence]]) -> tuple[list[int], list[float]]:
        """Give every sequence a slot, compute its KV, sample its next token.

        ``groups`` hold sequences with identical tokens; results follow the
        groups flattened in order."""
        ...

    def launch_decode(self) -> Pending: ...

    def collect(self, pending: Pending) -> tuple[list[int], list[float]]: ...

    def release(self, seqs: list[Sequence]) -> None:
        """Free these sequences' slots and KV (they may be re-prefilled later)."""
        ...

    def reset(self) -> None:
        """Forget every slot (after a failure); the model stays loaded."""
        ...

    def plan_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list:
        """Validate HF-named tensors, full or LoRA adapter pairs (ValueError on an unknown name
        or shape); copy nothing."""
        ...

    def load_weights(self, plan: list) -> None:
        """Copy a validated plan in place; returns once the copies finished."""
        ...
