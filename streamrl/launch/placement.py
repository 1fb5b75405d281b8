"""What Ray is asked for: one bundle per component process, the GPUs a Ray instance of the
run's own may hand out, and the order of learner ranks over the nodes Ray chose. No Ray
import here: these are decisions on the config and on where the bundles landed."""

from __future__ import annotations

import contextlib
import os

from streamrl.config import RunConfig


def gpus_for_own_instance(cfg: RunConfig) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a Ray instance of the run's own: this machine's visible GPUs
    without learner rank 0's (`cluster.learner_gpus[0]`, an entry of the visible list; the
    other ranks are Ray's to place); None keeps the environment as it is (a CPU learner, or
    no GPU here)."""
    import torch

    if cfg.learner.device == "cpu" or not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        devices = [str(index) for index in range(torch.cuda.device_count())]
    else:
        devices = [device.strip() for device in visible.split(",") if device.strip()]
    rank0 = (cfg.cluster.learner_gpus or [0])[0]  # ranks > 0 take GPUs from Ray
    return ",".join(device for index, device in enumerate(devices) if index != rank0)


@contextlib.contextmanager
def environ_set(name: str, value: str | None):
    """`os.environ[name] = value` inside the block (None: leave it alone)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def engines_use_gpus(cfg: RunConfig, *, cluster_has_gpus: bool) -> bool:
    """SGLang engines always; embedded ones on `cuda`, or on `auto` when the cluster has GPUs."""
    if cfg.engine.backend == "sglang" or cfg.engine.device == "cuda":
        return True
    return cfg.engine.device == "auto" and cluster_has_gpus


def placement_bundles(cfg: RunConfig, *, engines_on_gpu: bool) -> dict[str, dict[str, float]]:
    """Component name -> Ray bundle, in bundle order: `engine-0..` (none for attached
    `engine.urls`), then `rollout`. Learner rank 0 is not placed: it is `streamrl run`
    itself; the other ranks have a placement group of their own (`learner_bundles`)."""
    engine: dict[str, float] = {"CPU": 1.0}
    if engines_on_gpu:
        engine = {"GPU": float(cfg.engine.tp_size), "CPU": 1.0}
    engine.update(cfg.cluster.ray_engine_resources)
    num_engines = 0 if cfg.engine.urls else cfg.engine.num_engines
    bundles = {f"engine-{index}": dict(engine) for index in range(num_engines)}
    bundles["rollout"] = {"CPU": 1.0}
    return bundles


def learner_on_gpu(cfg: RunConfig) -> bool:
    """Whether the learner ranks train on CUDA (`learner.device`, `auto` as this machine has)."""
    from streamrl.models.devices import resolve_device

    return resolve_device(cfg.learner.device).type == "cuda"


def num_placed_ranks(cfg: RunConfig) -> int:
    """Learner ranks Ray places: 1..N-1 of a Megatron learner that trains (rank 0 is here)."""
    is_training = cfg.train.mode != "rollout_only"
    if cfg.learner.backend != "megatron" or not is_training:
        return 0
    return cfg.learner.num_gpus - 1


def learner_bundles(cfg: RunConfig, *, on_gpu: bool) -> list[dict[str, float]]:
    """One bundle per learner rank 1..N-1: `{"GPU": 1, "CPU": k}` on CUDA, `{"CPU": k}` on
    CPU (k = cluster.ray_learner_cpus_per_rank), plus cluster.ray_learner_resources."""
    bundle = {"CPU": float(cfg.cluster.ray_learner_cpus_per_rank)}
    if on_gpu:
        bundle = {"GPU": 1.0, **bundle}
    bundle.update(cfg.cluster.ray_learner_resources)
    return [dict(bundle) for _ in range(num_placed_ranks(cfg))]


def num_pinned_ranks(cfg: RunConfig) -> int:
    """Ranks 1..TP-1 form rank 0's tensor-parallel group: their bundles must be on rank 0's
    node (Megatron numbers ranks TP first, so each TP group is consecutive ranks)."""
    return min(cfg.learner.megatron.tensor_parallel_size - 1, num_placed_ranks(cfg))


def rank_order(bundle_nodes: list[str], driver_node: str) -> list[int]:
    """Bundle indices in rank order (the first is rank 1): bundles on the driver's node
    first, then node by node in the order of each node's first bundle, bundle order within
    a node. Consecutive ranks then share a node wherever the nodes allow."""
    nodes = [driver_node]
    for node in bundle_nodes:
        if node not in nodes:
            nodes.append(node)
    return sorted(range(len(bundle_nodes)), key=lambda i: (nodes.index(bundle_nodes[i]), i))


def split_tp_groups(rank_nodes: list[str], tp_size: int) -> list[str]:
    """Problems with ranks in rank order (`rank_nodes[r]`: rank r's node): each tensor-parallel
    group (ranks [g * tp_size, (g + 1) * tp_size)) must lie on one node."""
    problems = []
    for start in range(0, len(rank_nodes), tp_size):
        nodes = rank_nodes[start : start + tp_size]
        if len(set(nodes)) > 1:
            problems.append(
                f"ranks {start}-{start + tp_size - 1} are on nodes {sorted(set(nodes))}"
            )
    return problems
