"""A run's directory at its start: checked and filled, or read for what to resume.

    run_dir/config.toml              the resolved config, written at every start
    run_dir/initial_model/           a `random:` model, written once so every process (and the
                                     KL reference on every resume) loads the same weights
    run_dir/checkpoints/step_N/      what `--resume` restores (`streamrl.checkpoint`): the
                                     policy, the train state, the asynchronous state, the RNGs
    run_dir/metrics.jsonl            appended by `metrics_writer`

A new run refuses a directory that holds checkpoints or another run's metrics.jsonl (its
records would be mixed with the new run's); `--resume` refuses one without checkpoints. The
user's code the buffer runs (filters) is imported here, before any process starts, so a
mistake names its config key at once.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl import checkpoint
from streamrl.config import ConfigError, RunConfig, dump_toml
from streamrl.mains.errors import RunError
from streamrl.metrics import MetricsWriter
from streamrl.queues.intake import IntakeState
from streamrl.types import make_decoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunStart:
    """Where a run starts: its train state, the model every process loads, the checkpoint
    to restore (None for a new run) and that checkpoint's asynchronous state."""

    state: checkpoint.TrainState
    model_path: str
    resume_from: Path | None = None
    async_state: IntakeState | None = None


def prepare_run_dir(cfg: RunConfig, run_dir: Path, *, resume: bool) -> RunStart:
    """Check and fill `run_dir` (see the module docstring); RunError when `resume` finds
    nothing to resume, or a new run finds checkpoints. A resume restores the RNG states."""
    latest = checkpoint.latest(run_dir)
    if resume and latest is None:
        raise RunError(f"--resume: no checkpoint under {run_dir}/checkpoints")
    if not resume and latest is not None:
        raise RunError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, "
            f"or set train.output_dir to a new directory"
        )
    if not resume and (run_dir / MetricsWriter.FILE).exists():
        raise RunError(
            f"{run_dir} already holds a run's {MetricsWriter.FILE} (and no checkpoint to "
            f"resume): set train.output_dir to a new directory, or remove that one"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    if latest is None:
        return RunStart(checkpoint.TrainState(), initial_model(cfg, run_dir))
    state = checkpoint.read_state(latest)
    log.info("resuming from %s: step %d, version %d", latest, state.step, state.version)
    async_state = None
    if (latest / checkpoint.ASYNC_STATE_FILE).exists():
        data = (latest / checkpoint.ASYNC_STATE_FILE).read_bytes()
        async_state = make_decoder(IntakeState).decode(data)
    if (latest / checkpoint.RNG_FILE).exists():
        checkpoint.restore_rng((latest / checkpoint.RNG_FILE).read_bytes())
    # A LoRA checkpoint holds only the adapters: the base is the initial model.
    model_path = initial_model(cfg, run_dir) if cfg.learner.lora.is_enabled else str(latest)
    return RunStart(state, model_path, latest, async_state)


def load_user_code(cfg: RunConfig) -> list[Any]:
    """Import the filters (and check the W&B and peft packages) before anything starts: a
    ConfigError names the key. Returns the (name, filter) pairs of `buffer.filters`."""
    from streamrl.mains.filters import load_filters

    buffer = cfg.buffer
    try:
        filters = load_filters(
            buffer.filters,
            min_response_tokens=buffer.min_response_tokens,
            max_response_tokens=buffer.max_response_tokens,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb = true needs the wandb package: pip install 'streamrl[wandb]'"
        )
    lora_with_peft = cfg.learner.lora.is_enabled and cfg.learner.backend == "torch"
    if lora_with_peft and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "learner.lora with learner.backend = 'torch' needs the peft package: "
            "pip install 'streamrl[lora]'"
        )
    return filters


def initial_model(cfg: RunConfig, run_dir: Path) -> str:
    """The model every process loads; a `random:` model is written once so all agree."""
    path = cfg.model.path
    if not path.startswith("random:"):
        return path
    from streamrl.models import save_random_model

    target = run_dir / "initial_model"
    if not (target / "config.json").exists():
        save_random_model(path.removeprefix("random:"), target, seed=cfg.model.seed)
    return str(target)


def metrics_writer(cfg: RunConfig, run_dir: Path) -> MetricsWriter:
    """The run's metrics writer: `metrics.jsonl`, and TensorBoard, the progress line and
    W&B as `logging` says."""
    logging_cfg = cfg.logging
    wandb = None
    if logging_cfg.wandb:
        from streamrl.config import to_toml_dict

        wandb = {
            "project": logging_cfg.wandb_project,
            "name": logging_cfg.wandb_name,
            "mode": logging_cfg.wandb_mode,
            "config": to_toml_dict(cfg),
        }
    return MetricsWriter(
        run_dir,
        tensorboard=logging_cfg.tensorboard,
        progress=logging_cfg.progress,
        wandb=wandb,
    )
