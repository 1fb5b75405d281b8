"""`plan_memory(cfg)`: the processes of a run placed on their GPUs, and what does not fit.

GPUs as the local launcher assigns them: learner rank i on `cluster.learner_gpus[i]` (or
GPU i), engine e on its `engine.tp_size` entries of `cluster.engine_gpus` (or of 0..;
`streamrl.placement`); with Ray each process has GPUs of its own. A GPU's size is
`cluster.gpu_memory_gb`, else what the CUDA device here reports, else unknown (the plan is
printed, not checked). A GPU fits when its planned peak leaves `FREE_SHARE` of it free: the
plan counts what torch allocates, not the blocks its caching allocator holds between
allocations nor each process's CUDA context (bench/results/gpu/fullsize_async4b/README.md).
"""

from __future__ import annotations

from typing import Any

from streamrl.backends.megatron.shapes import ModelShape
from streamrl.planner.plan import (
    ENGINE_PHASE,
    GB,
    KEYS_FOR_TERM,
    RELEASED,
    SERVING,
    GpuPlan,
    MemoryPlan,
    Usage,
    embedded_engine_usage,
    learner_usage,
    sglang_engine_usage,
)
from streamrl.planner.report import names_of

FREE_SHARE = 0.05
"""Of each GPU, kept out of the plan's reach. On the H200, Qwen3-4B's learner beside SGLang
ran out of memory at its first step in four layouts planned at 93.5-98.8% of the GPU (before
`weight_staging` was counted), with 1.2-5.4 GiB reserved by its allocator but not
allocated when it failed."""


def gpu_size(cfg: Any) -> tuple[float | None, str]:
    """(bytes of one GPU or None, where the figure comes from)."""
    if cfg.cluster.gpu_memory_gb > 0:
        return cfg.cluster.gpu_memory_gb * GB, "cluster.gpu_memory_gb"
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device here and cluster.gpu_memory_gb = 0"
    device = (cfg.cluster.learner_gpus or [0])[0] if cfg.cluster.launcher == "local" else 0
    device = min(device, torch.cuda.device_count() - 1)
    properties = torch.cuda.get_device_properties(device)
    return float(properties.total_memory), f"CUDA device {device}, {properties.name}"


def shape_of(path: str) -> ModelShape:
    """The `ModelShape` of a model path (a directory, `random:<shape>`); raises when its
    config does not load or its family is not one `shape_from_hf` reads."""
    from streamrl import models
    from streamrl.backends.megatron.families import shape_from_hf

    return shape_from_hf(models.model_config(path))


def plan_memory(
    cfg: Any, *, gpu_bytes: float | None = None, source: str = "", shape: ModelShape | None = None
) -> MemoryPlan:
    """Each GPU's expected peak for `cfg`; `gpu_bytes` None reads `gpu_size(cfg)`. Raises
    (ValueError, NotImplementedError, OSError) when the model's shape cannot be read."""
    if gpu_bytes is None and not source:
        gpu_bytes, source = gpu_size(cfg)
    shape = shape or shape_of(cfg.model.path)
    plan = MemoryPlan(cfg.model.path, shape.num_parameters(), [], gpu_bytes, source)
    gpus: dict[str, GpuPlan] = {}

    def place(name: str, usage: Usage) -> None:
        gpus.setdefault(name, GpuPlan(name, [], cfg.cluster.colocate)).usages.append(usage)

    is_ray = cfg.cluster.launcher == "ray"
    if cfg.learner.device == "cpu":
        plan.notes.append("the learner runs on the CPU (learner.device = 'cpu')")
    elif cfg.train.mode != "rollout_only":
        critic = None
        if cfg.algorithm.advantage_estimator == "gae":
            critic = shape_of(cfg.learner.critic.path) if cfg.learner.critic.path else shape
        usage = learner_usage(shape, cfg, critic)
        ids = cfg.cluster.learner_gpus or range(cfg.learner.num_gpus)
        for rank, gpu in enumerate(list(ids)[: cfg.learner.num_gpus]):
            place(f"learner rank {rank}" if is_ray else f"GPU {gpu}", usage)
            plan.processes[f"learner rank {rank}"] = usage
    for engine, gpu_ids in enumerate(_engine_gpus(cfg, plan)):
        if cfg.engine.backend == "sglang":
            usage = sglang_engine_usage(shape, cfg, gpu_bytes)
        else:
            usage = embedded_engine_usage(shape, cfg)
        for index, gpu in enumerate(gpu_ids):
            place(f"engine {engine} GPU {index}" if is_ray else f"GPU {gpu}", usage)
        plan.processes[f"engine {engine}"] = usage
    plan.gpus = sorted(gpus.values(), key=lambda g: (len(g.name), g.name))
    if gpu_bytes is not None:
        plan.problems = fit_problems(plan, cfg, shape)
    return plan


def _engine_gpus(cfg: Any, plan: MemoryPlan) -> list[list[int]]:
    from streamrl.placement import engine_gpu_ids

    engine = cfg.engine
    if cfg.train.mode == "train_only":
        return []
    if engine.urls:
        plan.notes.append("the engines are attached (engine.urls): not planned")
        return []
    if engine.backend == "embedded" and engine.device == "cpu":
        plan.notes.append("the engines run on the CPU (engine.device = 'cpu')")
        return []
    try:
        return engine_gpu_ids(engine.num_engines, engine.tp_size, cfg.cluster.engine_gpus)
    except ValueError:  # reported by the config's own checks
        return []


