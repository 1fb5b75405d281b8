"""What Ray is asked for: one bundle per component process, and the GPUs a Ray instance of
the run's own may hand out. No Ray import here: these are decisions on the config."""

from __future__ import annotations

import contextlib
import os

from streamrl.config import RunConfig


def gpus_for_own_instance(cfg: RunConfig) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a Ray instance of the run's own: this machine's visible GPUs
    without the learner's (`cluster.learner_gpus`, entries of the visible list); None keeps
    the environment as it is (a CPU learner, or no GPU here)."""
    import torch

    if cfg.learner.device == "cpu" or not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        devices = [str(index) for index in range(torch.cuda.device_count())]
    else:
        devices = [device.strip() for device in visible.split(",") if device.strip()]
    learner = {devices[index] for index in cfg.learner_gpu_ids if index < len(devices)}
    return ",".join(device for device in devices if device not in learner)


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
    `engine.urls`), then `rollout`. The learner is not placed: it is `streamrl run` itself."""
    engine: dict[str, float] = {"CPU": 1.0}
    if engines_on_gpu:
        engine = {"GPU": float(cfg.engine.tp_size), "CPU": 1.0}
    num_engines = 0 if cfg.engine.urls else cfg.engine.num_engines
    bundles = {f"engine-{index}": dict(engine) for index in range(num_engines)}
    bundles["rollout"] = {"CPU": 1.0}
    return bundles
