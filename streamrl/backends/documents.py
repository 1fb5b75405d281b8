"""Attention inside each sample of a packed row: causal, on every sample alone.

A packed row (`MicroBatch.position_ids`) holds several samples back to back. A dense
block-diagonal mask makes a row of S tokens cost S^2 of attention whatever its samples
(transformers' own sdpa and eager attentions build that mask from per-sample position ids:
2.5 times the right-padded rows' time for a tiny model's forward and backward on the CPU).
`attend_within_samples` attends within each sample's span alone, so a row costs the sum of
its samples' squares and every sample is computed as in a row of its own:

- on CUDA (bf16 or fp16, one head size for query, key and value, no dropout), one
  variable-length flash-attention call over every span of the micro-batch
  (`torch.nn.attention.varlen`, or FlashAttention-4 where `learner.flash_attention` chose
  it: `flash.py`): no mask, no compile, one kernel per layer whatever the number of
  samples;
- elsewhere (the CPU, float32, MLA's narrower value heads), SDPA on each span, one call per
  sample and layer.

(FlexAttention with a document BlockMask was the first CUDA path: on the H200 a Qwen3-4B
learner's first step had not ended minutes after its batch arrived, still compiling in
TorchInductor: bench/results/gpu/fullsize_async4b/README.md.)

The torch backend registers `document_attention` with transformers' `AttentionInterface`
under `ATTENTION` (`use_document_attention`). transformers skips its mask builder for an
attention it does not know, so the mask passed there is None and the position ids arrive
with the layer's keyword arguments; rows without them (right-padded) run one causal SDPA,
since with padding on the right causality alone keeps real tokens from it. The megatron
backend calls `attend_within_samples` on the CPU (`megatron/packing.py`).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from streamrl.backends import flash
from streamrl.backends.base import MicroBatch

log = logging.getLogger(__name__)

ATTENTION = "streamrl_documents"
"""The name `use_document_attention` sets as a model's attention implementation."""

Spans = list[list[tuple[int, int]]]
"""Per row, (start, end) of each sample."""

_SPANS: dict[str, Any] = {}


def sample_spans(starts: torch.Tensor, *, key: torch.Tensor) -> Spans:
    """Per row of `starts` ([B, S] bool, True where a sample begins; column 0 always
    begins one), the samples' spans. Computed once per forward: every layer passes the same
    `key` tensor, which is kept with the spans so that a later tensor cannot alias it."""
    cached = _SPANS.get("entry")
    if cached is not None and cached[0] is key:
        return cached[1]
    width = starts.shape[1]
    spans = []
    for row in starts.cpu().tolist():
        edges = [0] + [column for column in range(1, width) if row[column]] + [width]
        spans.append(list(itertools.pairwise(edges)))
    _SPANS["entry"] = (key, spans)
    return spans


