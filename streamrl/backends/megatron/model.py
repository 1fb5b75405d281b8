"""A megatron-core GPTModel built from a Hugging Face config (Llama, Qwen2, Qwen3).

Supported: GQA, RoPE with base and `linear` / `llama3` scaling, tied or
untied embeddings, Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm, SwiGLU.

Layer spec: Transformer Engine's when `transformer_engine` imports, otherwise
Megatron's local spec with its unfused core attention replaced by
`SdpaAttention` (PyTorch scaled_dot_product_attention, causal, GQA-aware);
`attention = "local"` keeps Megatron's unfused one. Padding is on the right,
so causal attention alone keeps real tokens from ever seeing padding.

Dropout is 0 (Megatron defaults to 0.1): the learner's log-probabilities
must match the engine's. Norm weights are cast with the rest of the model,
so they stay in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelShape:
    """What conversion and the model builder need to know about an HF architecture."""

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

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


def shape_from_hf(hf_config: Any) -> ModelShape:
    """Read a transformers config (Llama / Qwen2 / Qwen3) into a ModelShape."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"megatron backend supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError(f"{model_type} with mlp_bias = true is not supported")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type != "qwen2" and attention_bias:
        # HF puts a bias on o_proj too; Megatron's add_bias_linear would add MLP biases as well.
        raise NotImplementedError(f"{model_type} with attention_bias = true is not supported")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return ModelShape(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
    )


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x) as one dict."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_inv_freq(hf_config: Any) -> torch.Tensor | None:
    """Inverse frequencies for a scaled RoPE (None for the plain one Megatron computes itself).

    Uses transformers' own RoPE initialisers so the learner matches the engine
    exactly; rope types whose attention factor is not 1 or that change with
    sequence length (yarn, dynamic, longrope) are refused."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return None
    if rope_type not in ("linear", "llama3"):
        raise NotImplementedError(
            f"RoPE type {rope_type!r} is not supported by the megatron backend"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if attention_factor != 1.0:
        raise NotImplementedError(f"RoPE {rope_type!r} with attention factor {attention_factor}")
    return inv_freq.float()


class SdpaAttention(torch.nn.Module):
    """Megatron core attention through torch SDPA: causal, GQA via `enable_gqa`.

    query [sq, b, heads, d], key/value [sk, b, groups, d] -> [sq, b, heads * d].
    The attention mask argument is ignored: padding is on the right and the
    mask is causal. Packed sequences are refused."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        if config.context_parallel_size != 1:
            raise NotImplementedError("SdpaAttention does not support context parallelism")
        self.config = config
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SdpaAttention takes neither packed sequences nor a bias")
        seq_len, batch, num_heads, head_dim = query.shape
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=key.shape[2] != num_heads,
        )
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, num_heads * head_dim)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_transformer_config(
    shape: ModelShape,
    *,
    tp_size: int,
    pp_size: int,
    dtype: torch.dtype,
    sequence_parallel: bool = False,
    gradient_checkpointing: bool = False,
) -> Any:
    """Megatron TransformerConfig for `shape` (dropout 0, no CUDA-extension fusions)."""
    from megatron.core.transformer import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    recompute = {}
    if gradient_checkpointing:
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        # Weights are overwritten from the HF checkpoint, but Megatron only marks
        # tensor-parallel weights (`tensor_model_parallel`, which grad-norm and
        # checkpointing read) inside its initialisers: keep them on.
        perform_initialization=True,
        # Micro-batches differ in length: pipeline stages exchange shapes first.
        variable_seq_lengths=pp_size > 1,
        moe_token_dispatcher_type="alltoall",  # the default one refuses variable lengths
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        **recompute,
    )


def build_layer_spec(shape: ModelShape, *, attention: str, use_te: bool) -> Any:
    """TE spec when available; else the local spec with SDPA (or Megatron's unfused) attention."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=shape.qk_norm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def build_gpt_model(
    hf_config: Any,
    *,
    tp_size: int,
    pp_size: int,
    pp_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    attention: str = "sdpa",
    sequence_parallel: bool = False,
    gradient_checkpointing: bool = False,
) -> Any:
    """One pipeline stage of the GPTModel for `hf_config`, uninitialised, on `device`.

    Load weights with `convert.load_hf_into_model`."""
    from megatron.core.models.gpt import GPTModel

    shape = shape_from_hf(hf_config)
    if shape.vocab_size % tp_size:
        raise ValueError(f"vocab size {shape.vocab_size} is not divisible by TP size {tp_size}")
    if shape.num_layers % pp_size:
        raise ValueError(f"{shape.num_layers} layers do not split evenly over {pp_size} stages")
    use_te = transformer_engine_available() and device.type == "cuda"
    if sequence_parallel and tp_size > 1 and not use_te:
        raise NotImplementedError(
            "sequence_parallel needs Transformer Engine (the local norms refuse it)"
        )
    config = build_transformer_config(
        shape,
        tp_size=tp_size,
        pp_size=pp_size,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        gradient_checkpointing=gradient_checkpointing,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(shape, attention=attention, use_te=use_te),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_parameters(hf_config)["rope_theta"],
    )
    inv_freq = rope_inv_freq(hf_config)
    if inv_freq is not None:
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    return model.to(device=device, dtype=dtype)
