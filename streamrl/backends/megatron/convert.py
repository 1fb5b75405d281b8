"""Hugging Face <-> Megatron weights: fused QKV with the GQA interleave, fused gate/up, TP shards, PP stages.

Layouts (megatron-core 0.16.1, local spec names; see docs/megatron.md):

- `linear_qkv.weight` is `[groups * (heads_per_group + 2) * head_dim, hidden]`,
  group by group: that group's query heads, its key head, its value head
  (the bias, for Qwen2, the same way). A TP rank holds rows
  `chunk(tp)[tp_rank]` of that full matrix, whatever the group count.
- `linear_fc1.weight` is `[gate; up]` *per TP rank*: rank r holds
  `cat(gate.chunk(tp)[r], up.chunk(tp)[r])`.
- Column-parallel (embedding and output rows over the vocabulary, QKV, fc1)
  split dim 0; row-parallel (`linear_proj`, `linear_fc2`) split dim 1;
  norms are replicated.
- A PP stage holds its layers under local indices 0..; HF names always carry global
  indices (`streamrl.backends.megatron.rules`).
- A critic's value model (`ModelShape.value_head`) has, instead of the LM head, a
  scalar head `output_layer.weight` `[1, hidden]` and `output_layer.bias` `[1]`,
  replicated on every TP rank, saved as `value_head.weight` / `value_head.bias`.

The rules that name which Megatron tensor is made of which HF tensors are in
`streamrl.backends.megatron.rules`; this module moves the tensors by them. Every function
here is pure tensor code: no process groups.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from streamrl.backends.megatron.rules import (
    COLUMN,
    EXPERTS_GATE_UP,
    EXPERTS_ROW,
    GATE_UP,
    GATE_UP_FUSED,
    QKV,
    ROW,
    Rule,
    is_exported,
    stage_rules,
    te_name,
)
from streamrl.backends.megatron.shapes import ModelShape

# ------------------------------------------------------------ one tensor


def fuse(kind: str, hf_tensors: Sequence[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The full (unsharded) Megatron tensor from its HF parts."""
    if kind == QKV:
        q, k, v = hf_tensors
        groups, per_group, head_dim = shape.num_kv_heads, shape.heads_per_group, shape.head_dim
        rest = q.shape[1:]
        return torch.cat(
            [
                q.reshape(groups, per_group * head_dim, *rest),
                k.reshape(groups, head_dim, *rest),
                v.reshape(groups, head_dim, *rest),
            ],
            dim=1,
        ).reshape(-1, *rest)
    (tensor,) = hf_tensors
    return tensor


