"""`learner.backend = "torch"`: any Hugging Face causal LM, AdamW, one process.

fp32 on CPU, bf16 on CUDA (`learner.dtype`); an optional frozen reference
model for the KL loss; gradient checkpointing when configured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from streamrl import algorithms
from streamrl.backends.base import LossFn, MicroBatch
from streamrl.config import LearnerConfig

log = logging.getLogger(__name__)


class TorchBackend:
    def __init__(
        self,
        model_path: str,
        cfg: LearnerConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        need_reference: bool = False,
        reference_path: str | None = None,
        seed: int = 0,
    ) -> None:
        from streamrl.models import load_model

        if cfg.num_threads and device.type == "cpu":
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(seed)
        self.device = device
        self.model, self.tokenizer = load_model(
            model_path, device=str(device), dtype=dtype, seed=seed
        )
        self.model.train()
        self.model.config.use_cache = False
        for parameter in self.model.parameters():
            parameter.requires_grad_(True)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.reference = None
        if need_reference:
            self.reference, _ = load_model(
                reference_path or model_path, device=str(device), dtype=dtype, seed=seed
            )
            self.reference.eval().requires_grad_(False)
        self.grad_clip = cfg.grad_clip
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    @property
    def is_publisher(self) -> bool:
        return True

    def _forward(self, model, micro_batch: MicroBatch, temperature: float, need_entropy: bool):
        """Per-token logprobs (and entropy) on the trained positions only.

        The output head runs only on the hidden states that predict a trained token: the
        prompt and padding are most positions of a batch, and the vocabulary is large.
        Other positions hold 0, as the LearnerBackend layout says."""
        batch = micro_batch.to(self.device)
        hidden = model.get_decoder()(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        predicts = batch.loss_mask[:, 1:] > 0  # position p predicts token p + 1
        logits = model.get_output_embeddings()(hidden[:, :-1][predicts])
        targets = batch.input_ids[:, 1:][predicts]
        logprobs = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        logprobs[:, 1:][predicts] = algorithms.logprobs_of_rows(
            logits, targets, temperature=temperature
        )
        entropy = None
        if need_entropy:  # with its gradient: an entropy bonus trains through it
            entropy = torch.zeros_like(logprobs)
            entropy[:, 1:][predicts] = algorithms.entropy_of_rows(logits, temperature=temperature)
        return batch, logprobs, entropy

    @torch.no_grad()
    def compute_logprobs(
        self, micro_batches: list[MicroBatch], *, temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is built only when kl_loss_coef > 0")
        was_training = model.training
        model.eval()
        try:
            return [
                self._forward(model, mb, temperature, False)[1].float().cpu()
                for mb in micro_batches
            ]
        finally:
            model.train(was_training)

    def train_mini_batch(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        need_entropy: bool,
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for micro_batch in micro_batches:
            batch, logprobs, entropy = self._forward(
                self.model, micro_batch, temperature, need_entropy
            )
            loss, metrics = loss_fn(batch, logprobs, entropy)
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        sums["grad_norm"] = float(grad_norm)
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        return sums

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters under their Hugging Face names (a tied head appears once, as the embedding)."""
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach()

    def save(self, path: Path) -> None:
        """`path` becomes a Hugging Face model directory plus `optimizer.pt`."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file, device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        optimizer_state = torch.load(path / "optimizer.pt", map_location=self.device)
        self.optimizer.load_state_dict(optimizer_state)
