"""Checkpoints of the Megatron learner: the policy's (`save_policy` / `load_policy`) and its
critic's (`save_critic` / `load_critic`, under the policy checkpoint's `critic/`).

A checkpoint directory holds the model as Hugging Face safetensors (one file per PP stage,
written by the stage's publisher, plus an index; with LoRA one peft adapter directory
instead), the tokenizer and config files of the model it started from, and under
`optimizer/` what cannot live in those files: every rank's optimizer state, loadable only
into the same TP/PP/DP layout (`layout.json` says which), and the count of optimizer
steps (`schedule.json`, so a resume continues the learning-rate schedule). A rank's
optimizer file holds each chained Megatron optimizer's `state_dict()` and, with the
distributed optimizer, its shard of parameter state (`get_parameter_state_dp_reshardable`).

A checkpoint taken while training goes on (`stage_policy`) is copied on every rank first
(the gathers and the optimizer's state, in the training thread), then each rank writes its
own files in a thread; the threads agree that every rank's files are there on a gloo group
of their own (`_written_on_every_rank`), and rank 0 writes the shared files last.
`save_policy` is the same, at once.

Two workarounds for megatron-core 0.16.1 with torch's AdamW (no Apex / TE):
`_mark_unpadded` and `_unshare_step_counters` (see their docstrings).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from streamrl.backends import staging as staging_
from streamrl.backends.base import CRITIC_DIR
from streamrl.backends.megatron import convert
from streamrl.models import TOKENIZER_FILES
from streamrl.weights import adapters

if TYPE_CHECKING:
    from streamrl.backends.megatron.parallel import Layout

MegatronBackend = Any
"""`backend.MegatronBackend` (that module imports this one, so the type is not imported)."""
MegatronCritic = Any
"""`critic.MegatronCritic` (likewise)."""

COPIED_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
"""The files of the starting model's directory that a policy checkpoint carries along."""

OPTIMIZER_DIR = "optimizer"

Parts = tuple[Callable[[], None], Callable[[], None]]
"""A checkpoint part's writes: this rank's own files, then rank 0's shared files."""

log = logging.getLogger(__name__)


# ------------------------------------------------------------ the policy


def save_policy(backend: MegatronBackend, path: Path) -> None:
    """Weights (or adapters), copied model files and every rank's optimizer state under `path`,
    then the critic's under `path / critic`. Every rank calls it; all have returned once
    every file is written."""
    stage_policy(backend, path, staging="host")()
    dist.barrier()


def stage_policy(backend: MegatronBackend, path: Path, *, staging: str) -> Callable[[], None]:
    """Copy this rank's part of what `save_policy` writes (`streamrl.backends.staging`) and
    return the function that writes it, which may run in another thread while training
    goes on. Every rank calls both, in the same order; rank 0's function returns once
    every rank's files are written and the checkpoint is whole."""
    path, layout = Path(path), backend.layout
    shard_names = [convert.hf_shard_name(stage, layout.pp_size) for stage in range(layout.pp_size)]
    if backend.lora is not None:
        shard_names = [f"adapter-stage{stage:05d}.safetensors" for stage in range(layout.pp_size)]

    def stage_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        if backend.lora is None:
            yield from backend.hf_weights()
            return
        for module, lora_a, lora_b in backend.full_adapters():
            yield adapters.PEFT_PREFIX + module + adapters.LORA_A, lora_a
            yield adapters.PEFT_PREFIX + module + adapters.LORA_B, lora_b

    write_files = _stage_files(
        path, layout, stage_tensors, is_publisher=backend.is_publisher, shard_names=shard_names,
        optimizer=backend.optimizer, context=backend.megatron_context, staging=staging,
        pool=backend.staging_pool, part="policy",
    )  # fmt: skip
    num_updates = backend.num_updates
    critic_parts = []
    if backend.critic is not None:
        critic_parts.append(stage_critic(backend.critic, path / CRITIC_DIR, staging=staging))
    if staging == staging_.Staging.RESERVE:  # the buffers are in the pool: nothing to write
        return lambda: None

    def finish() -> None:
        if layout.rank == 0:
            if backend.lora is not None:  # one peft adapter directory from the stages' parts
                parts = [path / name for name in shard_names]
                merged = {
                    k: v for part in parts for k, v in convert.read_hf_state_file(part).items()
                }
                adapters.write_peft_adapter(path, merged, backend.adapter_spec)
                for part in parts:
                    part.unlink()
            elif layout.pp_size > 1:
                convert.write_hf_index(path, shard_names)
            for name in COPIED_FILES:
                if backend.lora is not None and name in ("config.json", "generation_config.json"):
                    continue  # an adapter directory, not a model
                if (backend.model_dir / name).exists():
                    shutil.copy(backend.model_dir / name, path / name)
            (path / OPTIMIZER_DIR / "layout.json").write_text(json.dumps(layout_record(backend)))
            _write_schedule(path, num_updates)

    return _written_on_every_rank((write_files, finish), *critic_parts)


