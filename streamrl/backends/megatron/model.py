"""A megatron-core GPTModel built from a Hugging Face config (families: `families.py`).

Supported: GQA, RoPE with base and `linear` / `llama3` scaling, partial and
interleaved RoPE (GLM), tied or untied embeddings, q/k/v bias, per-head q/k
RMSNorm, GLM-4's sandwich norms (`PostNormRowParallelLinear`), SwiGLU,
mixture-of-experts layers (`moe.py`) and multi-head latent attention (`mla.py`).

Layer spec: Transformer Engine's when `transformer_engine` imports, otherwise
Megatron's local spec with its unfused core attention replaced by
`SdpaAttention` (PyTorch scaled_dot_product_attention, causal, GQA-aware);
`attention = "local"` keeps Megatron's unfused one. Padding is on the right,
so causal attention alone keeps real tokens from ever seeing padding; packed rows
(several samples in one row) add a document mask and per-sample RoPE positions
(`packing.py`), and keep the local spec (Transformer Engine's attention would not take
the document ids).

Dropout is 0 (Megatron defaults to 0.1): the learner's log-probabilities
must match the engine's. Norm weights are cast with the rest of the model,
so they stay in the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from streamrl.backends.megatron import packing
from streamrl.backends.megatron.families import (  # noqa: F401 - re-exported
    SUPPORTED_MODEL_TYPES,
    rope_parameters,
    shape_from_hf,
)
from streamrl.backends.megatron.layers import (
    LocalRMSNorm,
    SdpaAttention,
    ValueHead,
    post_norm_linear,
)
from streamrl.backends.megatron.memory import recompute_layers_problem
from streamrl.backends.megatron.shapes import ModelShape


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
    recompute_layers: int = 0,
    ep_size: int = 1,
    options: Any = None,
    hf_config: Any = None,
    compiled: bool = False,
) -> Any:
    """Megatron TransformerConfig for `shape` (dropout 0, no CUDA-extension fusions).

    `compiled` turns on Megatron's SwiGLU fusion, which it compiles with torch.compile (no
    extension needed): one kernel each way, and only the fc1 output kept for backward. MoE fields come from `moe.moe_config_kwargs` (`options`: the MegatronConfig);
    an MLA model gets an `MLATransformerConfig` (its RoPE read from `hf_config`)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from streamrl.backends.megatron.mla import mla_config_kwargs
    from streamrl.backends.megatron.moe import moe_config_kwargs

    on_cpu = not torch.cuda.is_available()
    recompute = {}
    if gradient_checkpointing:
        recompute = _recompute_kwargs(recompute_layers, shape.num_layers // pp_size)
    config_class, extra = TransformerConfig, {}
    if shape.mla is not None:
        config_class, extra = (
            MLATransformerConfig,
            mla_config_kwargs(shape, hf_config, tp_size=tp_size),
        )
    return config_class(
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
        qk_layernorm=shape.qk_norm or shape.mla is not None,
        rotary_interleaved=shape.rotary_interleaved,
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
        # The default (allgather) refuses variable lengths; MoE models choose their own.
        **{"moe_token_dispatcher_type": "alltoall"}
        | moe_config_kwargs(shape, options, ep_size=ep_size, tp_size=tp_size),
        bias_activation_fusion=compiled,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        **extra,
        **recompute,
    )


def _recompute_kwargs(layers: int, stage_layers: int) -> dict:
    """Megatron's full recompute: every layer (`uniform`, one a group), or the first `layers`
    of each stage (`block`; learner.megatron.recompute_layers)."""
    if problem := recompute_layers_problem(layers, stage_layers):
        raise ValueError(problem)
    if layers in (0, stage_layers):
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=layers)


