"""Mixture-of-experts on megatron-core: TransformerConfig fields and where experts live.

Routing is set so that Megatron's `TopKRouter` picks the experts transformers
picks and weights them the same way:

| transformers | Megatron |
| --- | --- |
| Qwen3-MoE: softmax, top-k, renormalise (`norm_topk_prob`) | top-k of the logits, softmax over them (`moe_router_pre_softmax = False`) |
| Qwen3-MoE without `norm_topk_prob` | softmax, then top-k (`pre_softmax = True`) |
| GLM-4.5 / DeepSeek-V3: sigmoid, + `e_score_correction_bias` for the choice, group top-k, renormalise, x `routed_scaling_factor`, float32 gate | `score_function = "sigmoid"`, `expert_bias` (buffer `mlp.router.expert_bias`), `num_groups` / `group_topk`, `topk_scaling_factor`, `moe_router_dtype = "fp32"` |

Expert e of a layer lives on EP rank `e // (E / EP)` as local expert
`e % (E / EP)` (Megatron's contiguous placement) and is split over expert-TP
(= TP) like a dense MLP. Dropless: no capacity factor, so every token reaches
every expert it chose.
"""

from __future__ import annotations

from typing import Any

from streamrl.backends.megatron.shapes import ModelShape


def moe_config_kwargs(shape: ModelShape, options: Any, *, ep_size: int, tp_size: int) -> dict:
    """TransformerConfig keyword arguments for `shape`'s MoE layers ({} for a dense model).

    `options` is a `MegatronConfig` (or anything with its `moe_*` fields)."""
    moe = shape.moe
    if moe is None:
        if ep_size > 1:
            raise ValueError(
                f"learner.megatron.expert_model_parallel_size = {ep_size} but "
                f"{shape.model_type} has no experts"
            )
        return {}
    if moe.num_experts % ep_size:
        raise ValueError(
            f"{moe.num_experts} experts do not split over "
            f"learner.megatron.expert_model_parallel_size = {ep_size}"
        )
    dispatcher = getattr(options, "moe_token_dispatcher", "alltoall")
    if dispatcher == "allgather" and ep_size > 1:
        # It all-gathers equal-sized token blocks: micro-batches of different lengths on the
        # EP ranks (the normal case: one DP replica's batch each) break its collectives.
        raise ValueError(
            "learner.megatron.moe_token_dispatcher = 'allgather' needs the same token count "
            "on every EP rank; use 'alltoall' with expert_model_parallel_size > 1"
        )
    aux = getattr(options, "moe_aux_loss_coeff", 0.0)
    z_loss = getattr(options, "moe_z_loss_coeff", 0.0)
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_topk=moe.top_k,
        moe_layer_freq=[int(flag) for flag in moe.layer_is_moe],
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=getattr(options, "moe_router_bias_update_rate", 0.0),
        moe_router_num_groups=moe.num_groups or None,
        moe_router_group_topk=moe.group_top_k or None,
        moe_router_topk_scaling_factor=moe.scaling_factor if moe.scaling_factor != 1.0 else None,
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z_loss or None,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,  # Megatron's GroupedMLP needs the grouped_gemm package
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=tp_size,
    )


def num_local_experts(shape: ModelShape, ep_size: int) -> int:
    return shape.moe.num_experts // ep_size


def local_expert_ids(shape: ModelShape, *, ep_rank: int, ep_size: int) -> range:
    """Global ids of the experts EP rank `ep_rank` holds, in local order."""
    count = num_local_experts(shape, ep_size)
    return range(ep_rank * count, (ep_rank + 1) * count)


def fix_megatron_without_transformer_engine() -> None:
    """megatron-core 0.16.1 bug: `moe_utils` defines `te_general_gemm` only when Transformer
    Engine imports, but `RouterGatingLinearFunction` reads it unconditionally, so every MoE
    router raises NameError without TE (on GPUs too). Define it as None (the torch path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
