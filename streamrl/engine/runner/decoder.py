"""The compact decoder for Llama, Qwen2 and Qwen3 checkpoints, on flat token batches.

One forward serves packed prefill and batched decode: ``tokens``/``positions``
are flat ``[T]``; an attention batch object (`batch.py`) writes each layer's new
keys/values into the KV cache and attends. Fused weights: q/k/v as one
``[(heads + 2 * kv_heads) * head_dim, hidden]`` matrix (+ bias for Qwen2),
gate/up as one ``[2 * intermediate, hidden]``. The head is the embedding
itself when tied (same storage). Numerics follow transformers: RMSNorm in
float32 then cast, residual adds in the model dtype, RoPE tables rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from streamrl.engine.runner import kernels
from streamrl.engine.runner.rope import UnsupportedModel, rope_table

COMPACT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelDims:
    architecture: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> ModelDims:
        """Read a transformers config; `UnsupportedModel` for anything this model lacks."""
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
        if architecture not in COMPACT_ARCHITECTURES:
            raise UnsupportedModel(f"{architecture} is not one of {COMPACT_ARCHITECTURES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not silu")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        if not is_qwen2 and (
            getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
        ):
            raise UnsupportedModel("attention/MLP biases outside Qwen2's q/k/v are not supported")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModel("sliding-window attention is not supported")
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(
            architecture=architecture,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2,
            qk_norm=architecture == "Qwen3ForCausalLM",
        )


def _weight(*shape: int, like: dict) -> nn.Parameter:
    """An uninitialised frozen parameter; ``like`` holds its device and dtype."""
    return nn.Parameter(torch.empty(shape, **like), requires_grad=False)


class CompactLayer(nn.Module):
    def __init__(self, dims: ModelDims, like: dict):
        super().__init__()
        qkv_rows = dims.q_size + 2 * dims.kv_size
        self.input_norm = _weight(dims.hidden, like=like)
        self.qkv = _weight(qkv_rows, dims.hidden, like=like)
        self.qkv_bias = _weight(qkv_rows, like=like) if dims.qkv_bias else None
        self.q_norm = _weight(dims.head_dim, like=like) if dims.qk_norm else None
        self.k_norm = _weight(dims.head_dim, like=like) if dims.qk_norm else None
        self.o_proj = _weight(dims.hidden, dims.q_size, like=like)
        self.post_norm = _weight(dims.hidden, like=like)
        self.gate_up = _weight(2 * dims.intermediate, dims.hidden, like=like)
        self.down = _weight(dims.hidden, dims.intermediate, like=like)


class CompactModel(nn.Module):
    """Parameters are created on ``device`` in ``dtype`` and filled by `weights.load_hf_weights`."""

    def __init__(self, config, *, max_positions: int, device, dtype):
        super().__init__()
        self.dims = dims = ModelDims.from_config(config)
        like = {"device": device, "dtype": dtype}
        self.embed = _weight(dims.vocab_size, dims.hidden, like=like)
        self.layers = nn.ModuleList(CompactLayer(dims, like) for _ in range(dims.num_layers))
        self.final_norm = _weight(dims.hidden, like=like)
        # Tied: the very same Parameter, so one in-place copy updates both.
        self.lm_head = (
            self.embed if dims.tied_embeddings else _weight(dims.vocab_size, dims.hidden, like=like)
        )
        # Angles in float32, rounded to the model dtype once (as transformers does).
        self.register_buffer(
            "rope",
            rope_table(config, dims.head_dim, max_positions, device, dtype),
            persistent=False,
        )
        self.ops = kernels.EAGER

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; ``batch`` does cache I/O and attention."""
        dims, ops = self.dims, self.ops
        hidden = F.embedding(tokens, self.embed)
        cos_sin = self.rope[positions]
        residual = hidden
        normed = ops.rms_norm(hidden, self.layers[0].input_norm, dims.rms_norm_eps)
        for index, layer in enumerate(self.layers):
            attended = self._attention(index, layer, normed, cos_sin, batch)
            normed, residual = ops.add_rms_norm(
                attended, residual, layer.post_norm, dims.rms_norm_eps
            )
            mlp_out = F.linear(ops.silu_mul(F.linear(normed, layer.gate_up)), layer.down)
            next_norm = (
                self.layers[index + 1].input_norm
                if index + 1 < dims.num_layers
                else self.final_norm
            )
            normed, residual = ops.add_rms_norm(mlp_out, residual, next_norm, dims.rms_norm_eps)
        return normed

    def _attention(self, index: int, layer: CompactLayer, x, cos_sin, batch) -> torch.Tensor:
        dims, ops = self.dims, self.ops
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)

        def rotate_and_store(keys, values, rows, queries) -> None:
            ops.rope_store(
                qkv, cos_sin, keys, values, rows, queries,
                layer.q_norm, layer.k_norm, dims.rms_norm_eps,
            )  # fmt: skip

        return F.linear(batch.attend(index, rotate_and_store, dims.num_heads), layer.o_proj)

    def logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """Logits [rows, vocab], float32 unless asked otherwise (the sampler upcasts as it
        reads); the matmul runs in the model dtype, as transformers does."""
        logits = F.linear(hidden, self.lm_head)
        return logits.float() if float32 else logits
