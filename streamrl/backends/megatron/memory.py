"""How a model splits over a parallel layout: the divisibility rules of the Megatron learner
and of SGLang engines, and which parameters are experts.

Pure arithmetic on a `ModelShape` (no torch): `streamrl check` runs `layout_problems`;
what each GPU then holds is `streamrl.planner`'s count (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.backends.megatron.shapes import ModelShape


@dataclass(frozen=True)
class Parallelism:
    """Learner parallelism: num_gpus = tp * pp * dp; EP ranks split the DP ranks."""

    num_gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """num_gpus / (tp * pp)."""
        return self.num_gpus // (self.tp * self.pp)


def expert_parameters(shape: ModelShape) -> int:
    """Parameters of the routed experts (3 matrices of hidden x expert_ffn each)."""
    if shape.moe is None:
        return 0
    per_expert = 3 * shape.hidden_size * shape.moe.expert_ffn_hidden_size
    return shape.moe.num_moe_layers * shape.moe.num_experts * per_expert


def recompute_layers_problem(layers: int, stage_layers: int) -> str | None:
    """Why `learner.megatron.recompute_layers = layers` cannot apply to pipeline stages of
    `stage_layers` layers (None: it can)."""
    if layers > stage_layers:
        return (
            f"learner.megatron.recompute_layers = {layers} is more than the {stage_layers} "
            f"layers of a pipeline stage; 0 recomputes every layer"
        )
    return None


def layout_problems(shape: ModelShape, layout: Parallelism, *, engine_tp_size: int) -> list[str]:
    """Why the Megatron learner or SGLang cannot split `shape` this way, by config key."""
    problems = []
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    name = shape.model_type
    if shape.mla is None:
        for what, size in (
            ("num_attention_heads", shape.num_heads),
            ("num_key_value_heads", shape.num_kv_heads),
        ):
            if size % tp:
                problems.append(
                    f"learner.megatron.tensor_parallel_size = {tp} does not divide {name}'s "
                    f"{what} = {size}"
                )
    else:
        mla = shape.mla
        for what, size in (
            ("num_attention_heads", shape.num_heads),
            ("q_lora_rank", mla.q_lora_rank or 0),
            ("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim),
        ):
            if size % tp:
                problems.append(
                    f"learner.megatron.tensor_parallel_size = {tp} does not divide {name}'s "
                    f"{what} = {size}"
                )
    if shape.vocab_size % tp:
        problems.append(
            f"learner.megatron.tensor_parallel_size = {tp} does not divide the vocabulary "
            f"({shape.vocab_size})"
        )
    if shape.num_layers % pp:
        problems.append(
            f"learner.megatron.pipeline_parallel_size = {pp} does not divide {name}'s "
            f"{shape.num_layers} layers (stages split them evenly)"
        )
    if ep > 1 and shape.moe is None:
        problems.append(
            f"learner.megatron.expert_model_parallel_size = {ep}: {name} has no experts"
        )
    if shape.moe is not None and shape.moe.num_experts % ep:
        problems.append(
            f"learner.megatron.expert_model_parallel_size = {ep} does not divide "
            f"{shape.moe.num_experts} experts"
        )
    if layout.num_gpus % (tp * pp) == 0 and layout.dp % ep:
        problems.append(
            f"learner.megatron.expert_model_parallel_size = {ep} does not divide the "
            f"data-parallel size {layout.dp}"
        )
    if shape.num_heads % engine_tp_size:
        problems.append(
            f"engine.tp_size = {engine_tp_size} does not divide {name}'s "
            f"{shape.num_heads} attention heads (SGLang splits them over its GPUs)"
        )
    return problems
