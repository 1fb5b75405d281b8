"""Checkpoints: `run_dir/checkpoints/step_NNNNNN/` with the model (Hugging Face format),
the optimizer, `state.json` (step, version, data position), the run's asynchronous state
(`async_state.msgpack`: the buffer, every prompt's fate, the groups in flight with their
tokens; `streamrl.queues.intake.IntakeState`) and the learner process's random states
(`rng.msgpack`).

A checkpoint directory is written under a temporary name (`.partial_step_NNNNNN`) and
renamed when complete, so `latest()` never returns a half-written one; a run writes them
in the background (`streamrl.actors.checkpoints`), and the next one removes any partial
directory a stopped process left behind.
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
    staleness_bound: int | None = None
    """The bound `buffer.max_staleness = "auto"` had set (None: a fixed bound)."""


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


def save(
    run_dir: Path,
    state: TrainState,
    write_model,
    *,
    keep: int,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write a checkpoint with `write_model(directory)` and `files` (name -> bytes, e.g. the
    async state), and keep the newest `keep`."""
    partial = begin(run_dir, state.step)
    write_model(partial)
    return complete(run_dir, state, partial, keep=keep, files=files)


def begin(run_dir: Path, step: int) -> Path:
    """The empty temporary directory of the checkpoint of `step` (partial directories left by
    a stopped process are removed: a run has at most one checkpoint in flight)."""
    root = checkpoint_dir(run_dir)
    for stale in root.glob(".partial_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".partial_step_{step:06d}"
    partial.mkdir(parents=True)
    return partial


def complete(
    run_dir: Path,
    state: TrainState,
    partial: Path,
    *,
    keep: int,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Add `files` and `state.json` to the model in `partial`, rename it into place, keep the
    newest `keep`; returns the checkpoint's directory."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{state.step:06d}"
    for name, data in (files or {}).items():
        (partial / name).write_bytes(data)
    (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def size_bytes(path: Path) -> int:
    """Bytes of every file under a checkpoint directory."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


ASYNC_STATE_FILE = "async_state.msgpack"
RNG_FILE = "rng.msgpack"


def rng_state() -> bytes:
    """This process's random states (Python, NumPy, torch CPU and CUDA) as msgpack."""
    import random

    import msgspec
    import numpy as np
    import torch

    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [kind, keys.tolist(), position, has_gauss, gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available()
        else [],
    }
    return msgspec.msgpack.encode(state)


def restore_rng(data: bytes) -> None:
    """Put back what `rng_state` saved (CUDA states only where this process sees the GPUs)."""
    import random

    import msgspec
    import numpy as np
    import torch

    state = msgspec.msgpack.decode(data)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
