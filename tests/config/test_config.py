"""Config loading: strict validation with file and dotted key, overrides (the shipped configs
and the generated docs page: tests/house/test_docs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.config import ConfigError, dump_toml, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text('[data]\npath = "builtin:arithmetic"\n' + text)
    return path


def streamrl_check(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "check", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_rejects_an_unknown_key_naming_the_file_and_dotted_key(tmp_path):
    path = write(tmp_path, "[rollout.sampling]\ntemprature = 0.7\n")
    result = streamrl_check(path)
    assert result.returncode != 0
    assert str(path) in result.stderr
    assert "rollout.sampling.temprature" in result.stderr
    assert "unknown key" in result.stderr


def test_check_rejects_a_string_where_a_number_belongs(tmp_path):
    path = write(tmp_path, '[rollout]\nbatch_size = "eight"\n')
    result = streamrl_check(path)
    assert result.returncode != 0
    assert str(path) in result.stderr and "rollout.batch_size" in result.stderr
    assert "Expected `int`" in result.stderr


def test_check_rejects_out_of_range_values(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.top_p"):
        load_config(write(tmp_path, "[rollout.sampling]\ntop_p = 1.5\n"))


def test_check_prints_the_resolved_config_which_loads_back_identically(tmp_path):
    path = write(tmp_path, "[rollout]\nbatch_size = 16\n")
    result = streamrl_check(path, "--set", "buffer.max_staleness=3")
    assert result.returncode == 0, result.stderr
    again = tmp_path / "resolved.toml"
    again.write_text(result.stdout)
    assert load_config(again) == load_config(path, ["buffer.max_staleness=3"])


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, "")
    assert load_config(path, ["rollout.batch_size=3"]).rollout.batch_size == 3
    assert load_config(path, ["model.path=random:qwen3-tiny"]).model.path == "random:qwen3-tiny"
    with pytest.raises(ConfigError, match=r"rollout\.batch_sise: unknown key"):
        load_config(path, ["rollout.batch_sise=3"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(path, ["rollout.batch_size"])


def test_async_with_staleness_and_no_correction_is_refused_naming_the_options(tmp_path):
    path = write(tmp_path, '[algorithm]\noff_policy_correction = "none"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for option in (
        "algorithm.off_policy_correction",
        "buffer.max_staleness",
        "train.mode",
        "algorithm.allow_uncorrected_async",
    ):
        assert option in message
    # Each way out named by the message is accepted.
    load_config(path, ["buffer.max_staleness=0"])
    load_config(path, ["train.mode='sync'"])
    load_config(path, ["algorithm.allow_uncorrected_async=true"])


def test_derived_values_follow_their_formulas(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "[rollout]\nbatch_size = 4\nn_samples_per_prompt = 8\n"
            "[buffer]\nmax_staleness = 2\n[learner]\nglobal_batch_size = 16\n",
        )
    )
    assert cfg.buffer_capacity == (2 + 2) * 4
    assert cfg.samples_per_step == 32
    assert cfg.optimizer_steps_per_step == 2
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(write(tmp_path, "[learner]\nglobal_batch_size = 7\n"))


def test_pipeline_parallelism_is_accepted_for_the_megatron_backend_and_refused_for_torch(
    tmp_path,
):
    megatron = "[learner]\nbackend = 'megatron'\nnum_gpus = 4\n"
    cfg = load_config(
        write(tmp_path, megatron + "[learner.megatron]\npipeline_parallel_size = 2\n"),
        ["learner.megatron.tensor_parallel_size=2"],
    )
    assert cfg.learner.megatron.pipeline_parallel_size == 2
    with pytest.raises(ConfigError, match=r"learner\.num_gpus = 4 must be a multiple"):
        load_config(write(tmp_path, megatron + "[learner.megatron]\npipeline_parallel_size = 3\n"))
    with pytest.raises(ConfigError, match=r"learner\.megatron\.pipeline_parallel_size > 1 needs"):
        load_config(write(tmp_path, "[learner.megatron]\npipeline_parallel_size = 2\n"))


def test_the_resolved_config_round_trips_with_arrays_of_tables(tmp_path):
    path = write(
        tmp_path,
        """
