"""`streamrl from-slime`: slime command lines become configs that `streamrl check` accepts.

tests/data/slime/ holds the seed's three command lines verbatim (Quick Start, the 8-GPU
GRPO workflow, the asynchronous workflow), a `scripts/models/qwen3-4B.sh` of Qwen3-4B's
MODEL_ARGS that they source, and the seed's two data formats (plain and chat prompts).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.check import find_problems
from streamrl.cli import build_parser
from streamrl.compat.slime.command_line import convert, from_slime_command
from streamrl.compat.slime.scripts import read_command, split_flags
from streamrl.compat.slime.written import render
from streamrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "slime"
SEED = {"quick_start": "data.jsonl", "grpo_8gpu": "chat.jsonl", "async": "data.jsonl"}


def from_slime(*argv: str) -> int:
    return from_slime_command(build_parser().parse_args(["from-slime", *argv]))


def accounted_for(conversion, flags) -> set[str]:
    """The flags of `flags` that the conversion neither mapped nor listed as not mapped."""
    used = {source for sources in conversion.sources.values() for source in sources}
    listed = {text for text, _ in conversion.not_mapped}
    missing = set()
    for flag, values in flags:
        text = " ".join([flag, *values])
        if text not in listed and not any(flag in source for source in used):
            missing.add(text)
    return missing


@pytest.mark.parametrize("name", sorted(SEED))
def test_the_seeds_command_lines_convert_and_pass_streamrl_check(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / f"{name}.toml"
    data = f"data.path=tests/data/slime/{SEED[name]}"
    assert from_slime(str(DATA / f"{name}.sh"), "--out", str(out), "--set", data) == 0
    cfg = load_config(out)
    assert find_problems(cfg, models=True) == []
    assert cfg.model.path == "configs/models/qwen3-4b"  # the sourced model script's shape
    assert cfg.learner.backend == "megatron" and cfg.engine.backend == "sglang"
    assert cfg.train.mode == ("async" if name == "async" else "sync")
    command = read_command([DATA / f"{name}.sh"])
    assert accounted_for(convert(command), split_flags(command.words)) == set()
    text = out.read_text()
    assert "--num-layers 36" in text and "model shape" in text  # listed with its reason
    assert "the 9 shape flags with a config.json field agree" in text


def test_the_quick_start_keeps_slimes_numbers_and_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "quick_start.toml"
    assert from_slime(str(DATA / "quick_start.sh"), "--out", str(out)) == 0
    cfg = load_config(out)
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt) == (32, 8)
    assert (cfg.learner.global_batch_size, cfg.train.steps) == (256, 3000)
    assert cfg.algorithm.kl_loss_coef == 0.001 and cfg.algorithm.loss_aggregation == "seq_mean"
    assert cfg.learner.num_gpus == 4 and cfg.engine.num_engines == 4
    assert cfg.cluster.engine_gpus == [4, 5, 6, 7] and cfg.cluster.launcher == "local"
    assert not cfg.data.apply_chat_template  # slime applies no template without the flag
    assert "${CKPT_ARGS[@]}: not expanded" in out.read_text()


def test_a_command_line_after_double_dash_takes_model_args_from_a_script(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "argv.toml"
    model_script = str(DATA / "scripts" / "models" / "qwen3-4B.sh")
    argv = [
        "python", "train_async.py", "--hf-checkpoint", "configs/models/qwen3-4b",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "4", "--colocate",
        "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8",
        "--rollout-num-gpus-per-engine", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--custom-generate-function-path", "slime_functions.tool_turns",
        "--custom-rm-path", "slime_functions.rank_in_group", "--group-rm",
        "--sglang-enable-dp-attention", "--attention-dropout", "0.0", "--no-such-flag", "3",
        "--prompt-data", "tests/data/slime/data.jsonl", "${MODEL_ARGS[@]}", "--num-layers", "28",
    ]  # fmt: skip
    assert from_slime("--out", str(out), model_script, "--", *argv) == 0
    cfg = load_config(out)
    assert cfg.rollout.generate_fn == "streamrl.compat.slime:generate_group"
    assert dict(cfg.rollout.generate_kwargs) == {
        "function": "slime_functions.tool_turns",
        "reward": "slime_functions:rank_in_group".replace(":", "."),
        "group_reward": True,
    }
    assert (cfg.engine.num_engines, cfg.engine.tp_size) == (4, 2)
    assert cfg.cluster.engine_gpus == list(range(8))  # --colocate: the learner's GPUs
    assert not cfg.cluster.colocate  # train_async.py: slime refuses --colocate there
    assert cfg.learner.megatron.tensor_parallel_size == 2
    assert cfg.engine.extra_args == ["--enable-dp-attention"]
    text = out.read_text()
    assert "--no-such-flag 3: no streamrl counterpart" in text
    assert "--attention-dropout 0.0: RL trains without dropout" in text
    # The command line says 28 layers, the config.json 36: the shape comes from the latter.
    notes = convert(read_command([model_script], argv)).notes
    assert any(n.startswith("MODEL_ARGS --num-layers 28 but") for n in notes), notes
    assert any(n.endswith("num_hidden_layers = 36") for n in notes)


def test_every_flag_is_either_mapped_or_listed_with_a_reason():
    words = [
        "--lr", "1e-6", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--use-tis",
        "--advantage-estimator", "gspo", "--rm-type", "deepscaler", "--optimizer", "adam",
        "--eval-prompt-data", "aime", "/data/aime.jsonl", "--n-samples-per-eval-prompt", "4",
        "--eval-max-response-len", "2048", "--recompute-granularity", "full",
        "--update-weights-interval", "2", "--kl-loss-coef", "0.01", "--wandb-key", "k",
        "--debug-rollout-only", "--use-wandb", "--some-new-flag",
    ]  # fmt: skip
    conversion = convert(read_command([], ["python", "train.py", *words]))
    assert accounted_for(conversion, split_flags(words)) == set()
    reasons = dict(conversion.not_mapped)
    assert "without --use-kl-loss" in reasons["--kl-loss-coef 0.01"]
    assert "no built-in reward" in reasons["--rm-type deepscaler"]
    assert "--some-new-flag" in reasons
    assert conversion.get("algorithm.loss") == "gspo"
    assert conversion.get("algorithm.off_policy_correction") == "tis"
    assert conversion.get("train.mode") == "rollout_only"
    assert conversion.get("eval.datasets") == [
        {
            "name": "aime",
            "path": "/data/aime.jsonl",
            "n_samples_per_prompt": 4,
            "sampling": {"max_new_tokens": 2048},
        }
    ]


def test_ppo_becomes_gae_with_its_critic_on_the_megatron_learner(tmp_path):
    words = [
        "--advantage-estimator", "ppo", "--critic-load", "/ckpt/critic", "--critic-lr", "2e-6",
        "--value-clip", "0.3", "--lambd", "0.95", "--tensor-model-parallel-size", "2",
        "--actor-num-gpus-per-node", "2", "--prompt-data", "/data/train.jsonl",
        "--hf-checkpoint", "/models/Qwen3-4B",
    ]  # fmt: skip
    conversion = convert(read_command([], ["python", "train_async.py", *words]))
    assert accounted_for(conversion, split_flags(words)) == set()
    assert not conversion.not_mapped, conversion.not_mapped
    out = tmp_path / "ppo.toml"
    out.write_text(render(conversion, source="test"))
    cfg = load_config(out)
    assert cfg.algorithm.advantage_estimator == "gae" and cfg.learner.backend == "megatron"
    assert (cfg.learner.critic.path, cfg.learner.critic.lr) == ("/ckpt/critic", 2e-6)
    assert (cfg.algorithm.value_clip, cfg.algorithm.lam) == (0.3, 0.95)
    assert cfg.learner.megatron.tensor_parallel_size == 2


def test_the_command_runs_as_streamrl_from_slime_and_prints_the_config(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "streamrl", "from-slime", str(DATA / "async.sh")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert 'mode = "async"  # train_async.py' in result.stdout
    assert "mapped:" in result.stderr and "slime flags with no streamrl key (15)" in result.stderr


def test_colocate_with_train_py_becomes_colocated_sync_with_the_learner_offloaded():
    words = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--colocate"]
    conversion = convert(read_command([], ["python", "train.py", *words]))
    assert conversion.get("cluster.colocate") is True
    assert conversion.get("train.mode") == "sync"
    assert conversion.get("learner.offload") == "all"
    assert conversion.get("cluster.engine_gpus") == [0]


def test_recompute_flags_map_block_recompute_to_the_layers_of_a_stage():
    def converted(*words: str):
        return convert(read_command([], ["python", "train.py", *words]))

    block = converted(
        "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "12",
    )  # fmt: skip
    assert block.get("learner.gradient_checkpointing") is True
    assert block.get("learner.megatron.recompute_layers") == 12
    uniform = converted(
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "4",
    )  # fmt: skip
    assert uniform.get("learner.megatron.recompute_layers") is None
    assert any("uniform --recompute-num-layers 4" in note for note in uniform.notes)
    alone = converted("--recompute-method", "block", "--recompute-num-layers", "2")
    assert alone.get("learner.gradient_checkpointing") is None
    assert "--recompute-method block" in dict(alone.not_mapped)
