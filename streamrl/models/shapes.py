"""Random model shapes: `random:<shape>` names one of `RANDOM_SHAPES`, a transformers
config whose weights are drawn from a seed (`streamrl.models.build_random_model`).

Tiny shapes (`*-tiny`) run every test and CPU benchmark; full-size ones are for the GPU
checks and keep their model's vocabulary (the logits' memory is part of what they measure).
Every shape uses SmolLM2's special token ids; the tiny ones SmolLM2's 49,152-token
vocabulary, so random ids decode to real text.
"""

from __future__ import annotations

from typing import Any

RANDOM_PREFIX = "random:"

# SmolLM2's tokenizer: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
_SMOLLM2_SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    # Wider than HF's 0.02 so random logits are peaked enough that greedy choices
    # are not decided by float rounding between two implementations.
    "initializer_range": 0.1,
    **_SMOLLM2_SPECIAL,
}

RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **_TINY,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "qwen2-tiny": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **_TINY,
        "tie_word_embeddings": False,  # Qwen2 always has q/k/v bias; untied head here
        "rope_theta": 1000000.0,
    },
    "qwen3-tiny": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **_TINY,
        "tie_word_embeddings": True,  # Qwen3 always has q/k RMSNorm
        "rope_theta": 1000000.0,
    },
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
    "qwen2-1.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        **_SMOLLM2_SPECIAL,
    },
}
# The families slime users train, tiny (hidden 64, 2 layers, 8 experts) for CPU tests.
# Intermediate sizes keep 2 * moe_intermediate_size != hidden_size, so a fused
# [experts, 2 * intermediate, hidden] tensor can never be mistaken for its transpose.
_TINY_MOE = {"moe_intermediate_size": 48, "num_experts_per_tok": 2, "norm_topk_prob": True}
RANDOM_SHAPES.update(
    {
        "glm4-tiny": {
            "model_type": "glm4",
            "architectures": ["Glm4ForCausalLM"],
            **_TINY,
            "tie_word_embeddings": False,
            "attention_bias": True,  # GLM-4: q/k/v bias, half-rotary (interleaved), sandwich norms
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
        },
        "qwen3-moe-tiny": {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            **_TINY,
            **_TINY_MOE,
            "num_experts": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
        "glm4-moe-tiny": {
            "model_type": "glm4_moe",
            "architectures": ["Glm4MoeForCausalLM"],
            **_TINY,
            **_TINY_MOE,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
        "deepseek-v3-tiny": {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            # MLA's head sizes are its own (head_dim is the RoPE part, set by the config).
            **{key: value for key, value in _TINY.items() if key != "head_dim"},
            **_TINY_MOE,
            "num_key_value_heads": 4,  # MLA: every head has its own key and value
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,  # group-limited routing: the best 1 of 2 groups, then top-2 in it
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "rope_interleave": True,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
        },
        # Full-size shapes for the GPU checks (bench/gpu/moe_check.py cuts their layers).
        "qwen3-30b-a3b": {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
        "deepseek-v3": {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "n_group": 8,
            "topk_group": 4,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_interleave": True,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            # DeepSeek-V3 itself uses YaRN (factor 40); plain RoPE here (see moe_check.py).
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
    }
)
# The dense models of a slime user's single-H200 runs (issue #27), at their real sizes: the
# fields of each model's published config.json (configs/models/<name>/config.json holds the
# same; tests/models/test_model_configs.py keeps the two equal), with SmolLM2's special ids.
# `random_model_dir` saves them in bfloat16 (`SAVED_IN_BF16`): 8, 16 and 19 GB on disk.
RANDOM_SHAPES.update(
    {
        "qwen3-4b": {  # Qwen/Qwen3-4B: 4.02B parameters, tied embeddings, q/k RMSNorm
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            **_SMOLLM2_SPECIAL,
        },
        "llama3-8b": {  # meta-llama/Meta-Llama-3-8B(-Instruct): 8.03B parameters
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
        # THUDM/GLM-4-9B-0414 (transformers' Glm4ForCausalLM; the first GLM-4-9B is the
        # remote-code ChatGLM architecture with the same sizes): 9.40B parameters, q/k/v
        # bias, half-rotary interleaved RoPE, sandwich norms, 2 KV heads.
        "glm4-9b": {
            "model_type": "glm4",
            "architectures": ["Glm4ForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 13696,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 151552,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "tie_word_embeddings": False,
            **_SMOLLM2_SPECIAL,
        },
    }
)
# Qwen2-0.5B's body with SmolLM2's 49,152-token vocabulary, so its text decodes with
# SmolLM2's tokenizer (the GPU runs with a text-based synthetic reward need real text).
RANDOM_SHAPES["qwen2-0.5b-smolvocab"] = {**RANDOM_SHAPES["qwen2-0.5b"], "vocab_size": 49152}


SAVED_IN_BF16 = frozenset({"qwen3-4b", "llama3-8b", "glm4-9b"})
"""The shapes `streamrl.models.random_model_dir` saves in bfloat16 unless asked otherwise:
in float32 they would fill most of a 64 GiB disk (16, 32 and 38 GB), and every engine and
learner loads them in bfloat16 anyway."""

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a random shape can be saved in."""


def saved_dtype(shape: str, dtype: str | None = None) -> str:
    """The dtype ``shape``'s random weights are saved in: ``dtype`` when given (float32,
    bfloat16, float16; bf16 and fp32 as aliases), else bfloat16 for `SAVED_IN_BF16` and
    float32 for every other shape."""
    if dtype is None:
        return "bfloat16" if shape in SAVED_IN_BF16 else "float32"
    name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for random weights: use one of {DTYPES}")
    return name


def random_config(shape: str):
    """The transformers config of a named random shape."""
    from transformers import AutoConfig

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    kwargs = dict(RANDOM_SHAPES[shape])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