[[eval.datasets]]
name = "a"
path = "builtin:arithmetic"
[eval.datasets.sampling]
max_new_tokens = 8
[[eval.datasets]]
name = "b"
path = "builtin:arithmetic"
""",
    )
    cfg = load_config(path)
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    ("device", "settings", "expected"),
    [
        ("cpu", {}, "gloo"),
        ("cuda", {"cluster": {"engine_gpus": [1]}}, "nccl"),
        ("cuda", {"cluster": {"learner_gpus": [1]}}, "nccl"),  # the engine defaults to GPU 0
        ("cuda", {}, "ipc"),  # one embedded engine on GPU 0, the learner's
        ("cuda", {"cluster": {"learner_gpus": [3], "engine_gpus": [3]}}, "ipc"),
        ("cuda", {"engine": {"num_engines": 2}}, "gloo"),  # engines on GPUs 0 and 1
        ("cuda", {"engine": {"backend": "sglang"}}, "ipc"),  # SGLang on the learner's GPU
        ("cuda", {"engine": {"urls": ["http://other:30000"]}}, "gloo"),  # attached elsewhere
        ("cuda", {"engine": {"device": "cpu"}}, "gloo"),
        ("cuda", {"weights": {"transport": "gloo"}}, "gloo"),  # an explicit choice stands
    ],
)
def test_auto_weight_transport_follows_where_learner_and_engines_are(device, settings, expected):
    from streamrl.config import config_from_dict

    cfg = config_from_dict({"data": {"path": "x"}, "model": {"path": "x"}, **settings})
    assert cfg.weight_transport(device) == expected


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"learner": {"lr": 1e-5, "min_lr": 1e-4}}, r"learner\.min_lr = 0\.0001 must be at most"),
        (
            {
                "learner": {"lr_decay_style": "linear", "lr_warmup_steps": 100},
                "train": {"steps": 100},
            },
            r"learner\.lr_decay_style = 'linear' has no steps.*learner\.lr_decay_steps",
        ),
        (
            {"rollout": {"batch_size": 8, "over_sampling_batch_size": 4}},
            r"rollout\.over_sampling_batch_size = 4 must be 0 or at least rollout\.batch_size",
        ),
        ({"buffer": {"filters": ["zero_std", "nonzero"]}}, r"buffer\.filters\[1\] = 'nonzero'"),
        ({"train": {"mode": "train_only"}}, r"train\.load_rollouts"),
        ({"train": {"load_rollouts": "runs/x/rollouts"}}, r"train\.load_rollouts is read only"),
    ],
)
def test_recipe_keys_that_cannot_work_together_are_refused_naming_them(sections, message):
    from streamrl.config import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"path": "builtin:arithmetic"}, **sections})


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"cluster": {"colocate": True}}, r"cluster\.colocate = true needs train\.mode = 'sync'"),
        (
            {"cluster": {"colocate": True}, "train": {"mode": "rollout_only"}},
            r"needs train\.mode = 'sync' \(got 'rollout_only'\)",
        ),
        (
            {"learner": {"offload": "optimizer"}},
            r"learner\.offload = 'optimizer' needs cluster\.colocate",
        ),
        (
            {"cluster": {"colocate": True, "engine_gpus": [1]}, "train": {"mode": "sync"}},
            r"engines' GPUs \[1\] \(cluster\.engine_gpus\) share none with the learner's \[0\]",
        ),
        (
            {"cluster": {"colocate": True, "launcher": "ray"}, "train": {"mode": "sync"}},
            r"cluster\.colocate = true needs cluster\.launcher = 'local'",
        ),
        (
            {
                "cluster": {"colocate": True},
                "train": {"mode": "sync"},
                "learner": {"lora": {"rank": 8}},
            },
            r"cluster\.colocate = true with learner\.lora",
        ),
    ],
)
def test_colocated_mode_is_refused_outside_a_synchronous_schedule_on_shared_gpus(sections, message):
    from streamrl.config import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"path": "builtin:arithmetic"}, **sections})


def test_colocated_sync_with_offload_is_accepted():
    from streamrl.config import config_from_dict

    cfg = config_from_dict(
        {
            "data": {"path": "builtin:arithmetic"},
            "cluster": {"colocate": True},
            "train": {"mode": "sync"},
            "learner": {"offload": "all"},
        }
    )
    assert cfg.cluster.colocate and cfg.learner.offload == "all"


def test_the_lr_schedule_decays_to_the_end_of_training_when_its_length_is_zero():
    from streamrl.config import config_from_dict

    cfg = config_from_dict(
        {
            "data": {"path": "builtin:arithmetic"},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 4},
            "learner": {"lr": 1e-5, "lr_warmup_steps": 3, "lr_decay_style": "cosine",
                        "global_batch_size": 4},
            "train": {"steps": 10},
        }
    )  # fmt: skip
    assert cfg.total_optimizer_steps == 20
    assert cfg.lr_schedule == {
        "lr": 1e-5, "warmup_steps": 3, "decay_style": "cosine", "decay_steps": 17, "min_lr": 0.0,
    }  # fmt: skip
    assert cfg.groups_started_per_step == 2
    over = config_from_dict(
        {"data": {"path": "x"}, "rollout": {"batch_size": 2, "over_sampling_batch_size": 6}}
    )
    assert over.groups_started_per_step == 6 and over.buffer_capacity == (1 + 2) * 6


@pytest.mark.parametrize("mode", ["abort", "retract_abort", "in_place"])
def test_sglang_takes_the_pause_modes_that_empty_it_and_refuses_the_others_with_its_radix_cache(
    tmp_path, mode
):
    """SGLang's radix cache can be flushed at an update only when the pause leaves no request
    in the engine (`abort`, `retract_abort`); a mode that keeps requests needs the cache off."""
    model = tmp_path / "model"
    model.mkdir()
    text = f'[model]\npath = "{model}"\n[weights]\npause_mode = "{mode}"\n'
    engine = '[engine]\nbackend = "sglang"\n'
    if mode == "in_place":
        with pytest.raises(ConfigError, match=r"weights\.pause_mode = 'in_place'.*radix cache"):
            load_config(write(tmp_path, text + engine))
        engine += 'extra_args = ["--disable-radix-cache"]\n'
    assert load_config(write(tmp_path, text + engine)).pause_mode == mode
