"""All local experts of an MoE layer as two grouped matmuls (`moe_grouped_gemm = true`).

Megatron's own grouped experts need Transformer Engine (`TEGroupedMLP`) or the
`grouped_gemm` package (`GroupedMLP`); without them it runs `SequentialMLP`,
one small matmul per expert. `GroupedExperts` takes the dispatcher's tokens
(sorted by local expert, `tokens_per_expert` of them each) and runs
`torch._grouped_mm` once for fc1 and once for fc2; where that fails (an
old torch, a shape its CUDA kernel refuses) it falls back to a loop over the
experts, once, with a warning.

Weights, per EP rank (E local experts, expert-TP rank r of T):
`fc1` `[E, 2 * ffn / T, hidden]` (each expert's rows are `[gate_r; up_r]`,
as a TP-sharded `linear_fc1`), `fc2` `[E, hidden, ffn / T]`. Like
SequentialMLP's expert linears, the fc2 output is a partial sum over expert-TP
(the dispatcher reduces it) and the parameters are marked `allreduce = False`
under expert parallelism (reduced over the expert-data-parallel group).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _grouped_mm(inputs: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows of `inputs` in group g times weights[g]^T ([G, out, in] weights)."""
    return torch._grouped_mm(inputs, weights.transpose(1, 2), offs=ends)


def _looped_mm(inputs: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    chunks = torch.split(inputs, counts)
    return torch.cat([chunk @ weight.t() for chunk, weight in zip(chunks, weights, strict=True)])


def _make_module_class() -> type:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):
        use_grouped_mm = True  # cleared (class-wide) after the first failure

        def __init__(
            self,
            num_local_experts: int,
            config: Any,
            submodules: Any = None,
            pg_collection: Any = None,
        ) -> None:
            super().__init__(config=config)
            tp_size = pg_collection.expt_tp.size()
            ffn = config.moe_ffn_hidden_size // tp_size
            dtype = config.params_dtype
            self.num_local_experts = num_local_experts
            self.fc1 = torch.nn.Parameter(
                torch.empty(num_local_experts, 2 * ffn, config.hidden_size, dtype=dtype)
            )
            self.fc2 = torch.nn.Parameter(
                torch.empty(num_local_experts, config.hidden_size, ffn, dtype=dtype)
            )
            expert_parallel = config.expert_model_parallel_size > 1
            for param, dim in ((self.fc1, 1), (self.fc2, 2)):
                if config.perform_initialization:
                    config.init_method(param.data)
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
                param.allreduce = not expert_parallel

        def _matmul(self, inputs, weights, counts, ends):
            if GroupedExperts.use_grouped_mm and hasattr(torch, "_grouped_mm"):
                try:
                    return _grouped_mm(inputs, weights, ends)
                except (RuntimeError, NotImplementedError) as error:
                    log.warning("torch._grouped_mm failed (%s); looping over experts", error)
                    GroupedExperts.use_grouped_mm = False
            return _looped_mm(inputs, weights, counts)

        def forward(
            self,
            hidden_states: torch.Tensor,
            tokens_per_expert: torch.Tensor,
            permuted_probs: torch.Tensor,
        ):
            counts = [int(count) for count in torch.as_tensor(tokens_per_expert).tolist()]
            ends = torch.tensor(counts, device=hidden_states.device).cumsum(0).to(torch.int32)
            gate, up = self._matmul(hidden_states, self.fc1, counts, ends).chunk(2, dim=-1)
            activated = F.silu(gate) * up
            dtype = activated.dtype
            activated = (activated * permuted_probs.unsqueeze(-1)).to(dtype)
            return self._matmul(activated, self.fc2, counts, ends), None

        def backward_dw(self) -> None:
            pass

    return GroupedExperts


_CLASS: type | None = None


def grouped_experts_class() -> type:
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_module_class()
    return _CLASS


def use_grouped_experts(mlp_spec: Any) -> None:
    """Put `GroupedExperts` into an MoE layer's MLP spec (a dense MLP spec is left alone)."""
    experts = getattr(mlp_spec.submodules, "experts", None)
    if experts is not None:
        experts.module = grouped_experts_class()
        experts.submodules = None