def attend_within_samples(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: Spans,
    *,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each span: query [B, heads, S, d], key/value [B, groups, S, d]
    (GQA: query head j reads group j // (heads / groups)) -> [B, heads, S, d_v]. One
    variable-length flash-attention call where it applies, else SDPA per span (the module
    docstring)."""
    if dropout == 0.0:
        for kernel in _varlen_kernels(query, value):
            try:
                context = _attend_varlen(query, key, value, spans, scale=scale, kernel=kernel)
            except (RuntimeError, TypeError) as exc:  # a kernel that refuses this input
                _BROKEN[kernel] = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "%s's variable-length attention failed (%s); packed rows do without it "
                    "from now on",
                    VARLEN_KERNELS[kernel],
                    _BROKEN[kernel],
                )
                continue
            if kernel not in _ANNOUNCED:
                _ANNOUNCED.add(kernel)
                log.info("packed rows attend through %s", VARLEN_KERNELS[kernel])
            return context
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for row, row_spans in enumerate(spans):
        parts = [
            F.scaled_dot_product_attention(
                query[row : row + 1, :, start:end],
                key[row : row + 1, :, start:end],
                value[row : row + 1, :, start:end],
                dropout_p=dropout,
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
            for start, end in row_spans
        ]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


_VARLEN: dict[str, Any] = {}
VARLEN_KERNELS = {"fa4": "FlashAttention-4", "torch": "torch.nn.attention.varlen"}
_BROKEN: dict[str, str] = {}  # kernel -> the failure that put it out of use
_ANNOUNCED: set[str] = set()  # kernels whose first use is logged


def _varlen_function() -> Any:
    """torch's `varlen_attn` with how to ask it for causal attention and GQA (its keywords
    changed between releases), or None where this torch lacks it."""
    if "function" not in _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _VARLEN["function"] = varlen_attn
        if varlen_attn is not None:
            parameters = inspect.signature(varlen_attn).parameters
            causal = {"window_size": (-1, 0)} if "window_size" in parameters else {}
            if not causal and "is_causal" in parameters:
                causal = {"is_causal": True}
            _VARLEN["causal"] = causal
            _VARLEN["gqa"] = "enable_gqa" in parameters
            if not causal:
                _VARLEN["function"] = None
        if _VARLEN["function"] is None:
            log.info("this torch has no usable torch.nn.attention.varlen")
    return _VARLEN["function"]


def _varlen_kernels(query: torch.Tensor, value: torch.Tensor) -> list[str]:
    """The variable-length kernels that serve these tensors, in the order they are tried
    (the module docstring's conditions): FlashAttention-4 where `learner.flash_attention`
    chose it, then torch's; one that failed once is left out."""
    serves = {
        "fa4": flash.fa4_serves(query, value, packed=True),
        "torch": _torch_varlen_serves(query, value),
    }
    return [kernel for kernel, ok in serves.items() if ok and kernel not in _BROKEN]


def _torch_varlen_serves(query: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and query.shape[-1] == value.shape[-1] <= 256
        and _varlen_function() is not None
    )


def _attend_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: Spans,
    *,
    scale: float | None,
    kernel: str,
) -> torch.Tensor:
    """Every span of every row as one sequence of `kernel`'s variable-length attention."""
    batch, heads, width, _ = query.shape
    cumulative, longest = _boundaries(spans, width, query.device)

    def tokens(tensor: torch.Tensor) -> torch.Tensor:  # [B, h, S, d] -> [B x S, h, d]
        return tensor.transpose(1, 2).reshape(batch * width, tensor.shape[1], tensor.shape[3])

    key, value = tokens(key), tokens(value)
    if kernel == "fa4":
        context = flash.fa4_varlen(tokens(query), key, value, cumulative, longest, scale=scale)
        return context.reshape(batch, width, heads, -1).transpose(1, 2)
    gqa = key.shape[1] != heads
    options = dict(_VARLEN["causal"])
    if gqa and _VARLEN["gqa"]:
        options["enable_gqa"] = True
    elif gqa:  # a torch without the keyword: each group repeated for its query heads
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    context = _varlen_function()(
        tokens(query), key, value, cumulative, cumulative, longest, longest, scale=scale,
        **options,
    )  # fmt: skip
    return context.reshape(batch, width, heads, -1).transpose(1, 2)


def _boundaries(spans: Spans, width: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The spans' cumulative ends in the flattened micro-batch (int32 on `device`) and the
    longest span: made once per micro-batch, for every layer (a host-to-device copy per
    layer would wait for the GPU each time)."""
    cached = _VARLEN.get("boundaries")
    if cached is not None and cached[0] is spans and cached[1] == width:
        return cached[2], cached[3]
    ends = [row * width + end for row, row_spans in enumerate(spans) for _, end in row_spans]
    longest = max(end - start for row_spans in spans for start, end in row_spans)
    cumulative = torch.tensor([0, *ends], dtype=torch.int32).to(device, non_blocking=True)
    _VARLEN["boundaries"] = (spans, width, cumulative, longest)
    return cumulative, longest


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, heads, S, d], key/value [B, groups, S, d]
    -> ([B, S, heads, d], no weights); causal inside each sample (the module docstring)."""
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION} takes per-sample position ids, not an attention mask")
    for option in ("sliding_window", "softcap"):
        if unused.get(option) is not None:
            raise NotImplementedError(
                f"this model's attention has a {option}, which learner.pack_sequences' "
                "attention does not apply: set learner.pack_sequences = false"
            )
    dropout = dropout if module.training else 0.0
    if position_ids is None or query.shape[2] == 1:
        context = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=query.shape[2] > 1, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )  # fmt: skip
        return context.transpose(1, 2).contiguous(), None
    spans = sample_spans(position_ids == 0, key=position_ids)
    if len(spans) != query.shape[0]:  # position ids shared by every row
        spans = spans * query.shape[0]
    context = attend_within_samples(query, key, value, spans, scale=scaling, dropout=dropout)
    return context.transpose(1, 2).contiguous(), None


def model_inputs(batch: MicroBatch) -> dict[str, torch.Tensor]:
    """A Hugging Face decoder's keyword inputs for a micro-batch: the padding mask of
    right-padded rows; for packed rows the per-sample position ids and no 2D mask: RoPE sees
    each sample from position 0, and `document_attention` (installed with
    learner.pack_sequences) keeps each sample to itself. (transformers' own attentions would
    too, from the same position ids, through a dense block-diagonal mask.)"""
    if batch.position_ids is None:
        return {
            "input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "use_cache": False,
        }  # fmt: skip
    # No cache: with one, transformers would not look for packed samples in the positions.
    return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}


def use_document_attention(model: torch.nn.Module) -> None:
    """Make `document_attention` the attention of a Hugging Face model (and its submodels)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, document_attention)
    model.set_attn_implementation(ATTENTION)
