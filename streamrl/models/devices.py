"""Device and dtype names of the config (`engine.device`, `learner.dtype`, ...) as torch's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; anything else goes to ``torch.device``."""
    import torch

    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``"auto"`` is float32 on CPU and bfloat16 on CUDA; else a torch dtype name."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name in ("", "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return dtype
