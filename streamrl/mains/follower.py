"""A learner rank > 0 of a run: `streamrl _learner --run-dir DIR`.

With `learner.num_gpus` > 1 (the Megatron backend), the trainer process is rank
0 and starts ranks 1..N-1 (here, or in Ray actors on other nodes:
`streamrl.mains.ranks`) with their rank in the environment (`RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`: `streamrl.backends.rendezvous`).
Each builds the same backend from the model in `learner.json` (a
`LearnerSpec`) and mirrors rank 0's calls until rank 0 says stop
(`streamrl.backends.ranks.follow`); the publisher of a pipeline stage > 0 also
serves its stage's weight broadcasts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

import streamrl
from streamrl.config import load_config

log = logging.getLogger(__name__)

SPEC_FILE = "learner.json"
NODE_IP_ENV = "STREAMRL_NODE_IP"
"""Set by the Ray launcher for each process it starts: the IP of the node it runs on."""


class LearnerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every learner rank loads, decided when the run starts."""

    model_path: str
    """The model (the initial one, or the checkpoint a resume starts from)."""
    reference_path: str = ""
    """The KL reference model: the run's initial model (empty: `model_path`)."""


def write_spec(run_dir: Path, spec: LearnerSpec) -> Path:
    path = run_dir / SPEC_FILE
    path.write_bytes(msgspec.json.encode(spec) + b"\n")
    return path


def follower_command(args) -> int:
    import torch

    from streamrl.backends.build import build_backend, learner_devices
    from streamrl.backends.ranks import follow
    from streamrl.backends.rendezvous import init_distributed, shutdown
    from streamrl.backends.step import make_loss_fn, make_value_loss_fn

    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.toml")
    spec = msgspec.json.decode((run_dir / SPEC_FILE).read_bytes(), type=LearnerSpec)
    device, dtype = learner_devices(cfg)
    rank, world_size = init_distributed(device=device.type)
    log.info(
        "learner rank %d of %d joined %s:%s (streamrl from %s)",
        rank,
        world_size,
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
        Path(streamrl.__file__).parent,
    )
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    backend = build_backend(
        cfg, spec.model_path, device, dtype, reference_path=spec.reference_path or None
    )
    try:
        # A pipeline stage's publisher is reached at this node's IP under Ray (other ranks
        # and engines may be on other nodes), else where rank 0's weight group listens.
        stage_host = os.environ.get(NODE_IP_ENV) or cfg.weights.master_address
        follow(
            backend,
            make_loss_fn(cfg),
            value_loss_fn=make_value_loss_fn(cfg),
            stage_host=stage_host,
        )
    finally:
        shutdown()
    return 0