def fit_problems(plan: MemoryPlan, cfg: Any, shape: ModelShape) -> list[str]:
    """Each GPU (identical ones once) whose peak passes `plan.gpu_bytes`, and each SGLang
    engine whose KV pool holds less than one sequence, as a message that starts with the
    key to change."""
    import streamrl.planner.engine as engine_terms

    one_sequence = cfg.engine.max_seq_len * engine_terms.kv_bytes_per_token(
        shape, tp_size=cfg.engine.tp_size, compute_bytes=2
    )
    problems: list[str] = []
    seen: set[tuple] = set()
    for gpu in plan.gpus:
        key = _identity(gpu)
        if key in seen:
            continue
        seen.add(key)
        same = [g.name for g in plan.gpus if _identity(g) == key]
        where = names_of(same)
        for usage in gpu.usages:
            pool = usage.terms.get("kv_pool")
            if pool is not None and pool < one_sequence:
                problems.append(
                    f"engine.mem_fraction_static = {cfg.engine.mem_fraction_static}: on {where} "
                    f"SGLang's static share ({cfg.engine.mem_fraction_static} x "
                    f"{plan.gpu_bytes / GB:.1f} GB) leaves {max(pool, 0) / GB:.1f} GB of KV "
                    f"pool after {usage.terms['weights'] / GB:.1f} GB of weights, less than one "
                    f"sequence of engine.max_seq_len = {cfg.engine.max_seq_len} (docs/memory.md)"
                )
        if gpu.peak_bytes > usable_bytes(plan.gpu_bytes):
            problems.append(_too_big(gpu, where, plan, cfg))
    return problems


def usable_bytes(gpu_bytes: float) -> float:
    """What a GPU of `gpu_bytes` offers the plan (`FREE_SHARE`)."""
    return gpu_bytes * (1 - FREE_SHARE)


def _identity(gpu: GpuPlan) -> tuple:
    return tuple((usage.description, usage.peak_bytes) for usage in gpu.usages)


def _too_big(gpu: GpuPlan, where: str, plan: MemoryPlan, cfg: Any) -> str:
    """The refusal of one GPU: the first key to change, the peak, the largest terms."""
    phases = gpu.handoff_phases
    engine_turn = bool(phases) and max(phases, key=phases.get) == ENGINE_PHASE

    def phase_of(usage: Usage) -> str:
        """The phase of `usage` that the GPU's peak holds."""
        if not phases:
            return usage.peak_phase
        if usage.role == "learner":
            return SERVING if engine_turn else usage.peak_phase
        return "serve" if engine_turn else RELEASED

    terms = sorted(
        ((bytes_, name, usage.role) for usage in gpu.usages for name, bytes_ in usage.terms.items()
         if name in usage.phases[phase_of(usage)]),
        reverse=True,
    )  # fmt: skip
    keys: list[str] = []
    for _, name, _ in terms:
        for key in KEYS_FOR_TERM.get(name, ()):
            if key not in keys and _applies(key, cfg):
                keys.append(key)
    if engine_turn and cfg.learner.offload == "none":
        keys.insert(0, "learner.offload")
    elif len({u.role for u in gpu.usages}) > 1 and not phases:
        keys.insert(1, "cluster.engine_gpus")  # engines on GPUs of their own
        if not cfg.cluster.colocate and cfg.train.mode == "sync":
            keys.insert(2, "cluster.colocate")
    largest = ", ".join(f"{role} {name} {bytes_ / GB:.1f} GB" for bytes_, name, role in terms[:4])
    processes = " + ".join(
        f"{u.role} {u.peak_bytes / GB:.1f} GB ({u.peak_phase})" for u in gpu.usages
    )
    if phases:
        processes = "colocated, the larger of " + ", ".join(
            f"{name} {bytes_ / GB:.1f} GB" for name, bytes_ in phases.items()
        )
    first = keys[0] if keys else "learner.micro_batch_tokens"
    return (
        f"{first}: {where} would need {gpu.peak_bytes / GB:.1f} GB at its peak ({processes}) "
        f"but has {plan.gpu_bytes / GB:.1f} GB ({plan.gpu_bytes_source}), of which "
        f"{usable_bytes(plan.gpu_bytes) / GB:.1f} GB for the plan ({FREE_SHARE:.0%} stays "
        f"free for the allocator's cache and CUDA contexts); the largest terms: "
        f"{largest}. Lower them with {_either(keys[:4] or [first])} (docs/memory.md)"
    )


def _either(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} or {keys[-1]}"


def _applies(key: str, cfg: Any) -> bool:
    """Whether changing `key` can lower the term in this config."""
    learner = cfg.learner
    megatron = learner.backend == "megatron"
    if key == "learner.gradient_checkpointing":
        return not learner.gradient_checkpointing
    if key == "learner.megatron.recompute_layers":  # 0: every layer recomputed
        return megatron and learner.gradient_checkpointing and learner.megatron.recompute_layers > 0
    if key.startswith("learner.megatron.") or key == "learner.num_gpus":
        if key == "learner.megatron.use_distributed_optimizer":
            return megatron and not learner.megatron.use_distributed_optimizer
        return megatron
    if key == "learner.backend":
        return not megatron
    if key == "learner.lora.rank":  # (colocated engines lose the base LoRA updates need)
        return not learner.lora.rank and not cfg.cluster.colocate
    return True
