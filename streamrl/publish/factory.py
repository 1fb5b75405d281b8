"""The run's weight publisher and its transport, chosen from the config.

    learner.lora on and engine.backend = "sglang"  ─► AdapterFileTransport (run_dir/adapters)
    weights.transport resolved to "ipc"            ─► IpcTransport
    "nccl" or "gloo"                               ─► GroupTransport (+ pipeline stages 1..PP-1
                                                      when the learner has stage publishers)

`weights.transport = "auto"` is resolved by `RunConfig.weight_transport` from where the
learner and the engines run. The staging buffers live on the learner's device when the
tensors leave from there (nccl, ipc), else in host memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from streamrl.config import RunConfig
from streamrl.fleet.client import EngineClient
from streamrl.publish.adapter_files import AdapterFileTransport
from streamrl.publish.group_transport import GroupTransport
from streamrl.publish.ipc_transport import IpcTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.publish.transport import WeightSource, WeightTransport
from streamrl.weights.stages import RemoteStages

IPC = "ipc"
"""The resolved `weights.transport` of engines on the learner's own device."""


def weight_publisher(
    cfg: RunConfig,
    *,
    weights: WeightSource,
    members: Callable[[], list[EngineClient]],
    on_published: Callable[[int], Awaitable[None]],
    device: torch.device,
    master_address: str,
    adapter_directory: Path,
    base_model: str = "",
    leader: Any = None,
) -> WeightPublisher:
    """The publisher of a run whose learner stages on `device`; `master_address` is where
    the engines reach this process, `leader` the `streamrl.backends.ranks.Leader` of a
    learner with several ranks (None with one)."""
    kind = cfg.weight_transport(device.type)
    transport = weight_transport(
        cfg,
        kind,
        members=members,
        master_address=master_address,
        adapter_directory=adapter_directory,
        base_model=base_model,
        stages=remote_stages(leader, kind),
    )
    return WeightPublisher(
        weights=weights,
        members=members,
        on_published=on_published,
        transport=transport,
        bucket_bytes=cfg.weights.bucket_bytes,
        pause_mode=cfg.pause_mode,
        staging_device=str(device) if cfg.stages_weights_on_device(device.type) else "cpu",
    )


def weight_transport(
    cfg: RunConfig,
    kind: str,
    *,
    members: Callable[[], list[EngineClient]],
    master_address: str,
    adapter_directory: Path,
    base_model: str = "",
    stages: RemoteStages | None = None,
) -> WeightTransport:
    """The transport of `cfg` whose `weights.transport` resolved to `kind` (see the module
    docstring)."""
    lora = cfg.learner.lora
    if lora.is_enabled and cfg.engine.backend == "sglang":
        if stages is not None:
            raise ValueError("adapters as files come from one pipeline stage only")
        return AdapterFileTransport(
            directory=adapter_directory,
            rank=lora.rank,
            target_modules=tuple(lora.target_modules),
            base_model=base_model,
        )
    return tensor_transport(
        kind,
        members=members,
        flattened=cfg.weights.flattened_buckets,
        master_address=master_address,
        stages=stages,
    )


def tensor_transport(
    kind: str,
    *,
    members: Callable[[], list[EngineClient]],
    flattened: bool = True,
    master_address: str = "127.0.0.1",
    stages: RemoteStages | None = None,
) -> WeightTransport:
    """Tensors to the engines: by CUDA IPC handle (`kind` "ipc"), else over weight-update
    groups whose torch.distributed backend is `kind` ("nccl" or "gloo")."""
    if kind == IPC:
        if stages is not None:
            raise ValueError("weights by reference (ipc) cannot carry pipeline stages")
        return IpcTransport()
    return GroupTransport(
        members=members,
        backend=kind,
        master_address=master_address,
        flattened=flattened,
        stages=stages,
    )


def remote_stages(leader: Any, kind: str) -> RemoteStages | None:
    """Pipeline stages 1..PP-1 publish from their own ranks (None without PP)."""
    if leader is None or not leader.stage_publisher_ranks:
        return None
    return RemoteStages(leader, staging="cuda" if kind == "nccl" else "cpu")
