"""How a model fits a parallel layout: the divisibility rules of the Megatron learner and of
SGLang engines, and what the learner's weights, gradients and optimizer hold per GPU.

Pure arithmetic on a `ModelShape` (no torch): `streamrl check` runs `layout_problems`,
and tests/models/test_model_configs.py holds each shipped config of configs/slime/ under a GPU's
memory with `learner_bytes_per_gpu` and `engine_weight_bytes_per_gpu`.
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


def learner_bytes_per_gpu(shape: ModelShape, layout: Parallelism, *, reference: bool) -> int:
    """Bytes one learner GPU holds for the model, activations aside: bf16 weights (2 B per
    parameter) and float32 gradients (4 B) of its shard, plus the distributed optimizer's
    float32 master weights and Adam moments (12 B) split over the data-parallel ranks (the
    experts' over the expert-data-parallel ranks, dp / ep); with `reference` (a KL loss), a
    second bf16 copy of the weights. The shard is 1 / (tp * pp) of the dense parameters
    and 1 / (tp * pp * ep) of the experts'."""
    experts = expert_parameters(shape)
    dense = shape.num_parameters() - experts
    model_parallel = layout.tp * layout.pp
    dense_local = dense / model_parallel
    experts_local = experts / (model_parallel * layout.ep)
    local = dense_local + experts_local
    optimizer = 12 * (dense_local / layout.dp + experts_local / (layout.dp / layout.ep))
    total = 6 * local + optimizer + (2 * local if reference else 0)
    return int(total)


def engine_weight_bytes_per_gpu(shape: ModelShape, tp_size: int, *, bytes_per_weight: float) -> int:
    """The weights one GPU of an engine of `tp_size` GPUs holds (before its KV cache)."""
    return int(shape.num_parameters() * bytes_per_weight / tp_size)


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
