"""What the model builder and the converter need to know about an HF architecture.

`ModelShape` is the whole model; `MoEShape` (mixture-of-experts layers) and
`MLAShape` (multi-head latent attention) are present only for the families
that have them. `families.shape_from_hf` reads a transformers config into these.
Pure data: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a model (routing as transformers computes it).

    `layer_is_moe[i]` says whether layer i has experts; the others have a dense
    MLP of `ModelShape.ffn_hidden_size`."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    layer_is_moe: tuple[bool, ...]
    shared_ffn_hidden_size: int = 0  # 0 = no shared expert
    score_function: str = "softmax"  # "softmax" or "sigmoid"
    # softmax over all experts first, then top-k (no renormalisation); False = top-k of
    # the logits, then softmax over those k (the same as renormalised top-k probabilities).
    pre_softmax: bool = False
    expert_bias: bool = False  # DeepSeek's e_score_correction_bias, added for the choice only
    num_groups: int = 0  # group-limited routing: 0 = off
    group_top_k: int = 0
    scaling_factor: float = 1.0  # routed_scaling_factor
    router_fp32: bool = False  # the gate's matmul in float32 (DeepSeek-V3, GLM-4.5)
    grouped: bool = False  # Megatron side: all local experts in one GroupedExperts module

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layer_is_moe)


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: one query projection, no low-rank factorisation
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelShape:
    """One HF architecture, as conversion and the model builder see it."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    max_position_embeddings: int
    rotary_percent: float = 1.0  # fraction of each head's dims that RoPE rotates (GLM: 0.5)
    rotary_interleaved: bool = False  # RoPE on pairs (x0, x1), (x2, x3), ... (GLM-4)
    post_norms: bool = False  # GLM-4's RMSNorm after attention and after the MLP
    fused_gate_up: bool = False  # the checkpoint holds mlp.gate_up_proj (GLM-4)
    moe: MoEShape | None = None
    mla: MLAShape | None = None
    value_head: bool = False
    """A critic's body: the last stage's output layer is a scalar value head (`value_head.*`
    in the checkpoint), not the LM head."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layer_is_moe[layer]

    def _attention_parameters(self) -> int:
        hidden, heads = self.hidden_size, self.num_heads
        if self.mla is not None:
            mla = self.mla
            if mla.q_lora_rank is None:
                query = hidden * heads * mla.q_head_dim
            else:
                query = hidden * mla.q_lora_rank + mla.q_lora_rank * (heads * mla.q_head_dim + 1)
            kv = hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * (
                heads * (mla.qk_nope_head_dim + mla.v_head_dim) + 1
            )
            return query + kv + heads * mla.v_head_dim * hidden
        attention = hidden * self.head_dim * (2 * heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention

    def _layer_parameters(self, layer: int, *, active: bool) -> int:
        norms = (4 if self.post_norms else 2) * self.hidden_size
        if not self.is_moe_layer(layer):
            return (
                self._attention_parameters() + 3 * self.hidden_size * self.ffn_hidden_size + norms
            )
        moe = self.moe
        experts = moe.top_k if active else moe.num_experts
        mlp = (
            3
            * self.hidden_size
            * (experts * moe.expert_ffn_hidden_size + moe.shared_ffn_hidden_size)
        )
        router = moe.num_experts * self.hidden_size
        return self._attention_parameters() + mlp + router + norms

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameters of the HF model (tied embeddings counted once).

        `active=True` counts, in each MoE layer, only the `top_k` experts a token
        uses (the N of 6 N FLOPs per token)."""
        layers = sum(self._layer_parameters(i, active=active) for i in range(self.num_layers))
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return layers + embeddings + self.hidden_size