@torch.no_grad()
def load_policy(backend: MegatronBackend, path: Path) -> None:
    """Restore what `save_policy` wrote (model weights from the HF files, then the optimizer
    state), refusing a checkpoint of another layout."""
    path, layout = Path(path), backend.layout
    record = json.loads((path / OPTIMIZER_DIR / "layout.json").read_text())
    if record != layout_record(backend):
        raise ValueError(
            f"{path}: saved with layout {record}, this run is {layout_record(backend)}"
        )
    with backend.megatron_context():
        if backend.lora is not None:
            _load_adapters(backend, path)
        else:
            hf_state = convert.HFCheckpoint(path)
            convert.load_into_model(backend.model, hf_state, backend.shape, **layout.shard)
        _load_rank_optimizer(backend.optimizer, path, layout, device=backend.device)
    updates = _read_schedule(path)
    if updates is not None:  # absent in checkpoints written before the schedule was saved
        backend.num_updates = updates
    dist.barrier()
    if backend.critic is not None:
        load_critic(backend.critic, path / CRITIC_DIR)


def layout_record(backend: MegatronBackend) -> dict[str, Any]:
    """What an optimizer file's shape depends on: it loads only where this record is equal."""
    layout = backend.layout
    return {
        "tp": layout.tp_size,
        "pp": layout.pp_size,
        "dp": layout.dp_size,
        "distributed_optimizer": backend.cfg.megatron.use_distributed_optimizer,
        "dtype": str(backend.dtype),
    }


def _load_adapters(backend: MegatronBackend, path: Path) -> None:
    """This rank's adapter shards from the peft adapter directory `path`."""
    saved, tensors = adapters.read_peft_adapter(path)
    mine = backend.adapter_spec
    if (saved.rank, saved.alpha, sorted(saved.target_modules)) != (
        mine.rank, mine.alpha, sorted(mine.target_modules),
    ):  # fmt: skip
        raise ValueError(
            f"{path}: an adapter of rank {saved.rank}, alpha {saved.alpha}, "
            f"modules {saved.target_modules}; learner.lora differs"
        )
    for adapter in backend.adapters:
        names = [adapters.PEFT_PREFIX + module for module in adapter.plan.modules]
        missing = [n for n in names if n + adapters.LORA_A not in tensors]
        if missing:
            raise ValueError(f"{path}: no adapter for {missing[0]}")
        adapter.load_full(
            [(tensors[n + adapters.LORA_A], tensors[n + adapters.LORA_B]) for n in names]
        )


# ------------------------------------------------------------ the critic


def save_critic(critic: MegatronCritic, path: Path) -> None:
    """The critic's weights (its value head included), config and per-rank optimizer state."""
    _written_on_every_rank(stage_critic(critic, path, staging="host"))()
    dist.barrier()


def stage_critic(critic: MegatronCritic, path: Path, *, staging: str) -> Parts:
    """Copy this rank's part of what `save_critic` writes; returns its two writes (every
    rank's own files; then, on rank 0, the shared ones)."""
    path, layout = Path(path), critic.layout
    names = [convert.hf_shard_name(stage, layout.pp_size) for stage in range(layout.pp_size)]
    write_files = _stage_files(
        path, layout, critic.stage_tensors, is_publisher=layout.is_stage_publisher,
        shard_names=names, optimizer=critic.optimizer, context=critic.policy.megatron_context,
        staging=staging, pool=critic.policy.staging_pool, part="critic",
    )  # fmt: skip
    num_updates = critic.num_updates

    def finish() -> None:
        if layout.rank == 0:
            if layout.pp_size > 1:
                convert.write_hf_index(path, names)
            shutil.copy(critic.model_dir / "config.json", path / "config.json")
            _write_schedule(path, num_updates)

    return write_files, finish


@torch.no_grad()
def load_critic(critic: MegatronCritic, path: Path) -> None:
    """Restore what `save_critic` wrote (in the same layout: `load_policy` checked it)."""
    path = Path(path)
    updates = _read_schedule(path)
    if updates is None:
        raise FileNotFoundError(
            f"{path}: no critic checkpoint; was this run trained without "
            "algorithm.advantage_estimator = 'gae'?"
        )
    with critic.policy.megatron_context():
        convert.load_into_model(
            critic.model, convert.HFCheckpoint(path), critic.shape, **critic.layout.shard
        )
        _load_rank_optimizer(critic.optimizer, path, critic.layout, device=critic.device)
    critic.num_updates = updates
    dist.barrier()


# ------------------------------------------------------------ the parts both write


