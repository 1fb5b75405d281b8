"""Model runners of the embedded engine, and the choice between them.

- ``compact`` (`compact.CompactRunner` over `decoder.CompactModel`): our own decoder for Llama,
  Qwen2 and Qwen3 with a per-slot KV cache, continuous batching and, on CUDA,
  FlashAttention-2 and CUDA-graph decode steps.
- ``hf`` (`hf.HFRunner`): any transformers causal LM, in waves.
``auto`` picks compact whenever the config is one it supports.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

RUNNER_NAMES = ("auto", "compact", "hf")


def compact_supports(config) -> str:
    """Empty when the compact runner can serve ``config``, else the reason it cannot."""
    from streamrl.engine.runner.decoder import ModelDims
    from streamrl.engine.runner.rope import UnsupportedModel, inverse_frequencies

    try:
        dims = ModelDims.from_config(config)
        inverse_frequencies(config, dims.head_dim)
    except UnsupportedModel as error:
        return str(error)
    return ""


def build_runner(
    model_path: str,
    *,
    runner: str,
    device: torch.device,
    dtype: torch.dtype,
    max_batch_size: int,
    max_seq_len: int,
    max_prefill_tokens: int,
    cuda_graphs: bool,
    compile_elementwise: bool,
    seed: int,
):
    """``(runner, config)`` for a model path; weights come from `models.load_causal_lm`."""
    from streamrl import models

    if runner not in RUNNER_NAMES:
        raise ValueError(f"runner {runner!r} is not one of {RUNNER_NAMES}")
    config = models.model_config(model_path)
    reason = compact_supports(config)
    if runner == "compact" and reason:
        raise ValueError(f"the compact runner cannot serve {model_path}: {reason}")
    if runner == "hf" or (runner == "auto" and reason):
        from streamrl.engine.runner.hf import HFRunner

        if reason:
            logger.info("using the transformers runner: %s", reason)
        model = models.load_causal_lm(model_path, device=device, dtype=dtype, seed=seed)
        model.requires_grad_(False)
        return HFRunner(
            model,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_prefill_tokens=max_prefill_tokens,
        ), model.config

    from streamrl.engine.runner.compact import CompactRunner

    def compact(state_dict) -> CompactRunner:
        return CompactRunner(
            config,
            state_dict,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_prefill_tokens=max_prefill_tokens,
            cuda_graphs=cuda_graphs,
            compile_elementwise=compile_elementwise,
        )

    # The compact model takes checkpoint tensors: straight from the files where it can
    # (no transformers model built: seconds less at every engine start).
    saved = models.read_checkpoint(model_path)
    if saved is not None:
        try:
            return compact(saved), config
        except ValueError as error:  # names it does not know: let transformers map them
            logger.info("loading %s through transformers: %s", model_path, error)
        del saved
    source = models.load_causal_lm(model_path, device="cpu", dtype=torch.float32, seed=seed)
    state_dict = source.state_dict()
    del source
    return compact(state_dict), config
