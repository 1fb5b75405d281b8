"""`train.mode = "train_only"`: the trainer without engines or a rollout process.

    rollouts/step_000001.msgpack ... ─► ReplayIntake ─► LearnerLoop (no publisher) ─► checkpoints

The learner loop is the one of the other modes (`Trainer.learner_loop`); only its step
source differs (`streamrl.queues.source.StepSource`).

Step k trains on the groups saved for step k (by `rollout_only` or `train.save_rollouts`),
in the order the run that saved them trained them, so a replay on the CPU from the same
initial model reproduces that run's losses. A resume continues at the next file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio

from streamrl import checkpoint
from streamrl.queues.rollout_files import ReplayIntake


async def run_replay(
    trainer: Any,
    intake: ReplayIntake,
    state: checkpoint.TrainState,
    model_path: str,
    resume_from: Path | None,
) -> dict[str, Any]:
    """`train_only`: train on the saved groups of `train.load_rollouts`, step k on file
    k; no engines, no rollout process, no weight pushes. Checkpoints as usual, so a
    resume continues at the next file. `trainer` is the run's `Trainer` (its learner
    ranks, metrics and checkpoints); `intake` was checked to hold every step."""
    from streamrl.backends.build import learner_devices

    cfg = trainer.cfg
    device, dtype = learner_devices(cfg)
    trainer.start_learner_ranks(model_path, device)
    backend = trainer.lead(await anyio.to_thread.run_sync(trainer.build_learner, device, dtype))
    if resume_from is not None:
        await anyio.to_thread.run_sync(backend.load, resume_from)
    metrics = trainer.metrics_writer()
    started = time.monotonic()
    try:
        loop = trainer.learner_loop(backend, intake, None, state, metrics)
        await loop.run()
        if not cfg.train.save_interval or loop.state.step % cfg.train.save_interval:
            await loop.save()
    finally:
        metrics.close()
    if trainer.leader is not None:
        trainer.leader.close()
        await anyio.to_thread.run_sync(trainer.ranks.wait, 120.0)
    summary = {
        "steps": loop.state.step,
        "version": loop.version,
        "wall_s": time.monotonic() - started,
        "replayed_from": str(intake.directory),
        **intake.summary(),
    }
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
