"""LoRA for the torch backend, through peft: adapters in, adapters out.

`add_adapters` wraps a Hugging Face model in peft's `PeftModel` with one LoRA adapter
("default") on every `learner.lora.target_modules` linear: the base weights are frozen (and
kept in the compute dtype), the adapters are float32 and the only trainable parameters.
`wire_tensors` is what the publisher sends (`streamrl.weights.adapters`: lora_B already
scaled); `save_adapter` / `load_adapter` write and read peft's adapter directory, which is
the whole model part of a LoRA checkpoint.

The KL reference is the base itself: `PeftModel.disable_adapter()` runs the frozen base
weights without the adapters, so no second model is built.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from streamrl.config import LoraConfig
from streamrl.weights import adapters

ADAPTER_NAME = "default"
"""peft's name of the one adapter a LoRA run trains."""


def spec_of(cfg: LoraConfig, base_model: str) -> adapters.AdapterSpec:
    """The peft adapter description of `learner.lora` over `base_model`."""
    return adapters.AdapterSpec(
        rank=cfg.rank,
        alpha=cfg.alpha,
        dropout=cfg.dropout,
        target_modules=tuple(cfg.target_modules),
        base_model=base_model,
    )


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` as a `PeftModel` with fresh adapters (A random, B zero: the model's outputs do
    not change) on `cfg.target_modules`; only the adapters require grad. ValueError when the
    model has none of the target modules."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # transformers' deprecation notices, raised inside peft
        warnings.simplefilter("ignore", FutureWarning)
        try:
            wrapped = get_peft_model(model, peft_config)
        except ValueError as exc:
            raise ValueError(f"learner.lora.target_modules = {cfg.target_modules}: {exc}") from None
    return wrapped


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, peft LoRA layer) of every adapted linear."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            yield name.removeprefix(adapters.PEFT_PREFIX), module


def wire_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters as the weight wire carries them, in `dtype`: `<module>.lora_A.weight`
    and the scaled `<module>.lora_B.weight` of every adapted linear."""
    for module_name, layer in lora_layers(model):
        lora_a = layer.lora_A[ADAPTER_NAME].weight.detach()
        lora_b = layer.lora_B[ADAPTER_NAME].weight.detach() * layer.scaling[ADAPTER_NAME]
        yield module_name + adapters.LORA_A, lora_a.to(dtype)
        yield module_name + adapters.LORA_B, lora_b.to(dtype)


def save_adapter(model: torch.nn.Module, path: Path, spec: adapters.AdapterSpec) -> None:
    """`path` holds the adapters in peft's format (float32, lora_B unscaled)."""
    from peft import get_peft_model_state_dict

    adapters.write_peft_adapter(path, get_peft_model_state_dict(model), spec)


def load_adapter(model: torch.nn.Module, path: Path, spec: adapters.AdapterSpec) -> None:
    """Restore adapters that `save_adapter` (or peft) wrote under `path`; ValueError when
    their rank, alpha or modules are not this run's."""
    from peft import set_peft_model_state_dict

    saved, tensors = adapters.read_peft_adapter(path)
    mine = (spec.rank, spec.alpha, sorted(spec.target_modules))
    theirs = (saved.rank, saved.alpha, sorted(saved.target_modules))
    if mine != theirs:
        raise ValueError(
            f"{path}: adapter with rank, alpha, target_modules = {theirs}; learner.lora has {mine}"
        )
    expected = {name for name, _ in model.named_parameters() if ".lora_" in name}
    result = set_peft_model_state_dict(model, tensors)
    loaded = expected - {name for name in result.missing_keys if ".lora_" in name}
    if result.unexpected_keys or loaded != expected:
        missing = sorted(expected - loaded)
        raise ValueError(
            f"{path}: adapter tensors do not fit the model: unexpected "
            f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}"
        )


def base_only(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Within: `model` runs its frozen base weights, adapters off (the KL reference)."""
    return model.disable_adapter()
