"""The modules streamrl puts into megatron-core's GPTModel (`model.py` builds it): SDPA core
attention for the local spec, a torch RMSNorm that takes sequence parallelism, GLM-4's
post-norm row-parallel linear, and the critic's scalar value head."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from streamrl.backends import flash


class SdpaAttention(torch.nn.Module):
    """Megatron core attention through torch SDPA: causal, GQA via `enable_gqa`; through
    FlashAttention-4 where `learner.flash_attention` chose it (`streamrl.backends.flash`).

    query [sq, b, heads, d], key/value [sk, b, groups, d] -> [sq, b, heads * d].
    The attention mask argument is None for right-padded rows (padding is on the right
    and the mask is causal), or packed rows' document ids [b, s] int32, which keep each
    token inside its own sample (`packing.document_attention`). Megatron's
    `packed_seq_params` (the THD layout) are refused: streamrl packs in the [s, b] layout."""

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
        k_channels: int | None = None,  # MLA: query/key and value head sizes differ
        v_channels: int | None = None,
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
        seq_len, batch, num_heads, _ = query.shape
        if attention_mask is not None:
            return self._packed(query, key, value, attention_mask)
        dropout = self.dropout if self.training else 0.0
        if flash.fa4_serves(query, value, dropout, packed=False):
            context = flash.fa4_causal(
                query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                scale=self.softmax_scale,
            )  # fmt: skip
            return context.transpose(0, 1).reshape(seq_len, batch, num_heads * value.shape[-1])
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            is_causal=True,
            dropout_p=dropout,
            scale=self.softmax_scale,
            enable_gqa=key.shape[2] != num_heads,
        )
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, num_heads * value.shape[-1])

    def _packed(self, query, key, value, documents: torch.Tensor) -> torch.Tensor:
        from streamrl.backends.megatron.packing import document_attention

        if self.dropout > 0 and self.training:
            raise NotImplementedError("packed rows take no attention dropout")
        seq_len, batch, num_heads, _ = query.shape
        context = document_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            documents,
            scale=self.softmax_scale,
        )
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, num_heads * value.shape[-1])


class ValueHead(torch.nn.Module):
    """A critic's scalar head in GPTModel's `output_layer` slot: hidden [s, b, h] -> values
    [s, b, 1] in float32, called as GPTModel calls its LM head (it returns (output, None)).

    Replicated on every TP rank: each rank computes the same values and the whole loss, so
    the gradient reaching the (replicated) hidden states is whole on every rank, as the body
    expects. Under sequence parallelism a rank holds s / TP positions: it scores those and
    gathers the values, whose backward keeps its own slice, and the head's weights are marked
    `sequence_parallel` so finalize_model_grads sums their gradients over TP. Starts at zero,
    so the first values are 0 (as the torch critic's)."""

    def __init__(
        self, hidden_size: int, *, sequence_parallel: bool, dtype: torch.dtype, device: Any
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        for param in (self.weight, self.bias):
            param.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, **unused: Any):
        values = F.linear(hidden_states.float(), self.weight.float(), self.bias.float())
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm for the local spec, also under sequence parallelism.

    Megatron's `WrappedTorchNorm` refuses `sequence_parallel`; this one marks its
    weight `sequence_parallel` instead, so `finalize_model_grads` sums the
    weight's gradient over TP ranks (each rank saw only its part of the sequence)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def post_norm_linear() -> type:
    """RowParallelLinear followed by an RMSNorm of its (all-reduced) output: GLM-4's
    `post_self_attn_layernorm` / `post_mlp_layernorm`, as `linear_proj.post_norm` /
    `linear_fc2.post_norm`. Megatron's layer adds the residual after it."""
    from megatron.core.tensor_parallel import RowParallelLinear

    class PostNormRowParallelLinear(RowParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = LocalRMSNorm(config, output_size, eps=config.layernorm_epsilon)

        def forward(self, input_: torch.Tensor):
            output, bias = super().forward(input_)
            return self.post_norm(output), bias

    return PostNormRowParallelLinear