_NORM_SLOTS = ("input_layernorm", "pre_mlp_layernorm")
_ATTENTION_NORM_SLOTS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _use_local_norms(layer: Any) -> None:
    """Every torch norm of a local-spec layer becomes `LocalRMSNorm` (sequence-parallel-able)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    submodules, attention = layer.submodules, layer.submodules.self_attention.submodules
    for owner, slots in ((submodules, _NORM_SLOTS), (attention, _ATTENTION_NORM_SLOTS)):
        for slot in slots:
            if getattr(owner, slot, None) is WrappedTorchNorm:
                setattr(owner, slot, LocalRMSNorm)


def _use_duplicated_down_projections(mla_submodules: Any) -> None:
    """MLA's q/kv down-projections as whole (TP-duplicated) linears, not column-parallel.

    megatron-core 0.16.1 bug with the local spec's ColumnParallelLinear there: the
    output is gathered over TP and split again in backward, so the gradient of the
    shared RoPE key (`k_pos_emb`, used by every head) keeps only this rank's heads'
    part (TP = 2 measured a 0.4% wrong grad norm). A duplicated linear under sequence
    parallelism takes MLA's other branch, which gathers `k_pos_emb` over the sequence
    and reduce-scatters its gradient: right. The weights are small (hidden x rank)."""
    from megatron.core.post_training.modelopt.layers import Linear

    mla_submodules.linear_q_down_proj = Linear
    mla_submodules.linear_kv_down_proj = Linear


def build_layer_spec(
    shape: ModelShape, *, attention: str, use_te: bool, config: Any, options: Any = None
) -> Any:
    """The GPTModel's layer spec: TE's when available (plain dense models only); else
    Megatron's local decoder block spec for this pipeline stage (one spec per layer, dense
    or MoE), with `LocalRMSNorm`, SDPA (or Megatron's unfused) core attention, GLM-4's
    post-norms and, when asked, the grouped-GEMM experts."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=shape.qk_norm
        )
    spec = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    spec.layer_norm = LocalRMSNorm
    for layer in {id(layer): layer for layer in spec.layer_specs}.values():
        submodules = layer.submodules
        _use_local_norms(layer)
        if attention == "sdpa":
            submodules.self_attention.submodules.core_attention = SdpaAttention
        if shape.mla is not None:
            _use_duplicated_down_projections(submodules.self_attention.submodules)
        if shape.post_norms:
            submodules.self_attention.submodules.linear_proj = post_norm_linear()
            submodules.mlp.submodules.linear_fc2 = post_norm_linear()
        if shape.moe is not None and shape.moe.grouped:
            from streamrl.backends.megatron.grouped_experts import use_grouped_experts

            use_grouped_experts(submodules.mlp)
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
    options: Any = None,
    allow_transformer_engine: bool = True,
    value_head: bool = False,
    compiled: bool = False,
) -> Any:
    """One pipeline stage of the GPTModel for `hf_config`, uninitialised, on `device`.

    `options` is the MegatronConfig (MoE keys; its expert_model_parallel_size must be the
    one Megatron's groups were built with). Load weights with `convert.load_into_model`.
    `allow_transformer_engine = False` keeps the local spec (LoRA's adapters hook its
    linears, which TE's spec fuses with the norms before them). `value_head = True` builds
    a critic's value model: the last stage ends in a `ValueHead`, embeddings untied (the
    shape to convert its weights with is `learner_shape(...)` with `value_head=True`).
    `compiled`: torch.compile'd fusions (`build_transformer_config`; `speed.use_compile`)."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel

    shape = learner_shape(hf_config, options)
    if value_head:
        shape = dataclasses.replace(shape, value_head=True)
    if shape.vocab_size % tp_size:
        raise ValueError(f"vocab size {shape.vocab_size} is not divisible by TP size {tp_size}")
    if shape.num_layers % pp_size:
        raise ValueError(f"{shape.num_layers} layers do not split evenly over {pp_size} stages")
    plain = shape.moe is None and shape.mla is None and not shape.post_norms
    use_te = (
        allow_transformer_engine
        and transformer_engine_available()
        and device.type == "cuda"
        and plain
    )
    # Megatron refuses to train MoE layers at TP > 1 without sequence parallelism.
    # MLA's duplicated down-projections (see build_layer_spec) are right only with it too.
    needs_sequence_parallel = shape.moe is not None or shape.mla is not None
    sequence_parallel = sequence_parallel or (needs_sequence_parallel and tp_size > 1)
    if shape.moe is not None:
        from streamrl.backends.megatron.moe import fix_megatron_without_transformer_engine

        fix_megatron_without_transformer_engine()
    if shape.mla is not None:
        from streamrl.backends.megatron.mla import fix_megatron_mla_without_transformer_engine

        fix_megatron_mla_without_transformer_engine()
    ep_size = getattr(options, "expert_model_parallel_size", 1) if options is not None else 1
    config = build_transformer_config(
        shape,
        tp_size=tp_size,
        pp_size=pp_size,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        gradient_checkpointing=gradient_checkpointing,
        recompute_layers=getattr(options, "recompute_layers", 0),
        ep_size=ep_size,
        options=options,
        hf_config=hf_config,
        compiled=compiled,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(
            shape, attention=attention, use_te=use_te, config=config, options=options
        ),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_percent=shape.rotary_percent,
        rotary_base=rope_parameters(hf_config)["rope_theta"],
    )
    if shape.mla is not None:
        # finalize_model_grads sums every `q_layernorm` gradient over TP when qk_layernorm is
        # set (right for per-head q/k norms); MLA's q_layernorm sees the whole compressed
        # query on every TP rank, so that sum would multiply its gradient by TP. Under
        # sequence parallelism its weight is marked `sequence_parallel`, which sums it.
        config.qk_layernorm = False
    else:
        inv_freq = rope_inv_freq(hf_config)
        if inv_freq is not None:
            model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    model = model.to(device=device, dtype=dtype)
    packing.install(model)  # RoPE by each sample's own positions when rows are packed
    if value_head and pp_rank == pp_size - 1:  # in place of the LM head GPTModel built
        model.output_layer = ValueHead(
            shape.hidden_size,
            sequence_parallel=config.sequence_parallel,
            dtype=dtype,
            device=device,
        )
    elif pp_rank == pp_size - 1:
        batch_major_logits(model.output_layer)
    return model


def batch_major_logits(output_layer: torch.nn.Module) -> None:
    """Have the output layer compute its logits batch-major ([B, S, V] in memory) and return
    them as the [S, B, V] view it always returned, so that GPTModel's
    `logits.transpose(0, 1).contiguous()` (its [B, S, V] result when no labels are given)
    is a view rather than a copy.

    That copy, and the backward's copy of the logits' gradient the other way, move the
    whole [tokens, vocabulary] tensor: 10 GB each at 32,768 tokens of Qwen2's 151,936 words,
    among a learner step's largest memory-bound kernels. Here the hidden states [S, B, H]
    (H of the order of a thousand, not V's hundred thousand) are made batch-major before
    the layer instead, which without sequence parallelism treats its input as rows whatever
    their order (a matmul; the backward's data and weight gradients alike). Values and the
    returned shape are unchanged; only strides differ. Under sequence parallelism the layer
    gathers its input along the sequence dimension, so it is left as it is then (checked
    at every call: Megatron's inference switches it). `output_layer.batch_major_logits =
    False` turns it off."""

    def before(module, args, kwargs):
        hidden = args[0] if args else None
        module.batch_major_now = (
            module.batch_major_logits
            and hidden is not None
            and hidden.dim() == 3
            and hidden.shape[1] > 1
            and not getattr(module, "sequence_parallel", False)
        )
        if not module.batch_major_now:
            return None
        return (hidden.transpose(0, 1).contiguous(), *args[1:]), kwargs

    def after(module, args, kwargs, output):
        if not module.batch_major_now:
            return None
        logits, bias = output
        return logits.transpose(0, 1), bias

    output_layer.batch_major_logits = True
    output_layer.register_forward_pre_hook(before, with_kwargs=True)
    output_layer.register_forward_hook(after, with_kwargs=True)


def padded_for_sequence_parallel(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """`input_ids` right-padded (token 0) to a multiple of TP under sequence parallelism.

    Sequence parallelism splits the sequence over TP ranks; causal attention keeps the
    real tokens from seeing the padding, and the loss drops the padded positions."""
    tp_size = config.tensor_model_parallel_size
    pad = -input_ids.shape[1] % tp_size if config.sequence_parallel else 0
    return F.pad(input_ids, (0, pad)) if pad else input_ids


def learner_shape(hf_config: Any, options: Any = None) -> ModelShape:
    """`shape_from_hf`, plus what the learner's options change in the Megatron layout
    (`moe_grouped_gemm`: one GroupedExperts tensor pair per layer instead of one MLP per expert)."""
    import dataclasses

    shape = shape_from_hf(hf_config)
    if shape.moe is not None and getattr(options, "moe_grouped_gemm", False):
        shape = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, grouped=True))
    return shape
