"""The critic of `algorithm.advantage_estimator = "gae"` on megatron-core: a value model in the
policy's layout (TP, PP, DP, sequence parallelism), with its own DDP and optimizer.

The value model is a GPTModel of the critic's starting model (`learner.critic.path`, or the
policy's initial model) whose last stage ends in a scalar `ValueHead` instead of the LM head
(`model.build_gpt_model(value_head=True)`); its weights convert like the policy's
(`convert`, with `ModelShape.value_head`). It runs through the policy backend's schedule,
data movement and metric reduction, so every learner rank takes part in the same order:

    compute_values:    rank 0's micro-batches ─► forward only ─► values [B, T] on rank 0
    train_mini_batch:  forward, value loss, backward ─► one optimizer step of the critic

Alignment (as the torch critic, `streamrl.backends.critic`): values[b, t] is V of the prefix
input_ids[b, :t], read from the hidden state at position t - 1, on trained positions only;
other positions hold 0.

Learning rate: `lr_at(update)`, the policy's schedule shape scaled to the critic's peak,
counted in the critic's own updates (saved with its optimizer).

Checkpoint (`save` / `load`, the policy checkpoint's `critic/`): body and head as Hugging
Face safetensors (`model.*` and `value_head.*`, one file per pipeline stage plus an index),
the model's config.json, and each rank's optimizer state. Such a directory is also a
starting model: `learner.critic.path` set to it continues that critic, head included (a
model without `value_head.*` starts with a zero head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from streamrl.backends.base import MicroBatch
from streamrl.backends.megatron import checkpoint, convert, export, rules
from streamrl.backends.megatron.model import build_gpt_model, learner_shape

ValueLossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro_batch, values [B, T] with grad) -> (loss, metrics), normalised like a LossFn."""


class MegatronCritic:
    """The value model, its DDP wrapper and optimizer, beside a `MegatronBackend` (`policy`)
    whose layout, devices and schedule it shares (see the module docstring)."""

    def __init__(
        self, policy: Any, model_path: str, *, lr_at: Callable[[int], float], seed: int = 0
    ) -> None:
        from transformers import AutoConfig

        self.policy = policy
        self.layout = policy.layout
        self.device = policy.device
        self.lr_at = lr_at
        self.num_updates = 0
        """Optimizer steps the critic took (its schedule's position; saved and restored)."""
        self.model_dir, self._model_dir_holder = convert.resolve_model_dir(model_path, seed=seed)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        options = policy.cfg.megatron
        self.shape = dataclasses.replace(learner_shape(hf_config, options), value_head=True)
        layout = self.layout
        with policy.megatron_context():
            self.model = build_gpt_model(
                hf_config,
                tp_size=layout.tp_size,
                pp_size=layout.pp_size,
                pp_rank=layout.pp_rank,
                dtype=policy.dtype,
                device=self.device,
                attention=options.attention,
                sequence_parallel=options.sequence_parallel,
                gradient_checkpointing=policy.cfg.gradient_checkpointing,
                options=options,
                value_head=True,
                compiled=policy.compiled,
                allow_transformer_engine=not policy.cfg.pack_sequences,
            )
            starting = StartingWeights(convert.HFCheckpoint(self.model_dir), self.shape)
            convert.load_into_model(self.model, starting, self.shape, **layout.shard)
            self.ddp, self.optimizer = policy.wrap_for_training(self.model)

    @torch.no_grad()
    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """[B, T] float32 CPU values per micro-batch on rank 0 (others get []), no grad."""
        everything, mine, work = self.policy.schedule.local_work(micro_batches)
        if not everything:
            return []

        def loss_for(micro_batch, weight, output):
            return output.new_zeros(()), {"values": aligned_values(output, micro_batch)}

        self.ddp.eval()
        try:
            with self.policy.megatron_context():
                store = self.policy.schedule.run(self.ddp, work, loss_for, forward_only=True)
        finally:
            self.ddp.train()
        local = [item["values"] for item in store][: len(mine)]
        return self.policy.schedule.collect_on_rank0(everything, mine, local)

    def train_mini_batch(
        self, micro_batches: list[MicroBatch], loss_fn: ValueLossFn
    ) -> dict[str, float]:
        """Forward and backward every micro-batch, then one optimizer step; summed metrics
        plus `grad_norm` and `lr`, complete on rank 0. The gradient is the sum over all
        micro-batches of all DP replicas, as the policy's (`MegatronBackend.train_mini_batch`)."""
        everything, _, work = self.policy.schedule.local_work(micro_batches)
        if not everything:
            return {}
        scale = len(work) * self.layout.dp_size

        def loss_for(micro_batch, weight, output):
            loss, metrics = loss_fn(micro_batch, aligned_values(output, micro_batch))
            metrics = {name: value.detach().float() * weight for name, value in metrics.items()}
            return loss * (weight * scale), metrics

        lr = self.lr_at(self.num_updates)
        metrics = self.policy.schedule.train(self.ddp, self.optimizer, work, loss_for, lr=lr)
        self.num_updates += 1
        return metrics

    # ------------------------------------------------------------ checkpoints

    def stage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This PP stage's full tensors under HF names (its publisher's to write), on the
        learner's device: a checkpoint's staging copies each as it comes."""
        return export.stage_hf_weights(self.model, self.shape, self.layout)

    def save(self, path: Path) -> None:
        """The critic's weights, config and per-rank optimizer state under `path`."""
        checkpoint.save_critic(self, path)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (in the same layout: the policy's load checks it)."""
        checkpoint.load_critic(self, path)


def aligned_values(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Values [B, T] from the head's output [B, T, 1]: position t holds V before token t (the
    head's score at t - 1), on the micro-batch's trained positions (`MicroBatch.predicted`);
    0 elsewhere."""
    scores = output[..., 0].float()
    shifted = torch.cat([scores.new_zeros(scores.shape[0], 1), scores[:, :-1]], dim=1)
    keep = torch.zeros_like(micro_batch.loss_mask, dtype=torch.bool)
    keep[:, 1:] = micro_batch.predicted()
    return torch.where(keep, shifted, 0.0)


class StartingWeights(Mapping[str, torch.Tensor]):
    """A model directory's tensors as a critic's starting weights: its own value head when it
    has one (a saved critic), else a zero head (the first values are 0)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], shape: Any) -> None:
        self.tensors = tensors
        weight, bias = rules.VALUE_HEAD
        self.head = {}
        if weight not in tensors:
            self.head = {weight: torch.zeros(1, shape.hidden_size), bias: torch.zeros(1)}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.head[name] if name in self.head else self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from self.head

    def __len__(self) -> int:
        return len(self.tensors) + len(self.head)
