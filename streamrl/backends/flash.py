"""Which flash-attention kernels the learner's own attention runs on CUDA.

torch bundles FlashAttention-2 kernels. On Hopper (SM 9.0) and Blackwell (SM 10.x) the
`flash-attn-4` package's kernels (CuTe DSL, compiled on first use and cached) are written
for the tensor cores those GPUs have. Measured on one H200 (bench/results/gpu/attention):
on a packed Qwen3-4B micro-batch (16 samples of 866..8,403 tokens, 32 heads, 8 key/value
groups) FlashAttention-4 ran causal attention forward and backward at 490 TFLOP/s against
torch's 289 (1.69x) and the 4B learner's step took 13% less time; on rows of 4,096 tokens
at 0.5B and 1.5B its calls were slower (0.78x, 0.74x: each call's host-side dispatch is
longer than the kernel's time there), and the RL step 6% slower at 0.5B, 2% faster at 1.5B.
Both are as accurate as each other against float32 attention. `learner.flash_attention`
picks, once per learner process (`choose`):

- `auto`: FlashAttention-4 for packed rows' variable-length attention where `flash_attn.cute`
  imports and the GPU is SM 9.0 or 10.x, torch's kernels for everything else;
- `torch`: torch's kernels always;
- `fa4`: FlashAttention-4 for both attentions below, refused at start where it cannot run.

Two attentions call it: the variable-length attention of packed rows in both backends
(`documents.py`) and the Megatron learner's core attention on right-padded rows
(`megatron/layers.py`). Both are causal, bf16 or fp16, one head size for query, key and
value, no dropout; anything else keeps torch's path. FlashAttention-4 takes grouped
key/value heads as they are (no repeat) and the same token-major layout as torch's
variable-length kernel. The Hugging Face models of the torch backend keep their own
attention on right-padded rows.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

SETTINGS = ("auto", "torch", "fa4")
FA4_MODULE = "flash_attn.cute"
"""The `flash-attn-4` package's interface (`flash_attn_func`, `flash_attn_varlen_func`)."""
FA4_ARCHS = (9, 10)
"""Compute capability majors FlashAttention-4 has kernels for (Hopper, Blackwell)."""

_STATE: dict[str, Any] = {"packed": False, "rows": False, "module": None}
"""Where FlashAttention-4 runs in this process (packed rows, right-padded rows), and its
module."""


def fa4_problem(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only (the learner is on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return f"it has kernels for SM 9.0 and 10.x only (this GPU is SM {major}.{minor})"
    try:
        importlib.import_module(FA4_MODULE)
    except Exception as exc:  # ImportError, or a broken CuTe DSL install
        return (
            f"`{FA4_MODULE}` does not import ({type(exc).__name__}: {exc}); "
            "`pip install flash-attn-4` installs it"
        )
    return None


def choose(setting: str, device: torch.device) -> str:
    """Pick this process's kernels for `learner.flash_attention = setting` on `device` and
    say which (`kernel`); `fa4` where it cannot run is a ValueError naming the key."""
    if setting not in SETTINGS:
        raise ValueError(f"learner.flash_attention = {setting!r} is not one of {SETTINGS}")
    problem = None if setting == "torch" else fa4_problem(device)
    if setting == "fa4" and problem:
        raise ValueError(f"learner.flash_attention = 'fa4', but FlashAttention-4 {problem}")
    usable = setting != "torch" and problem is None
    _STATE.update(
        packed=usable,
        rows=usable and setting == "fa4",
        module=importlib.import_module(FA4_MODULE) if usable else None,
    )
    if setting == "auto" and device.type == "cuda":
        log.info("causal attention: %s", kernel() + (f" ({problem})" if problem else ""))
    return kernel()


def kernel() -> str:
    """The kernels `choose` picked in this process: `torch` (until it runs), `fa4` or
    `fa4 for packed rows`."""
    if _STATE["rows"]:
        return "fa4"
    return "fa4 for packed rows" if _STATE["packed"] else "torch"


def fa4_serves(
    query: torch.Tensor, value: torch.Tensor, dropout: float = 0.0, *, packed: bool
) -> bool:
    """Whether FlashAttention-4 was chosen for this attention (`packed` rows' or right-padded
    rows') and takes these tensors (the module docstring's conditions)."""
    head = query.shape[-1]
    return (
        _STATE["packed" if packed else "rows"]
        and query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and head == value.shape[-1]
        and head % 8 == 0
        and 8 <= head <= 256
        and dropout == 0.0
    )


def fa4_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float | None
) -> torch.Tensor:
    """Causal attention of equal-length rows: query [B, S, heads, d], key/value
    [B, S, groups, d] -> [B, S, heads, d]."""
    return _output(
        _STATE["module"].flash_attn_func(query, key, value, softmax_scale=scale, causal=True)
    )


def fa4_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cumulative: torch.Tensor,
    longest: int,
    *,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention within each sequence of a flattened batch: query [T, heads, d],
    key/value [T, groups, d], `cumulative` the sequences' int32 boundaries [n + 1] ->
    [T, heads, d]."""
    result = _STATE["module"].flash_attn_varlen_func(
        query, key, value, cu_seqlens_q=cumulative, cu_seqlens_k=cumulative,
        max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scale, causal=True,
    )  # fmt: skip
    return _output(result)


def _output(result: Any) -> torch.Tensor:
    """The attention output of a FlashAttention-4 call (it also returns the log-sum-exp)."""
    return result[0] if isinstance(result, tuple) else result
