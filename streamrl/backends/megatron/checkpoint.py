"""Optimizer state files: one per rank, loadable only into the same TP/PP/DP layout.

The model itself is saved as Hugging Face safetensors by the backend (one
file per PP stage plus an index); what cannot live there is here: the Adam
moments, step counts and, in bf16, the fp32 master weights. A rank's file
holds each chained Megatron optimizer's `state_dict()` and, with the
distributed optimizer, its shard of parameter state
(`get_parameter_state_dp_reshardable`).

Two workarounds for megatron-core 0.16.1 with torch's AdamW (no Apex / TE):
`_mark_unpadded` and `_unshare_step_counters` (see their docstrings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_optimizer(optimizer: Any, path: Path) -> None:
    """Write this rank's optimizer state to `path`."""
    parts = _optimizers(optimizer)
    state: dict[str, Any] = {"optimizers": [opt.state_dict() for opt in parts]}
    if any(hasattr(opt, "get_parameter_state_dp_reshardable") for opt in parts):
        state["parameter_states"] = [opt.get_parameter_state_dp_reshardable() for opt in parts]
    torch.save(state, path)


@torch.no_grad()
def load_optimizer(optimizer: Any, path: Path, *, device: torch.device) -> None:
    """Restore what `save_optimizer` wrote (after the model weights are loaded)."""
    state = torch.load(path, weights_only=False, map_location=device)
    parts = _optimizers(optimizer)
    for opt, opt_state in zip(parts, state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
        _unshare_step_counters(opt)
    for opt, param_state in zip(parts, state.get("parameter_states", []), strict=False):
        _mark_unpadded(param_state)
        opt.load_parameter_state_from_dp_reshardable(param_state)


def _mark_unpadded(param_state: dict[Any, Any]) -> None:
    """The dp-reshardable getter omits the 'padding' flag its own loader reads."""
    for key, by_dtype in param_state.items():
        if not isinstance(key, int):
            continue
        for buckets in by_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)


def _unshare_step_counters(optimizer: Any) -> None:
    """Give every parameter its own Adam `step` tensor again.

    DistributedOptimizer.load_state_dict puts one shared `step` tensor into
    every parameter's state; torch's AdamW then increments it once per
    parameter per step, which corrupts bias correction after a resume."""
    inner = getattr(optimizer, "optimizer", None)
    for param_state in getattr(inner, "state", {}).values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = param_state["step"].clone()
