"""LoRA adapters merged into a runner's weights, each version replacing the last.

An update may carry adapter pairs (`streamrl.weights.adapters`: `<module>.lora_A.weight`,
and `<module>.lora_B.weight` already scaled) instead of full tensors. For each adapted
module the runner keeps its base weight (a copy taken the first time an adapter arrives
for it) and writes W = W_base + lora_B @ lora_A (in float32, cast to the runner's dtype)
into the live weight in place, so captured CUDA graphs stay valid and version v + 1's
adapter replaces version v's instead of adding to it. A full tensor for a module replaces
its weight outright and becomes its new base.

Memory: one extra copy of every adapted weight (the bases), on the runner's device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from streamrl.weights.adapters import merged


@dataclass
class Merge:
    """One adapted module of a plan: live weight `destination` <- base + lora_B @ lora_A."""

    name: str
    destination: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def apply(self, bases: dict[str, torch.Tensor]) -> None:
        if self.name not in bases:  # the first adapter of this module: the weight is the base
            bases[self.name] = self.destination.detach().clone()
        self.destination.copy_(merged(bases[self.name], self.lora_a, self.lora_b))


@dataclass
class ForgetBase:
    """A full tensor replaced these weights: they are their own bases again."""

    names: list[str]

    def apply(self, bases: dict[str, torch.Tensor]) -> None:
        for name in self.names:
            bases.pop(name, None)


def plan_merges(
    targets: Mapping[str, tuple[torch.Tensor, int | None, int | None]],
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> list[Merge]:
    """A `Merge` per adapted module; ValueError naming the first module the runner lacks or
    whose adapter does not fit its weight (nothing is applied by this function)."""
    plan = []
    for module, (lora_a, lora_b) in pairs.items():
        name = f"{module}.weight"
        if name not in targets:
            raise ValueError(f"adapter for unknown module {module!r} (no weight {name!r})")
        parameter, start, end = targets[name]
        destination = parameter.data[start:end]
        if (lora_b.shape[0], lora_a.shape[1]) != tuple(destination.shape):
            raise ValueError(
                f"adapter of {module!r} makes a {lora_b.shape[0]}x{lora_a.shape[1]} update, "
                f"its weight is {tuple(destination.shape)}"
            )
        plan.append(Merge(name, destination, lora_a, lora_b))
    return plan
