"""The learner backend interface: what the training loop needs from a model.

The loop (`streamrl.actors.learner`) owns the algorithm: it packs samples
into micro-batches, asks the backend for proximal (and reference)
log-probabilities, computes advantages, and hands the backend one mini-batch
at a time together with a loss function. A backend (`torch` for Hugging Face
models, `megatron` for megatron-core) owns the model, the optimizer and the
parallelism, and gives the publisher full Hugging Face-named tensors.

Token alignment: every per-token tensor is `[B, T]` and aligned with
`input_ids`; position t holds data about token t, i.e. the log-probability of
`input_ids[b, t]` given the tokens before it in its own sample. A sample's first
token and padding hold 0.

Two row layouts (`learner.pack_sequences`): right-padded rows, one sample per row
from column 0 (`position_ids` None), or packed rows, several samples back to back
with positions restarting at 0 at each sample (`position_ids`); a backend then
keeps attention inside each sample (a document mask) and feeds those positions
to RoPE, so every value equals the padded layout's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

CRITIC_DIR = "critic"
"""The critic's part of a checkpoint directory (with `algorithm.advantage_estimator = "gae"`)."""


@dataclass
class MicroBatch:
    """One forward/backward pass worth of sequences: right-padded rows, or packed rows."""

    input_ids: torch.Tensor
    """[B, T] int64 prompt + response tokens, right-padded (packed rows: back to back, then
    padding)."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens, 0 on padding."""
    loss_mask: torch.Tensor
    """[B, T] float32, 1 on trained (model-produced) response tokens."""
    behaviour_logprobs: torch.Tensor
    """[B, T] float32 engine log-probabilities of the tokens (0 off the loss mask)."""
    sample_indices: list[int]
    """The training step's samples in this micro-batch: row b is sample `sample_indices[b]`
    in the padded layout; packed, sample `sample_indices[i]` sits at row `sample_rows[i]`
    from column `sample_columns[i]`."""
    advantages: torch.Tensor | None = None
    """[B, T] float32, filled by the loop before training."""
    proximal_logprobs: torch.Tensor | None = None
    """[B, T] log-probabilities under the weights before this step (decoupled PPO's pi_prox)."""
    reference_logprobs: torch.Tensor | None = None
    """[B, T] log-probabilities under the reference model (only with a KL loss)."""
    num_tokens_in_mini_batch: float = 1.0
    """Trained tokens of the whole mini-batch: token_mean's denominator."""
    num_sequences_in_mini_batch: int = 1
    """Sequences of the whole mini-batch: seq_mean's denominator."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    position_ids: torch.Tensor | None = None
    """[B, T] int64 packed rows only: each token's position in its own sample (0 at the
    sample's first token; the tail padding of a row counts as one more sample of its own).
    None: right-padded rows, where the position is the column."""
    sample_rows: list[int] = field(default_factory=list)
    """Packed rows only: the row of each of `sample_indices` (empty: padded, row i)."""
    sample_columns: list[int] = field(default_factory=list)
    """Packed rows only: the column each of `sample_indices` starts at (empty: 0)."""

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def is_packed(self) -> bool:
        """Several samples per row (`position_ids` set), else one right-padded sample per row."""
        return self.position_ids is not None

    def placements(self) -> list[tuple[int, int]]:
        """(row, first column) of each of `sample_indices`, in that order."""
        if not self.sample_rows:
            return [(row, 0) for row in range(len(self.sample_indices))]
        return list(zip(self.sample_rows, self.sample_columns, strict=True))

    def predicted(self) -> torch.Tensor:
        """[B, T - 1] bool: position p's output predicts token p + 1 of the same sample (and
        that token is trained): the trained positions, less each packed sample's first token,
        which the previous sample's last token is beside but does not predict."""
        predicts = self.loss_mask[:, 1:] > 0
        if self.position_ids is not None:
            predicts = predicts & (self.position_ids[:, 1:] != 0)
        return predicts

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device`."""
        moved = {
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
            if name != "extras"
        }
        moved["extras"] = {k: v.to(device, non_blocking=True) for k, v in self.extras.items()}
        return MicroBatch(**moved)


LossFn = Callable[
    [MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]
]
"""(micro_batch, logprobs [B,T] with grad, entropy [B,T] or None) -> (loss, metrics).

The loss is already divided by the mini-batch totals, so the gradient of the
mini-batch is the sum of its micro-batches' gradients. Metrics are scalar
tensors summed over micro-batches (they are normalised the same way)."""


class LearnerBackend(Protocol):
    """A trainable policy. Methods are called on every rank; rank 0 holds the data."""

    @property
    def is_publisher(self) -> bool:
        """True on the rank that talks to the buffer and broadcasts weights to engines."""
        ...

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives (a worker thread that trains binds to it first)."""
        ...

    def compute_logprobs(
        self, micro_batches: list[MicroBatch], *, temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        """Per-token log-probabilities of logits / temperature, [B, T] per micro-batch, no grad.

        `reference=True` uses the frozen reference model (only built when the
        config has a KL loss)."""
        ...

    def train_mini_batch(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        need_entropy: bool,
    ) -> dict[str, float]:
        """Forward and backward every micro-batch, then one optimizer step.

        Returns the summed loss metrics plus `grad_norm` and `lr`."""
        ...

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, on the publishing rank.

        Other ranks take part in any gathers and yield nothing."""
        ...

    def save(self, path: Path) -> None:
        """Model (Hugging Face safetensors + config) and optimizer state under `path`."""
        ...

    def stage_checkpoint(self, path: Path, *, staging: str = "host") -> Callable[[], None]:
        """Copy what `save` writes under `path` (to pinned host memory, or on the device:
        `streamrl.backends.staging`) and return the function that writes the copy, which
        may run in another thread while training goes on (`save` is both at once).

        On ranks > 0 the write runs in a thread of theirs; rank 0's returns once every
        rank's files are written. `staging = "reserve"` (every rank) only takes the host
        buffers of a `host` copy into the backend's staging pool, ahead of the first
        checkpoint; its function writes nothing."""
        ...

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...

    def offload_to_host(self, part: str) -> float:
        """Colocated mode (`learner.offload`): move `part` (`optimizer`: the optimizer's state,
        gradients dropped; `parameters`: the model's weights) to host memory, freeing the
        device (`streamrl.backends.offload`). Calls add up. Returns the seconds taken."""
        ...

    def reload_from_host(self) -> float:
        """Bring back everything `offload_to_host` moved out. Returns the seconds taken."""
        ...