def _stage_files(
    path: Path,
    layout: Layout,
    stage_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    *,
    is_publisher: bool,
    shard_names: Sequence[str],
    optimizer: Any,
    context: Callable[[], contextlib.AbstractContextManager],
    staging: str,
    pool: staging_.StagingPool,
    part: str,
) -> Callable[[], None]:
    """Copy this rank's files (into `pool`'s buffers for `part` where it has them): each
    stage's publisher its stage's weights (every rank takes part in the gathers), every rank
    its optimizer state. Every rank calls it; the function returned writes them (no
    collectives) and gives the buffers back to `pool`."""
    if layout.rank == 0 and staging != staging_.Staging.RESERVE:
        (path / OPTIMIZER_DIR).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    stager = staging_.Stager(staging, pool=pool, part=part)
    started = time.perf_counter()
    # each tensor copied as it comes (a stream may reuse its buffers); only publishers keep them
    weights = {name: stager.copy(tensor) for name, tensor in stage_tensors() if is_publisher}
    weights_s = time.perf_counter() - started
    with context():
        state_dict = optimizer_state_dict(optimizer)
        state_dict_s = time.perf_counter() - started - weights_s
        optimizer_state = stager.copy(state_dict)
    queued_s = time.perf_counter() - started
    staged = stager.done({"weights": weights, "optimizer": optimizer_state})
    del weights, optimizer_state, state_dict
    if staging != staging_.Staging.RESERVE:
        log.info(
            "%s checkpoint copy (%s) on rank %d: weights %.2f s, optimizer state dict %.2f s, "
            "its copies queued %.2f s, waited for the copies %.2f s", part, staging, layout.rank,
            weights_s, state_dict_s, queued_s - weights_s - state_dict_s,
            time.perf_counter() - started - queued_s,
        )  # fmt: skip

    def write() -> None:
        with staged.host() as state:
            if is_publisher:
                weights = {k: v.contiguous() for k, v in state["weights"].items()}
                convert.write_hf_shard(weights, path / shard_names[layout.pp_rank])
            torch.save(state["optimizer"], path / OPTIMIZER_DIR / f"rank{layout.rank:05d}.pt")

    return write


def _written_on_every_rank(*parts: Parts) -> Callable[[], None]:
    """The function that writes `parts` on this rank: each one's own files, then, once every
    rank has written its files (their agreement on a gloo group of their own, so that it
    may run beside training's collectives), each one's shared files on rank 0. A rank that
    fails to write makes every rank's function raise."""
    group = _checkpoint_group()

    def write() -> None:
        error = None
        try:
            for write_files, _ in parts:
                write_files()
        except Exception as exc:  # every rank must reach the agreement below
            log.exception("writing this rank's checkpoint files failed")
            error = exc
        is_written = torch.tensor([0 if error else 1], dtype=torch.int32)
        dist.all_reduce(is_written, op=dist.ReduceOp.MIN, group=group)
        if error is not None:
            raise error
        if not is_written.item():
            raise RuntimeError("another learner rank failed to write its checkpoint files")
        for _, finish in parts:
            finish()

    return write


_GROUPS: list[Any] = []


def _checkpoint_group() -> Any:
    """The gloo group the checkpoint writers agree on (made on first use: every rank stages
    its checkpoints in the same order)."""
    if not _GROUPS:
        _GROUPS.append(dist.new_group(backend="gloo"))
    return _GROUPS[0]


def _load_rank_optimizer(optimizer: Any, path: Path, layout: Layout, *, device) -> None:
    load_optimizer(optimizer, path / OPTIMIZER_DIR / f"rank{layout.rank:05d}.pt", device=device)


def _write_schedule(path: Path, num_updates: int) -> None:
    (path / OPTIMIZER_DIR / "schedule.json").write_text(json.dumps({"num_updates": num_updates}))


def _read_schedule(path: Path) -> int | None:
    schedule = path / OPTIMIZER_DIR / "schedule.json"
    return int(json.loads(schedule.read_text())["num_updates"]) if schedule.exists() else None


# ------------------------------------------------------------ optimizer files


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_optimizer(optimizer: Any, path: Path) -> None:
    """Write this rank's optimizer state to `path`."""
    torch.save(optimizer_state_dict(optimizer), path)


def optimizer_state_dict(optimizer: Any) -> dict[str, Any]:
    """What `save_optimizer` writes: each chained optimizer's `state_dict()` and, with the
    distributed optimizer, its shard of parameter state (tensors of the live state among
    them: copy before training goes on)."""
    parts = _optimizers(optimizer)
    state: dict[str, Any] = {"optimizers": [opt.state_dict() for opt in parts]}
    if any(hasattr(opt, "get_parameter_state_dp_reshardable") for opt in parts):
        state["parameter_states"] = [opt.get_parameter_state_dp_reshardable() for opt in parts]
    return state


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
