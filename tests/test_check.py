"""`streamrl check`: the user's code, data files and model paths, each problem by dotted key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def streamrl_check(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "check", str(path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_quickstart_config_passes_every_check():
    result = streamrl_check(ROOT / "configs" / "quickstart.toml")
    assert result.returncode == 0, result.stderr
    assert "[model]" in result.stdout


def test_every_broken_piece_is_reported_by_its_dotted_key_with_exit_code_2(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "2 + 2?", "label": "4"}\n')
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text("{not json\n")
    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
[model]
path = "{no_config}"
[data]
path = "{data}"
input_key = "prompt"
[rollout]
reward_fn = "tests.no_such_module:reward"
generate_fn = "streamrl.agents.single_turn:no_such_function"
[buffer]
filters = ["zero_std", "tests.e2e_filters:needs_two"]
[eval]
interval = 1
[[eval.datasets]]
name = "a"
path = "{bad_json}"
[[eval.datasets]]
name = "b"
path = "{tmp_path / "missing.jsonl"}"
reward_fn = "tests.e2e_filters:not_callable"
"""
    )
    result = streamrl_check(config)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    expected = {
        "rollout.reward_fn": "module not found",
        "rollout.generate_fn": "has no attribute 'no_such_function'",
        "buffer.filters[1]": "one argument",
        "data.path": "no key ['prompt']",
        "eval.datasets[0].path": "malformed JSON",
        "eval.datasets[1].path": "no such file",
        "eval.datasets[1].reward_fn": "not callable",
        "model.path": "config does not load",
    }
    for key, message in expected.items():
        matching = [line for line in errors if f": {key}: " in line]
        assert matching, f"{key} not reported in:\n{result.stderr}"
        assert message in matching[0], matching[0]
    assert len(errors) == len(expected), result.stderr
    assert result.stdout == ""


def test_a_missing_model_directory_and_random_shape_are_reported(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\npath = "random:no-such-shape"\n[data]\npath = "builtin:arithmetic"\n'
        '[algorithm]\nadvantage_estimator = "gae"\n'
        f'[learner.critic]\npath = "{tmp_path / "nowhere"}"\n'
    )
    result = streamrl_check(config)
    assert result.returncode == 2
    assert "model.path: unknown random shape 'no-such-shape'" in result.stderr
    assert "learner.critic.path:" in result.stderr and "no such directory" in result.stderr


def test_a_tokenizer_without_a_chat_template_is_refused_where_one_is_applied(tmp_path):
    from streamrl.models import byte_tokenizer

    tokenizer = tmp_path / "no_template"
    byte_tokenizer().save_pretrained(tokenizer)
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
[model]
path = "random:qwen3-tiny"
tokenizer = "{tokenizer}"
[data]
path = "builtin:arithmetic"
[rollout]
generate_fn = "streamrl.agents.gateway:generate"
"""
    )
    result = streamrl_check(config)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr
    gateway, prompts = sorted(errors, key=lambda line: "rollout.generate_fn" not in line)
    assert ": rollout.generate_fn: 'streamrl.agents.gateway:generate' renders every turn" in gateway
    assert ": data.apply_chat_template: true renders every prompt" in prompts
    assert all("has no chat template" in line and str(tokenizer) in line for line in errors)
