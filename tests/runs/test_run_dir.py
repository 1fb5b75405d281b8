"""A run's directory at its start (`streamrl.mains.run_dir.prepare_run_dir`): what a new run
and a resume each refuse, naming what to change."""

from __future__ import annotations

import pytest

from streamrl import checkpoint
from streamrl.config import config_from_dict
from streamrl.mains.errors import RunError
from streamrl.mains.run_dir import prepare_run_dir


def _config(run_dir):
    return config_from_dict(
        {
            "model": {"path": "random:qwen3-tiny"},
            "data": {"path": "builtin:arithmetic"},
            "train": {"output_dir": str(run_dir)},
        }
    )


def test_a_new_run_refuses_a_directory_with_another_runs_metrics_and_keeps_them(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"step": 1, "reward_mean": 0.5}\n'
    (run_dir / "metrics.jsonl").write_text(earlier)
    with pytest.raises(RunError, match=r"already holds a run's metrics\.jsonl.*train\.output_dir"):
        prepare_run_dir(_config(run_dir), run_dir, resume=False)
    assert (run_dir / "metrics.jsonl").read_text() == earlier
    assert not (run_dir / "config.toml").exists()  # refused before anything was written


def test_a_new_run_refuses_checkpoints_and_a_resume_refuses_a_directory_without_them(tmp_path):
    run_dir = tmp_path / "run"
    step = checkpoint.checkpoint_dir(run_dir) / "step_2"
    step.mkdir(parents=True)
    (step / checkpoint.STATE_FILE).write_text("{}")
    assert checkpoint.latest(run_dir) == step
    with pytest.raises(RunError, match=r"already holds checkpoints: pass --resume"):
        prepare_run_dir(_config(run_dir), run_dir, resume=False)
    empty = tmp_path / "empty"
    with pytest.raises(RunError, match="--resume: no checkpoint under"):
        prepare_run_dir(_config(empty), empty, resume=True)
