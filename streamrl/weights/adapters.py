"""LoRA adapters on the weight wire and on disk (peft's format).

A LoRA adapter of a linear layer with weight W [out, in] is a pair A [rank, in], B [out,
rank]; the adapted layer computes x W^T + s * (x A^T) B^T with the scaling s = alpha / rank
(Hu et al. 2021, arXiv 2106.09685; s = alpha / sqrt(rank) with rsLoRA, arXiv 2312.03732).

On the wire (learner -> engines, through the usual staging buckets, version tags and
digests) every adapted module travels as two tensors named after its Hugging Face module:

    <module>.lora_A.weight   A        [rank, in]
    <module>.lora_B.weight   s * B    [out, rank]   (the scaling already applied)

so an engine needs no adapter config: the module's weight is W_base + lora_B @ lora_A.
An engine merges each update into the base weights it kept, so a new version replaces the
previous adapter instead of stacking on it (`merged`).

On disk (checkpoints, exports, SGLang's `/load_lora_adapter`): peft's layout, a directory
with `adapter_config.json` and `adapter_model.safetensors` whose tensors are named
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (B without the scaling).

Pure tensor and file code: no peft, no process groups.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"
PEFT_PREFIX = "base_model.model."
"""peft's prefix of every tensor name of a causal LM's adapter (PeftModel -> LoraModel)."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSpec:
    """What peft's `adapter_config.json` needs to rebuild an adapter."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    base_model: str = ""
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """s: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return scaling(self.rank, self.alpha, use_rslora=self.use_rslora)

    def peft_config(self) -> dict:
        """peft's LoraConfig fields (the ones a plain LoRA of linear layers sets)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "inference_mode": True,
            "modules_to_save": None,
            "init_lora_weights": True,
        }

    @classmethod
    def from_peft_config(cls, config: Mapping) -> AdapterSpec:
        """The spec of a peft `adapter_config.json` (ValueError for anything but plain LoRA)."""
        if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
            raise ValueError(f"not a plain LoRA adapter: peft_type {config.get('peft_type')!r}")
        if config.get("bias", "none") != "none" or config.get("modules_to_save"):
            raise ValueError("adapters with trained biases or modules_to_save are not supported")
        if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("lora_bias"):
            raise ValueError("adapters with per-module ranks, alphas or biases are not supported")
        targets = config.get("target_modules") or ()
        return cls(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            dropout=float(config.get("lora_dropout", 0.0)),
            target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
            base_model=str(config.get("base_model_name_or_path") or ""),
            use_rslora=bool(config.get("use_rslora", False)),
        )


def scaling(rank: int, alpha: float, *, use_rslora: bool = False) -> float:
    """The LoRA scaling s of `rank` and `alpha`."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def is_adapter_name(name: str) -> bool:
    """True for a wire name of an adapter tensor (`<module>.lora_A.weight` / `lora_B`)."""
    return name.endswith((LORA_A, LORA_B))


def module_of(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj`."""
    for suffix in (LORA_A, LORA_B):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    raise ValueError(f"{name!r} is not an adapter tensor name")


def split_adapters(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(full tensors, {module: (lora_A, lora_B)}) of one update's tensors.

    ValueError naming the module when an A comes without its B (or the reverse), or when
    the two do not share a rank."""
    full, halves = [], {}
    for name, tensor in tensors:
        if not is_adapter_name(name):
            full.append((name, tensor))
            continue
        halves.setdefault(module_of(name), {})["A" if name.endswith(LORA_A) else "B"] = tensor
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            raise ValueError(
                f"adapter of {module!r} lacks its lora_{({'A', 'B'} - set(half)).pop()}"
            )
        a, b = half["A"], half["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapter of {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not make a [out, rank] @ [rank, in] product"
            )
        pairs[module] = (a, b)
    return full, pairs


@torch.no_grad()
def merged(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """base + lora_B @ lora_A, computed in float32 and returned in base's dtype and device
    (lora_B is the wire's: already scaled)."""
    delta = lora_b.to(base.device, torch.float32) @ lora_a.to(base.device, torch.float32)
    return (base.float() + delta).to(base.dtype)


def wire_tensors(
    peft_state: Mapping[str, torch.Tensor], spec: AdapterSpec
) -> list[tuple[str, torch.Tensor]]:
    """peft-named tensors (`base_model.model.<module>.lora_X.weight`) as wire tensors
    (names without the prefix, lora_B times the scaling)."""
    out = []
    for name, tensor in peft_state.items():
        wire = name.removeprefix(PEFT_PREFIX)
        if not is_adapter_name(wire):
            raise ValueError(f"{name!r} is not a LoRA tensor of a peft adapter")
        out.append((wire, tensor * spec.scaling if wire.endswith(LORA_B) else tensor))
    return out


def peft_tensors(
    wire: Iterable[tuple[str, torch.Tensor]], spec: AdapterSpec
) -> dict[str, torch.Tensor]:
    """Wire tensors as peft names and values (lora_B divided by the scaling): the inverse of
    `wire_tensors`."""
    out = {}
    for name, tensor in wire:
        value = tensor / spec.scaling if name.endswith(LORA_B) else tensor
        out[PEFT_PREFIX + name] = value.detach().to("cpu").contiguous()
    return out


def write_peft_adapter(
    directory: str | Path, tensors: Mapping[str, torch.Tensor], spec: AdapterSpec
) -> Path:
    """`directory` becomes a peft adapter: `adapter_config.json` and the peft-named `tensors`
    in `adapter_model.safetensors`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(spec.peft_config(), indent=2) + "\n")
    return directory


def read_peft_adapter(directory: str | Path) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """(spec, peft-named tensors) of a peft adapter directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not a peft adapter: no {path.name}")
    spec = AdapterSpec.from_peft_config(json.loads(config_path.read_text()))
    return spec, load_file(str(weights_path))


def read_wire_tensors(directory: str | Path) -> list[tuple[str, torch.Tensor]]:
    """A peft adapter directory as wire tensors (what an engine merges)."""
    spec, tensors = read_peft_adapter(directory)
    return wire_tensors(tensors, spec)


def is_peft_adapter(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).exists()
