"""Checkpoints: `run_dir/checkpoints/step_NNNNNN/` with the model (Hugging Face format),
the optimizer, and `state.json` (step, version, data position).

A checkpoint directory is written under a temporary name and renamed when
complete, so `latest()` never returns a half-written one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "state.json"


@dataclass
class TrainState:
    step: int = 0
    """Training steps completed."""
    version: int = 0
    """Weight version of the saved model (steps completed, counting from the start version)."""
    next_seq: int = 0
    """Data position: every prompt seq below this is done (trained or deliberately dropped)."""
    skip: list[int] = field(default_factory=list)
    """Done seqs at or above next_seq."""
    samples_trained: int = 0


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def read_state(path: Path) -> TrainState:
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def save(run_dir: Path, state: TrainState, write_model, *, keep: int) -> Path:
    """Write a checkpoint with `write_model(directory)` and keep the newest `keep`."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{state.step:06d}"
    partial = root / f".partial_step_{state.step:06d}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_model(partial)
    (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
