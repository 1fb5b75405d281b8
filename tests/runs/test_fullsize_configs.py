"""The H200 configs of issue 27 (bench/configs/gpu_fullsize_*.toml) run on the CPU with the
tiny shape, embedded engines and the torch learner in place of the full-size model, SGLang
and Megatron: what bench/gpu/fullsize_h200.sh runs, short of the GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import step_records, streamrl_run

from streamrl.config import dump_toml, load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

ON_THE_CPU = [
    'model.path="random:qwen3-tiny"',
    'engine.backend="embedded"',
    "engine.extra_args=[]",
    "engine.num_threads=1",
    "engine.max_batch_size=16",
    "engine.max_seq_len=256",
    'learner.backend="torch"',
    "learner.micro_batch_tokens=512",
    "learner.gradient_checkpointing=false",
    'weights.transport="auto"',
    "cluster.learner_gpus=[]",
    "rollout.batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.sampling.max_new_tokens=24",
    "train.steps=3",
]


def tiny_version(name: str, tmp_path: Path, *overrides: str) -> Path:
    """bench/configs/`name` with the CPU's stand-ins, written to tmp_path/run.toml."""
    out = tmp_path / "out"
    cfg = load_config(
        REPO / "bench" / "configs" / name,
        [*ON_THE_CPU, f'train.output_dir="{out}"', *overrides],
    )
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(cfg))
    return path


def test_the_router_config_runs_two_engines_behind_the_router_and_both_versions_advance(
    tmp_path,
):
    config = tiny_version(
        "gpu_fullsize_router.toml",
        tmp_path,
        "cluster.engine_gpus=[]",
        'rollout.generate_kwargs={reward="confidence", response_tokens=[4, 24]}',
    )
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert [r["version"] for r in step_records(out)] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["engine_versions"].values()) == [3, 3]  # both engines took every push
    engines = json.loads((out / "engines.json").read_text())
    assert engines["router"] and len(engines["engines"]) == 2
    lengths = {r["response_len_generated_mean"] for r in step_records(out)}
    assert all(4 <= n <= 24 for n in lengths)  # each sample's own budget, ignore_eos
    assert {"engine 0", "engine 1", "learner rank 0"} <= set(summary["memory"]["processes"])
    report = subprocess.run(
        [sys.executable, "bench/gpu/fullsize_report.py", str(out), "--json", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    figures = json.loads((tmp_path / "r").read_text())
    assert figures["steps"] == 3 and len(figures["mfu_6n_trained_tokens"]["per_step"]) == 3
    assert figures["weights_num_engines"][-1] == 2 and figures["trained_tokens_per_s"] > 0
    assert all(s > 0 for s in figures["train_phases_s"]["train/update_s"])  # each step's update


def test_the_h200_script_names_configs_that_exist_and_the_keys_it_sets_on_them_load():
    script = (REPO / "bench/gpu/fullsize_h200.sh").read_text()
    names = set(re.findall(r"bench/configs/(gpu_fullsize_\w+\.toml)", script))
    assert names == {
        "gpu_fullsize_async4b.toml",
        "gpu_fullsize_checkpoint.toml",
        "gpu_fullsize_router.toml",
    }
    for name in names:
        cfg = load_config(REPO / "bench" / "configs" / name)
        assert cfg.buffer.max_staleness == 1 and cfg.learner.backend == "megatron"
    router = load_config(REPO / "bench/configs/gpu_fullsize_router.toml")
    assert router.engine.num_engines == 2 and router.cluster.engine_gpus == [0, 0]
    assert router.engine.mem_fraction_static <= 0.4
