"""Which Megatron tensor is made of which Hugging Face tensors: one `Rule` per tensor of a
pipeline stage (`stage_rules`), with the kind of split that joins them (`kind`: replicated,
column, row, fused QKV, fused gate/up, stacked experts).

A PP stage holds layers `[pp_rank * L/pp, (pp_rank + 1) * L/pp)` under local indices 0..;
HF names always carry global indices. With tied embeddings and PP > 1 the last stage holds
a copy of the embedding as `output_layer.weight` (exported by no one: the first stage
exports `embed_tokens`: `is_exported`). Transformer Engine's spec fuses the two norms into
the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
`te_name` maps the local names onto those. `streamrl.backends.megatron.convert` moves the
tensors by these rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamrl.backends.megatron.shapes import ModelShape

REPLICATED, COLUMN, ROW, QKV, GATE_UP = "replicated", "column", "row", "qkv", "gate_up"
VALUE_HEAD = ("value_head.weight", "value_head.bias")
"""The HF names of a value model's head (`ModelShape.value_head`)."""
GATE_UP_FUSED = "gate_up_fused"  # one HF tensor [gate; up] (GLM-4's mlp.gate_up_proj)
# GroupedExperts' stacked tensors: HF sources (gate, up) * experts, or down * experts.
EXPERTS_GATE_UP, EXPERTS_ROW = "experts_gate_up", "experts_row"


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of.

    `expert` is the global id of the routed expert the tensor belongs to (None for
    everything else): such tensors live on one EP rank and split over expert-TP."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: int | None = None


def _mlp_rules(shape: ModelShape, megatron: str, hf: str, expert: int | None = None) -> list[Rule]:
    """A SwiGLU MLP: `megatron`.linear_fc1/linear_fc2 from `hf`.gate_proj/up_proj/down_proj."""
    if shape.fused_gate_up and expert is None:
        fc1 = Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.gate_up_proj.weight",), GATE_UP_FUSED)
    else:
        sources = (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")
        fc1 = Rule(f"{megatron}.linear_fc1.weight", sources, GATE_UP, expert)
    return [fc1, Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), ROW, expert)]


def _attention_rules(shape: ModelShape) -> list[Rule]:
    attn = "self_attn"
    if shape.mla is not None:
        from streamrl.backends.megatron.mla import MLA_NAMES, REPLICATED_NAMES, mla_megatron_names

        rules = [
            Rule(name, (MLA_NAMES[name],), REPLICATED if name in REPLICATED_NAMES else COLUMN)
            for name in mla_megatron_names(shape)
        ]
        return [*rules, Rule("self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), ROW)]
    rules = [
        Rule(
            "self_attention.linear_qkv.weight",
            tuple(f"{attn}.{p}_proj.weight" for p in "qkv"),
            QKV,
        ),
        Rule("self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), ROW),
    ]
    if shape.qkv_bias:
        rules.append(
            Rule(
                "self_attention.linear_qkv.bias",
                tuple(f"{attn}.{p}_proj.bias" for p in "qkv"),
                QKV,
            )
        )
    if shape.qk_norm:
        rules.append(
            Rule("self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), REPLICATED)
        )
        rules.append(
            Rule("self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), REPLICATED)
        )
    return rules


def _layer_rules(shape: ModelShape, layer: int, *, experts: range) -> list[Rule]:
    """One layer's tensors (Megatron names relative to the layer, HF names to `model.layers.i`)."""
    rules = [
        Rule("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
        *_attention_rules(shape),
        Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED),
    ]
    if shape.post_norms:
        rules.append(
            Rule(
                "self_attention.linear_proj.post_norm.weight",
                ("post_self_attn_layernorm.weight",),
                REPLICATED,
            )
        )
        rules.append(
            Rule("mlp.linear_fc2.post_norm.weight", ("post_mlp_layernorm.weight",), REPLICATED)
        )
    if not shape.is_moe_layer(layer):
        return rules + _mlp_rules(shape, "mlp", "mlp")
    rules.append(Rule("mlp.router.weight", ("mlp.gate.weight",), REPLICATED))
    if shape.moe.expert_bias:
        rules.append(
            Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), REPLICATED)
        )
    if shape.moe.shared_ffn_hidden_size:
        rules += _mlp_rules(shape, "mlp.shared_experts", "mlp.shared_experts")
    if shape.moe.grouped and len(experts):
        gate_up = tuple(f"mlp.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up"))
        down = tuple(f"mlp.experts.{e}.down_proj.weight" for e in experts)
        rules.append(Rule("mlp.experts.fc1", gate_up, EXPERTS_GATE_UP, experts[0]))
        rules.append(Rule("mlp.experts.fc2", down, EXPERTS_ROW, experts[0]))
        return rules
    for local, expert in enumerate(experts):
        rules += _mlp_rules(
            shape, f"mlp.experts.local_experts.{local}", f"mlp.experts.{expert}", expert
        )
    return rules


def stage_rules(
    shape: ModelShape, *, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> list[Rule]:
    """Every Megatron tensor of one (PP stage, EP rank) (local names) with its HF sources (global names)."""
    from streamrl.backends.megatron.moe import local_expert_ids

    layers_per_stage = shape.num_layers // pp_size
    first = pp_rank * layers_per_stage
    experts = local_expert_ids(shape, ep_rank=ep_rank, ep_size=ep_size) if shape.moe else range(0)
    rules = []
    if pp_rank == 0:
        rules.append(
            Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COLUMN)
        )
    for local in range(layers_per_stage):
        for rule in _layer_rules(shape, first + local, experts=experts):
            rules.append(
                Rule(
                    f"decoder.layers.{local}.{rule.megatron}",
                    tuple(f"model.layers.{first + local}.{name}" for name in rule.hf),
                    rule.kind,
                    rule.expert,
                )
            )
    if pp_rank == pp_size - 1:
        rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
        if shape.value_head:
            weight, bias = VALUE_HEAD
            rules.append(Rule("output_layer.weight", (weight,), REPLICATED))
            rules.append(Rule("output_layer.bias", (bias,), REPLICATED))
        elif not shape.tied_embeddings:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), COLUMN))
        elif pp_size > 1:
            rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), COLUMN))
    return rules


def is_exported(rule: Rule, shape: ModelShape, *, pp_size: int) -> bool:
    """False for the last stage's copy of tied embeddings (the first stage exports them)."""
    is_embedding_copy = shape.tied_embeddings and not shape.value_head and pp_size > 1
    return not (is_embedding_copy and rule.megatron == "output_layer.weight")


_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def te_name(local_name: str) -> str:
    """The Transformer Engine spec's name for a local-spec parameter name."""
    match = re.fullmatch(r"(decoder\.layers\.\d+\.)(.*)", local_name)
    if match and match.group(2) in _TE_NAMES:
        return match.group(1) + _TE_NAMES[match.group(2)]
    return local_name
