"""Transformers configs -> `ModelShape`, one reader per model family.

Supported `model_type`s: llama, qwen2, qwen3 (dense); glm4 (dense, GLM-4-0414:
half-rotary interleaved RoPE, q/k/v bias, sandwich norms); qwen3_moe; glm4_moe
(GLM-4.5: sigmoid router with a correction bias, shared expert, dense first
layers); deepseek_v3 (multi-head latent attention plus GLM-4.5's kind of MoE).
Everything else, and every option of these families that the Megatron model
would compute differently from transformers, is refused with the config field
that makes it so.
"""

from __future__ import annotations

from typing import Any

from streamrl.backends.megatron.shapes import MLAShape, ModelShape, MoEShape

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "glm4",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x) as one dict."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _refuse(hf_config: Any, field: str, why: str) -> None:
    raise NotImplementedError(
        f"{hf_config.model_type}: {field} = {getattr(hf_config, field, None)!r} {why}"
    )


def _base(hf_config: Any, **overrides: Any) -> ModelShape:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    fields = dict(
        model_type=hf_config.model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=False,
        qk_norm=False,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
    )
    fields.update(overrides)
    return ModelShape(**fields)


def _partial_rotary(hf_config: Any) -> float:
    params = rope_parameters(hf_config)
    return float(
        params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    )


def _dense(hf_config: Any) -> ModelShape:
    model_type = hf_config.model_type
    if getattr(hf_config, "mlp_bias", False):
        _refuse(hf_config, "mlp_bias", "is not supported")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type in ("llama", "qwen3") and attention_bias:
        # HF puts a bias on o_proj too; Megatron's add_bias_linear would add MLP biases as well.
        _refuse(hf_config, "attention_bias", "is not supported")
    if model_type == "glm4":
        return _base(
            hf_config,
            qkv_bias=attention_bias,  # GLM-4 has no o_proj bias, whatever attention_bias says
            rotary_percent=_partial_rotary(hf_config),
            rotary_interleaved=True,
            post_norms=True,
            fused_gate_up=True,
        )
    return _base(hf_config, qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


def _qwen3_moe(hf_config: Any) -> ModelShape:
    if getattr(hf_config, "attention_bias", False):
        _refuse(hf_config, "attention_bias", "is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        _refuse(hf_config, "use_sliding_window", "is not supported")
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    pattern = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0
        for i in range(hf_config.num_hidden_layers)
    )
    moe = MoEShape(
        num_experts=num_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_ffn_hidden_size=hf_config.moe_intermediate_size,
        layer_is_moe=pattern,
        score_function="softmax",
        pre_softmax=not hf_config.norm_topk_prob,
    )
    return _base(hf_config, qk_norm=True, moe=moe)


def _sigmoid_moe(hf_config: Any) -> MoEShape:
    """GLM-4.5 / DeepSeek-V3 routing: sigmoid scores, correction bias, groups, scaling."""
    if not hf_config.norm_topk_prob:
        # Megatron's sigmoid router always renormalises the chosen k scores.
        _refuse(hf_config, "norm_topk_prob", "(sigmoid routing without renormalisation)")
    top_k, num_groups = hf_config.num_experts_per_tok, hf_config.n_group or 1
    group_top_k = hf_config.topk_group or 1
    if num_groups > 1 and top_k // group_top_k != 2:
        # transformers scores a group by its top-2 experts; Megatron by its top (k / groups chosen).
        _refuse(
            hf_config, "topk_group", f"with num_experts_per_tok = {top_k}: k / topk_group must be 2"
        )
    first_dense = hf_config.first_k_dense_replace or 0
    num_shared = getattr(hf_config, "n_shared_experts", 0) or 0
    return MoEShape(
        num_experts=hf_config.n_routed_experts,
        top_k=top_k,
        expert_ffn_hidden_size=hf_config.moe_intermediate_size,
        layer_is_moe=tuple(i >= first_dense for i in range(hf_config.num_hidden_layers)),
        shared_ffn_hidden_size=num_shared * hf_config.moe_intermediate_size,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=num_groups if num_groups > 1 else 0,
        group_top_k=group_top_k if num_groups > 1 else 0,
        scaling_factor=float(hf_config.routed_scaling_factor),
        router_fp32=True,
    )


def _glm4_moe(hf_config: Any) -> ModelShape:
    return _base(
        hf_config,
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
        rotary_percent=_partial_rotary(hf_config),
        moe=_sigmoid_moe(hf_config),
    )


def _deepseek_v3(hf_config: Any) -> ModelShape:
    if getattr(hf_config, "attention_bias", False):
        _refuse(hf_config, "attention_bias", "is not supported")
    if not getattr(hf_config, "rope_interleave", True):
        # Megatron's MLA always reads the RoPE dims as interleaved pairs.
        _refuse(hf_config, "rope_interleave", "(Megatron's MLA expects interleaved RoPE weights)")
    mla = MLAShape(
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
    )
    return _base(
        hf_config,
        num_kv_heads=hf_config.num_attention_heads,
        head_dim=mla.q_head_dim,
        moe=_sigmoid_moe(hf_config),
        mla=mla,
    )


_READERS = {
    "llama": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "glm4": _dense,
    "qwen3_moe": _qwen3_moe,
    "glm4_moe": _glm4_moe,
    "deepseek_v3": _deepseek_v3,
}


def shape_from_hf(hf_config: Any) -> ModelShape:
    """Read a transformers config of a supported family into a ModelShape."""
    model_type = hf_config.model_type
    if model_type not in _READERS:
        raise NotImplementedError(
            f"megatron backend supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        _refuse(hf_config, "hidden_act", "is not supported (SwiGLU only)")
    return _READERS[model_type](hf_config)
