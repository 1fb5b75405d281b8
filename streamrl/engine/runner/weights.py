"""Hugging Face parameter names onto the compact model's (fused) parameters.

One loader serves the initial load and every `update_weights`: each HF name
maps to a row range of one compact parameter (q/k/v into ``qkv``, gate/up
into ``gate_up``), and tensors are copied in place into that storage, so
captured CUDA graphs keep pointing at valid weights and a tied head (the same
Parameter as the embedding) follows the embedding. A batch is validated
entirely (names and shapes) before the first copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from streamrl.engine.runner import adapters
from streamrl.engine.runner.decoder import CompactModel
from streamrl.weights.adapters import split_adapters

# Buffers some checkpoints carry that the compact model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_weight_targets(model: CompactModel) -> dict[str, tuple[torch.Tensor, int, int]]:
    """``{hf_name: (parameter, first_row, end_row)}`` for every HF tensor the model holds."""
    dims = model.dims
    q, kv, inter = dims.q_size, dims.kv_size, dims.intermediate
    targets: dict[str, tuple[torch.Tensor, int, int]] = {
        "model.embed_tokens.weight": (model.embed, 0, dims.vocab_size),
        "model.norm.weight": (model.final_norm, 0, dims.hidden),
        # Tied models map the head onto the embedding: same storage, same values.
        "lm_head.weight": (model.lm_head, 0, dims.vocab_size),
    }
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for name, (start, end) in rows.items():
            targets[f"{prefix}self_attn.{name}.weight"] = (layer.qkv, start, end)
            if layer.qkv_bias is not None:
                targets[f"{prefix}self_attn.{name}.bias"] = (layer.qkv_bias, start, end)
        targets[f"{prefix}self_attn.o_proj.weight"] = (layer.o_proj, 0, dims.hidden)
        if layer.q_norm is not None:
            targets[f"{prefix}self_attn.q_norm.weight"] = (layer.q_norm, 0, dims.head_dim)
            targets[f"{prefix}self_attn.k_norm.weight"] = (layer.k_norm, 0, dims.head_dim)
        targets[f"{prefix}mlp.gate_proj.weight"] = (layer.gate_up, 0, inter)
        targets[f"{prefix}mlp.up_proj.weight"] = (layer.gate_up, inter, 2 * inter)
        targets[f"{prefix}mlp.down_proj.weight"] = (layer.down, 0, dims.hidden)
        targets[f"{prefix}input_layernorm.weight"] = (layer.input_norm, 0, dims.hidden)
        targets[f"{prefix}post_attention_layernorm.weight"] = (layer.post_norm, 0, dims.hidden)
    return targets


def plan_copies(targets: dict, tensors: Iterable[tuple[str, torch.Tensor]]):
    """Validate every (name, tensor); return ``[(destination view, source)]``.

    Raises ValueError naming the first unknown name or wrong shape; nothing is
    copied by this function.
    """
    plan = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in targets:
            raise ValueError(f"unknown weight name {name!r}")
        parameter, start, end = targets[name]
        destination = parameter.data[start:end]
        if tuple(tensor.shape) != tuple(destination.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
            )
        plan.append((destination, tensor))
    return plan


@torch.no_grad()
def copy_planned(plan) -> None:
    """Copy each source into its destination view (dtype/device converted, in place), all in
    one `_foreach_copy_`: on a GPU a few kernel launches for the whole update rather than
    one per tensor (the 290 tensors of the 0.5B shape), while generation stands still."""
    if plan:
        destinations, sources = zip(*plan, strict=True)
        torch._foreach_copy_(list(destinations), list(sources), non_blocking=True)


def missing_names(targets: dict, names: Iterable[str], *, tied: bool) -> list[str]:
    """HF names the model needs that ``names`` lacks (a tied head needs no lm_head)."""
    present = set(names)
    optional = {"lm_head.weight"} if tied else set()
    return sorted(set(targets) - present - optional)


class InPlaceWeights:
    """Runner mixin: plan copies of Hugging Face tensors onto `self.targets`, then apply them
    in place (the engine thread calls `load_weights` between steps). LoRA adapter pairs in
    an update are merged into the kept base weights (`streamrl.engine.runner.adapters`)."""

    def plan_weights(self, tensors) -> list:
        full, pairs = split_adapters(tensors)
        plan: list = plan_copies(self.targets, full)
        replaced = [name for name, _ in full if name in self.adapter_bases]
        if replaced:
            plan.append(adapters.ForgetBase(replaced))
        return plan + adapters.plan_merges(self.targets, pairs)

    @property
    def adapter_bases(self) -> dict[str, torch.Tensor]:
        """HF weight name -> its base weight, for every module an adapter was merged into."""
        if not hasattr(self, "_adapter_bases"):
            self._adapter_bases: dict[str, torch.Tensor] = {}
        return self._adapter_bases

    @torch.no_grad()
    def load_weights(self, plan: list) -> None:
        copy_planned([entry for entry in plan if isinstance(entry, tuple)])
        for entry in plan:
            if not isinstance(entry, tuple):
                entry.apply(self.adapter_bases)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