def unfuse(kind: str, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """HF parts of a full Megatron tensor (inverse of `fuse`)."""
    if kind == QKV:
        groups, per_group, head_dim = shape.num_kv_heads, shape.heads_per_group, shape.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(groups, (per_group + 2) * head_dim, *rest)
        q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
        return [
            q.reshape(-1, *rest).contiguous(),
            k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous(),
        ]
    return [full]


def shard(
    kind: str, hf_tensors: Sequence[torch.Tensor], shape: ModelShape, *, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's Megatron tensor from the HF parts."""
    if kind == EXPERTS_GATE_UP:
        pairs = zip(hf_tensors[0::2], hf_tensors[1::2], strict=True)
        return torch.stack(
            [shard(GATE_UP, pair, shape, tp_rank=tp_rank, tp_size=tp_size) for pair in pairs]
        )
    if kind == EXPERTS_ROW:
        return torch.stack([down.chunk(tp_size, dim=1)[tp_rank] for down in hf_tensors])
    if kind in (GATE_UP, GATE_UP_FUSED):
        gate, up = hf_tensors if kind == GATE_UP else hf_tensors[0].chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).contiguous()
    full = fuse(kind, hf_tensors, shape)
    if kind in (COLUMN, QKV):
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if kind == ROW:
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    return full.clone()


def merge(kind: str, shards: Sequence[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """HF parts from the TP-rank-ordered Megatron shards (inverse of `shard`)."""
    if kind == EXPERTS_GATE_UP:
        experts = range(shards[0].shape[0])
        return [t for e in experts for t in merge(GATE_UP, [s[e] for s in shards], shape)]
    if kind == EXPERTS_ROW:
        return [torch.cat([s[e] for s in shards], dim=1) for e in range(shards[0].shape[0])]
    if kind in (GATE_UP, GATE_UP_FUSED):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        return [gate, up] if kind == GATE_UP else [torch.cat([gate, up])]
    if kind in (COLUMN, QKV):
        return unfuse(kind, torch.cat(list(shards), dim=0), shape)
    if kind == ROW:
        return [torch.cat(list(shards), dim=1)]
    return [shards[0]]


# ------------------------------------------------------------ whole stages


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The local (Megatron-named) tensors of one (TP rank, PP stage, EP rank) from HF tensors."""
    out = {}
    for rule in stage_rules(
        shape, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size
    ):
        sources = [hf_state[name] for name in rule.hf]
        out[rule.megatron] = shard(rule.kind, sources, shape, tp_rank=tp_rank, tp_size=tp_size)
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]],
    shape: ModelShape,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """HF tensors (global layer indices) of one PP stage from its local states.

    `shards[ep_rank * tp_size + tp_rank]` is one rank's state (TP-rank order when
    `ep_size` is 1): tensors other than experts come from EP rank 0, each expert
    from the EP rank that holds it."""
    tp_size = len(shards) // ep_size
    out = {}
    for ep_rank in range(ep_size):
        ranks = shards[ep_rank * tp_size : (ep_rank + 1) * tp_size]
        for rule in stage_rules(
            shape, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size
        ):
            if not is_exported(rule, shape, pp_size=pp_size):
                continue
            if ep_rank > 0 and rule.expert is None:
                continue
            parts = merge(rule.kind, [s[rule.megatron] for s in ranks], shape)
            out.update(zip(rule.hf, parts, strict=True))
    return out


# ------------------------------------------------------------ files


def resolve_model_dir(model_path: str, *, seed: int) -> tuple[Path, Any]:
    """(HF directory, keep-alive handle) for `model_path`.

    `random:<shape>` is written (seeded: the same weights on every rank) into a
    temporary directory that lives as long as the returned handle; `smollm2` is the
    dequantised SmolLM2 directory that `streamrl.models` builds once."""
    if model_path == "smollm2":
        from streamrl.models import smollm2_model_dir

        return smollm2_model_dir(), None
    if model_path.startswith("random:"):
        from streamrl.models import save_random_model

        holder = tempfile.TemporaryDirectory(prefix="streamrl-megatron-random-")
        save_random_model(model_path.removeprefix("random:"), holder.name, seed=seed)
        return Path(holder.name), holder
    path = Path(model_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{model_path}: the megatron backend needs a Hugging Face directory "
            "(config.json + safetensors) or random:<shape>"
        )
    return path, None


def read_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded with an index)."""
    checkpoint = HFCheckpoint(model_dir)
    return {name: checkpoint[name] for name in checkpoint}


def read_hf_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file."""
    from safetensors.torch import load_file

    return load_file(str(path))


def write_hf_shard(
    tensors: Mapping[str, torch.Tensor], path: str | Path, *, metadata: Mapping[str, str] = ()
) -> None:
    """Write tensors as one safetensors file (contiguous CPU copies)."""
    from safetensors.torch import save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt", **dict(metadata)})


def hf_shard_name(stage: int, num_stages: int) -> str:
    """The safetensors file of pipeline stage `stage` in a checkpoint of `num_stages`."""
    if num_stages == 1:
        return "model.safetensors"
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def write_hf_index(model_dir: str | Path, shard_names: Sequence[str]) -> None:
    """`model.safetensors.index.json` mapping every tensor to the shard that holds it."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    weight_map, total_bytes = {}, 0
    for name in shard_names:
        with safe_open(str(model_dir / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                weight_map[key] = name
                sliced = handle.get_slice(key)
                numel = 1
                for dim in sliced.get_shape():
                    numel *= dim
                total_bytes += numel * _dtype_bytes(sliced.get_dtype())
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _dtype_bytes(name: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(name, 1)


def iter_stage_tensors(
    model: torch.nn.Module,
    shape: ModelShape,
    *,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> Iterator[tuple[Rule, torch.Tensor]]:
    """(rule, this rank's tensor) for every tensor of a stage, in a fixed order.

    Parameters, plus the one buffer a checkpoint carries: the router's expert bias."""
    params = dict(model.named_parameters())
    params.update(
        (name, buffer)
        for name, buffer in model.named_buffers()
        if name.endswith("mlp.router.expert_bias")
    )
    for rule in stage_rules(
        shape, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size
    ):
        name = rule.megatron if rule.megatron in params else te_name(rule.megatron)
        if name not in params:
            raise KeyError(f"model has no parameter {rule.megatron!r} (nor {name!r})")
        yield rule, params[name]


@torch.no_grad()
def load_into_model(
    model: torch.nn.Module,
    hf_state: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> None:
    """Copy HF tensors into this rank's model parameters (in place; every parameter covered)."""
    covered = set()
    for rule, param in iter_stage_tensors(
        model, shape, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size
    ):
        sources = [hf_state[name] for name in rule.hf]
        value = shard(rule.kind, sources, shape, tp_rank=tp_rank, tp_size=tp_size)
        if value.shape != param.shape:
            raise ValueError(
                f"{rule.megatron}: checkpoint gives {tuple(value.shape)}, model has {tuple(param.shape)}"
            )
        param.copy_(value)
        covered.add(id(param))
    missing = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise KeyError(f"no HF source for Megatron parameters {missing}")


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """Lazy, read-only view of an HF safetensors checkpoint: tensors load when indexed."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        self._handles = {name: safe_open(str(model_dir / name), framework="pt") for name in files}
        self._file_of = {
            key: name
            for name, handle in self._handles.items()
            for key in handle.keys()  # noqa: SIM118 - safe_open has no __iter__
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)
