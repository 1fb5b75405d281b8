"""The critic of `algorithm.advantage_estimator = "gae"` in the torch backend: a value model
(a Hugging Face causal LM's body with a scalar head) with its own optimizer and schedule.

It trains inside the learner step, on the same micro-batches as the policy (see
`streamrl.backends.step`), so it adds compute to a step but never waits on anything.

Alignment (as `streamrl.backends.base`): values[b, t] is V of the prefix input_ids[b, :t],
the state in which token t was chosen, so it sits beside that token's logprob; it is
computed on the trained positions only, and other positions hold 0.

Precision: fp32 weights (the master copy), the forward under bf16 autocast when the
learner computes in bf16, as the policy (`streamrl.backends.torch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrl.backends.base import MicroBatch
from streamrl.backends.documents import model_inputs, use_document_attention
from streamrl.backends.staging import StagingPool

ValueLossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro_batch, values [B, T] with grad) -> (loss, metrics), normalised like a LossFn."""

WEIGHTS_FILE = "value_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class ValueModel(torch.nn.Module):
    """A causal LM's body (embeddings and decoder layers, no LM head) and a linear value head.

    The head starts at zero, so the first values are 0 whatever the body."""

    def __init__(self, body: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, inputs: dict[str, torch.Tensor], predicts: torch.Tensor):
        """Values [N] of the positions where `predicts` [B, T - 1] is True (see the module
        docstring: position p's hidden state gives V before token p + 1); `inputs` are the
        body's (`streamrl.backends.documents.model_inputs`: packed rows or padded ones)."""
        hidden = self.body(**inputs).last_hidden_state
        return self.head(hidden[:, :-1][predicts].float()).squeeze(-1).float()


class TorchCritic:
    """The value model, its AdamW optimizer and LR schedule (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        lr: float,
        lr_multiplier: Callable[[int], float] | None,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float,
        gradient_checkpointing: bool = False,
        pack_sequences: bool = False,
        seed: int = 0,
    ) -> None:
        """`pack_sequences`: attend inside each sample of packed rows
        (`streamrl.backends.documents`)."""
        from streamrl.models import load_causal_lm

        self.device = device
        self.dtype = dtype
        language_model = load_causal_lm(
            model_path, device=str(device), dtype=torch.float32, seed=seed
        )
        language_model.config.use_cache = False
        if pack_sequences:
            use_document_attention(language_model)
        if gradient_checkpointing:
            language_model.gradient_checkpointing_enable()
        body = language_model.get_decoder()
        self.model = ValueModel(body, language_model.config.hidden_size).to(device)
        del language_model
        self.model.train()
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier or (lambda step: 1.0)
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _values(self, micro_batch: MicroBatch) -> tuple[MicroBatch, torch.Tensor]:
        batch = micro_batch.to(self.device)
        predicts = batch.predicted()
        values = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with self._autocast():
            values[:, 1:][predicts] = self.model(model_inputs(batch), predicts)
        return batch, values

    @torch.no_grad()
    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """[B, T] float32 CPU values per micro-batch (0 off the trained positions), no grad."""
        self.model.eval()
        try:
            return [self._values(mb)[1].cpu() for mb in micro_batches]
        finally:
            self.model.train()

    def train_mini_batch(
        self, micro_batches: list[MicroBatch], loss_fn: ValueLossFn
    ) -> dict[str, float]:
        """Forward and backward every micro-batch, then one optimizer step; summed metrics
        plus `grad_norm` and `lr`."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for micro_batch in micro_batches:
            batch, values = self._values(micro_batch)
            loss, metrics = loss_fn(batch, values)
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        sums["grad_norm"] = float(grad_norm)
        return sums

    def save(self, path: Path) -> None:
        """Weights (safetensors), optimizer and schedule state under `path` (a directory)."""
        self.stage_checkpoint(path)()

    def stage_checkpoint(
        self, path: Path, *, staging: str = "host", pool: StagingPool | None = None
    ) -> Callable[[], None]:
        """Copy what `save` writes and return the function that writes the copy (as
        `TorchBackend.stage_checkpoint`; `pool`: the policy's, whose `critic` buffers the
        copy reuses)."""
        from streamrl.backends import staging as staging_

        staged = staging_.stage(
            {
                "weights": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            },
            to=staging,
            pool=pool,
            part="critic",
        )
        if staging == staging_.Staging.RESERVE:
            return lambda: None

        def write() -> None:
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            with staged.host() as state:
                weights = {k: v.contiguous() for k, v in state["weights"].items()}
                save_file(weights, path / WEIGHTS_FILE)
                torch.save(
                    {"optimizer": state["optimizer"], "scheduler": state["scheduler"]},
                    path / OPTIMIZER_FILE,
                )

        return write

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        from safetensors.torch import load_file

        if not (path / WEIGHTS_FILE).exists():
            raise FileNotFoundError(
                f"{path}: no critic checkpoint ({WEIGHTS_FILE}); was this run trained without "
                "algorithm.advantage_estimator = 'gae'?"
            )
        self.model.load_state_dict(load_file(path / WEIGHTS_FILE, device=str(self.device)))
        state: dict[str, Any] = torch.load(path / OPTIMIZER_FILE, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
