"""Multi-head latent attention (DeepSeek-V3) on megatron-core's `MLASelfAttention`.

HF -> Megatron names (local spec; one layer):

| transformers (`self_attn.`) | Megatron (`self_attention.`) | TP split |
| --- | --- | --- |
| `q_a_proj` [q_lora, hidden] | `linear_q_down_proj` | replicated (a whole linear on every TP rank) |
| `q_a_layernorm` | `q_layernorm` | replicated |
| `q_b_proj` [heads * (nope + rope), q_lora] | `linear_q_up_proj` | rows = heads |
| `q_proj` (no q LoRA) | `linear_q_proj` | rows = heads |
| `kv_a_proj_with_mqa` [kv_lora + rope, hidden] | `linear_kv_down_proj` | replicated |
| `kv_a_layernorm` | `kv_layernorm` | replicated |
| `kv_b_proj` [heads * (nope + v), kv_lora] | `linear_kv_up_proj` | rows = heads |
| `o_proj` | `linear_proj` | columns |

Both sides order a head's query as [nope, rope] and its kv up-projection as
[k_nope, v], so no tensor is permuted. The RoPE dims are stored as interleaved
pairs: transformers' `rope_interleave = True` and Megatron's MLA (which always
de-interleaves them before rotating) agree; `rope_interleave = False` is refused.

RoPE: plain (`rope_type = "default"`) or YaRN with transformers' parameters
(factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
mscale_all_dim); Megatron then scales the softmax by mscale(mscale_all_dim)^2
as DeepSeek does.
"""

from __future__ import annotations

from typing import Any

from streamrl.backends.megatron.families import rope_parameters
from streamrl.backends.megatron.shapes import ModelShape

# Megatron name suffix -> transformers name suffix, per layer.
MLA_NAMES = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
# The down-projections are whole linears on every TP rank (`model._use_duplicated_down_projections`).
REPLICATED_NAMES = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.kv_layernorm.weight",
)


def mla_megatron_names(shape: ModelShape) -> list[str]:
    """The MLA tensors of one layer that this shape has (q LoRA or a plain q projection)."""
    if shape.mla.q_lora_rank is None:
        skip = {"self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight"}
        skip.add("self_attention.linear_q_up_proj.weight")
    else:
        skip = {"self_attention.linear_q_proj.weight"}
    return [name for name in MLA_NAMES if name not in skip]


def mla_config_kwargs(shape: ModelShape, hf_config: Any, *, tp_size: int) -> dict:
    """MLATransformerConfig keyword arguments (beyond TransformerConfig's) for `shape`."""
    mla = shape.mla
    for name, size in (
        ("q_lora_rank", mla.q_lora_rank or 0),
        ("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim),
        ("num_attention_heads", shape.num_heads),
    ):
        if size % tp_size:
            raise ValueError(
                f"{shape.model_type}: {name} = {size} is not divisible by TP {tp_size}"
            )
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    kwargs = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=params["rope_theta"],
    )
    if rope_type == "default":
        # rotary_scaling_factor also enters the softmax scale via mscale(factor, mscale_all_dim):
        # 1.0 keeps that factor exactly 1.
        return {**kwargs, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    if rope_type != "yarn":
        raise NotImplementedError(f"{shape.model_type}: RoPE type {rope_type!r} with MLA")
    return {
        **kwargs,
        "rope_type": "yarn",
        "rotary_scaling_factor": float(params["factor"]),
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "beta_fast": float(params.get("beta_fast", 32.0)),
        "beta_slow": float(params.get("beta_slow", 1.0)),
        "mscale": float(params.get("mscale", 1.0)),
        "mscale_all_dim": float(params.get("mscale_all_dim", 0.0)),
    }


def fix_megatron_mla_without_transformer_engine() -> None:
    """megatron-core 0.16.1 bug: without Transformer Engine, `multi_latent_attention` still
    sets HAVE_TE = True (its TE imports resolve to MagicMock stand-ins), and
    `isinstance(self.linear_proj, TELinear)` then raises TypeError while building the layer.
    Tell it the truth."""
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except Exception:
        multi_latent_attention.HAVE_TE = False
