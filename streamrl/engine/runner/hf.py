"""The generic runner: any transformers causal LM, generated in waves.

A wave is one left-padded batch with a transformers ``DynamicCache``; our own
step loop (not ``model.generate``) samples with the engine's sampler, so
logprobs, versions, pause/abort and weight updates behave as in the compact
runner. New sequences wait until the current wave has no live row (rows of
finished sequences keep computing as padding; their results are dropped).

MoE models: forward pre-hooks on every `model.layers.<i>.mlp.experts` module see
the expert ids transformers' router chose (`top_k_index`, one row per token of
the flattened `[rows, width]` batch); for sequences that asked
(`return_routed_experts`) each fed token's `[layers, top_k]` ids (-1 for dense
layers) are appended to `Sequence.routed_experts` (a prefill replaces them).
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import torch

from streamrl import models
from streamrl.engine.runner import weights
from streamrl.engine.runner.base import Pending
from streamrl.engine.runner.sampling import SamplingTensors, make_sampling_tensors, sample
from streamrl.engine.runner.sequence import Sequence


class HFRunner(weights.InPlaceWeights):
    name = "hf"
    shares_prefill = False

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, max_prefill_tokens: int):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        # Every checkpoint name (tied names and per-expert MoE names included) -> a view of
        # the live tensor; the fused in-memory expert names are accepted too.
        self.targets = {
            name: (tensor, None, None) for name, tensor in models.checkpoint_views(model).items()
        }
        self.targets.update(
            (name, (tensor, None, None))
            for name, tensor in model.state_dict(keep_vars=True).items()
            if isinstance(tensor, torch.nn.Parameter)
        )
        self.rows: list[Sequence | None] = []  # the wave; None once a row is released
        # transformers 5.2x renamed `past_key_values` to `cache`; accept either.
        parameters = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self.extra_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self._routing = _RoutingCapture(model)
        self._clear_wave()

    def _clear_wave(self) -> None:
        self.rows = []
        self.cache = None
        self.attention_mask = None
        self.next_positions = None  # int64 [rows]: position of the token fed next
        self.last_tokens = None  # int64 [rows] on the device
        self.sampling_tensors = None
        self.use_filters = False

    def num_free_slots(self) -> int:
        return 0 if any(row is not None for row in self.rows) else self.max_batch_size

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.slot is not None and seq.slot < len(self.rows) and self.rows[seq.slot] is seq:
                self.rows[seq.slot] = None
            seq.slot = None
        if not any(row is not None for row in self.rows):
            self._clear_wave()

    def reset(self) -> None:
        for seq in self.rows:
            if seq is not None:
                seq.slot = None
        self._clear_wave()

    @torch.no_grad()
    def prefill(self, groups: list[list[Sequence]]) -> tuple[list[int], list[float]]:
        from transformers import DynamicCache

        if self.num_free_slots() == 0:
            raise ValueError("a wave is still running")
        seqs = [seq for group in groups for seq in group]
        width = max(seq.num_tokens for seq in seqs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        mask = torch.zeros(len(seqs), width, dtype=torch.int64)
        for row, seq in enumerate(seqs):
            seq.slot = row
            input_ids[row, width - seq.num_tokens :] = torch.tensor(seq.tokens)
            mask[row, width - seq.num_tokens :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        self.cache = DynamicCache(config=self.model.config)
        self._routing.start(seqs)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            **self.extra_kwargs,
        )
        for row, routed in self._routing.take(seqs, width):
            seqs[row].routed_experts = list(routed[width - seqs[row].num_tokens :])
        params = [seq.params for seq in seqs]
        counters = [seq.num_tokens for seq in seqs]
        self.sampling_tensors = make_sampling_tensors(
            params, [s.seed for s in seqs], counters, self.device
        )
        self.use_filters = SamplingTensors.needs_filters(params)
        tokens, logprobs = sample(
            out.logits[:, -1], self.sampling_tensors, use_filters=self.use_filters
        )
        self.rows = seqs
        self.attention_mask = mask
        self.next_positions = positions[:, -1] + 1
        self.last_tokens = tokens
        return tokens.tolist(), logprobs.tolist()

    @torch.no_grad()
    def launch_decode(self) -> Pending:
        rows = len(self.rows)
        ones = torch.ones(rows, 1, dtype=self.attention_mask.dtype, device=self.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        self._routing.start(self.rows)
        out = self.model(
            input_ids=self.last_tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.next_positions[:, None],
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            **self.extra_kwargs,
        )
        for row, routed in self._routing.take(self.rows, 1):
            self.rows[row].routed_experts.append(routed[0])
        self.sampling_tensors.counters = self.next_positions + 1
        tokens, logprobs = sample(
            out.logits[:, -1], self.sampling_tensors, use_filters=self.use_filters
        )
        self.next_positions = self.next_positions + 1
        self.last_tokens = tokens
        return Pending(seqs=list(self.rows), handle=(tokens, logprobs))

    def collect(self, pending: Pending) -> tuple[list[int], list[float]]:
        tokens, logprobs = pending.handle
        return tokens.tolist(), logprobs.tolist()


class _RoutingCapture:
    """The expert ids each MoE layer's router picked in the last forward (see module doc)."""

    _EXPERTS = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")

    def __init__(self, model) -> None:
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.top_k = getattr(config, "num_experts_per_tok", 0) or 0
        self.captured: dict[int, torch.Tensor] = {}
        self.is_on = False
        for name, module in model.named_modules():
            match = self._EXPERTS.search(name)
            if match and self.top_k:
                module.register_forward_pre_hook(self._hook(int(match.group(1))))

    def _hook(self, layer: int):
        def capture(module, args):
            if self.is_on and len(args) >= 2 and torch.is_tensor(args[1]):
                self.captured[layer] = args[1].detach()

        return capture

    def start(self, rows) -> None:
        """Capture in the next forward when one of its (live) rows asked for routed experts."""
        self.captured = {}
        self.is_on = any(
            seq is not None and seq.return_routed_experts and not seq.is_finished for seq in rows
        )

    def take(self, rows, width: int):
        """(row, int16 [width, layers, top_k]) for the rows that asked; -1 for dense layers."""
        if not self.is_on:
            return []
        self.is_on = False
        ids = np.full((len(rows) * width, self.num_layers, self.top_k), -1, dtype=np.int16)
        for layer, chosen in self.captured.items():
            ids[:, layer] = chosen.reshape(len(rows) * width, self.top_k).cpu().numpy()
        ids = ids.reshape(len(rows), width, self.num_layers, self.top_k)
        return [
            (row, ids[row])
            for row, seq in enumerate(rows)
            if seq is not None and seq.return_routed_experts and not seq.is_finished
        ]
