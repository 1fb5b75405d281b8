"""What one engine GPU holds: the weights, the KV cache, one prefill's work.

The embedded engine preallocates its KV cache (`engine.runner.kv_cache`: one slot of
`engine.max_seq_len` positions per sequence of `engine.max_batch_size`, plus a scratch
slot); the transformers runner (models the compact one cannot serve, e.g. GLM-4) grows a
cache up to the same size. SGLang claims `engine.mem_fraction_static` of the GPU for its
weights and KV pool, the pool taking whatever the weights leave (its own rule: the pool is
what remains of that fraction once the weights are loaded), and needs room outside it for
CUDA graphs and activations.
"""

from __future__ import annotations

import streamrl.planner.learner as learner_terms
from streamrl.backends.megatron.shapes import ModelShape

COMPACT_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""The families the embedded engine's compact runner serves (`engine.runner.compact_supports`);
`runner = "auto"` takes the transformers runner for the others."""
EMBEDDED_PREFILL_TOKENS = 32768
"""The embedded engine's prefill budget per step on CUDA (`EngineCore`, max_prefill_tokens 0)."""
SGLANG_RUNTIME_BYTES = 3 * 10**9
"""SGLang's use outside its static pool (CUDA graphs, a chunked prefill's activations, the
sampler): an estimate, to be measured."""


def weights(shape: ModelShape, *, tp_size: int, weight_bytes: float) -> int:
    """Every parameter at `weight_bytes` (2 in bf16, 1 with FP8), split over `tp_size` GPUs."""
    return int(shape.num_parameters() * weight_bytes / tp_size)


def kv_bytes_per_token(shape: ModelShape, *, tp_size: int, compute_bytes: int) -> float:
    """Keys and values of one token over every layer on one GPU: 2 L kv_heads head_dim c,
    the KV heads split over TP (replicated when there are fewer than GPUs); MLA caches one
    latent of kv_lora_rank + qk_rope_head_dim per layer."""
    if shape.mla is not None:
        return (
            shape.num_layers * (shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim) * compute_bytes
        )
    kv_heads = max(1, shape.num_kv_heads // tp_size)
    return 2 * shape.num_layers * kv_heads * shape.head_dim * compute_bytes


def is_compact(shape: ModelShape, runner: str) -> bool:
    """Whether the embedded engine serves `shape` with the compact runner."""
    return runner == "compact" or (runner == "auto" and shape.model_type in COMPACT_MODEL_TYPES)


def embedded_kv_cache(
    shape: ModelShape, *, max_batch_size: int, max_seq_len: int, compute_bytes: int, compact: bool
) -> int:
    """(max_batch_size + 1 scratch slot) x max_seq_len positions x `kv_bytes_per_token`
    (the transformers runner: max_batch_size rows at full length, no scratch slot)."""
    slots = max_batch_size + 1 if compact else max_batch_size
    per_token = kv_bytes_per_token(shape, tp_size=1, compute_bytes=compute_bytes)
    return int(slots * max_seq_len * per_token)


def prefill_activations(shape: ModelShape, *, tokens: int, compute_bytes: int) -> int:
    """One layer's live tensors during a prefill of `tokens` (nothing is kept for a backward):
    the hidden state and its norm, q, k, v and the attention output, gate|up and the MLP's
    product, c (3 h + 2 q + 2 kv + 3 f) per token."""
    query = shape.num_heads * shape.head_dim
    key_value = shape.num_kv_heads * shape.head_dim
    ffn = learner_terms.mlp_width(shape)
    per_token = 3 * shape.hidden_size + 2 * query + 2 * key_value + 3 * ffn
    return int(tokens * per_token * compute_bytes)


def decode_logits(shape: ModelShape, *, max_batch_size: int) -> int:
    """float32 logits and probabilities of one decode step: 2 x 4 bytes x batch x vocab."""
    return 8 * max_batch_size * shape.vocab_size


def sglang_kv_pool(
    shape: ModelShape, *, gpu_bytes: float, mem_fraction_static: float, weight_bytes: int
) -> int:
    """SGLang's KV pool on one GPU: mem_fraction_static x GPU memory less its weights (less
    than zero: SGLang does not start)."""
    return int(mem_fraction_static * gpu_bytes - weight_bytes)
