"""`streamrl check`: the user's code, data files and model paths, each problem by dotted key."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_colocated_config_is_printed_under_its_synchronous_schedule():
    result = streamrl_check(
        ROOT / "configs" / "quickstart.toml",
        "--set", "cluster.colocate=true", "--set", "train.mode='sync'",
        "--set", "learner.offload='optimizer'",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# colocated (cluster.colocate): a synchronous schedule")
    assert "learner.offload = 'optimizer'" in result.stdout.splitlines()[0]
    refused = streamrl_check(ROOT / "configs" / "quickstart.toml", "--set", "cluster.colocate=true")
    assert refused.returncode == 2
    assert "cluster.colocate = true needs train.mode = 'sync'" in refused.stderr


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
        "data.path": "missing input key 'prompt'",
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


# ---------------------------------------------------------------- every row of the data


def data_config(path, **data_keys):
    from streamrl.config import config_from_dict

    return config_from_dict({"data": {"path": str(path), **data_keys}})


def prompts_with_bad_lines(tmp_path):
    """Six records; line 3 is cut off, line 5 has a number for a prompt, line 4 is blank."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "a", "label": 1}\n{"prompt": "b", "label": 2}\n{"prompt": "c", "lab\n'
        '\n{"prompt": 5, "label": 4}\n{"prompt": "e", "label": 5}\n{"prompt": "f", "label": 6}\n'
    )
    return path


def test_a_bad_line_deep_in_the_data_is_named_by_file_and_line_with_the_count_of_bad_ones(
    tmp_path,
):
    from streamrl.check import check_data_file

    path = prompts_with_bad_lines(tmp_path)
    with pytest.raises(ValueError) as caught:
        check_data_file(str(path), "prompt", "label", data_config(path))
    message = str(caught.value)
    assert message.startswith(f"{path}:3: malformed JSON"), message
    assert message.endswith("(2 of 6 records bad)"), message


def test_bad_lines_are_only_a_warning_when_the_run_would_skip_them(tmp_path, caplog):
    from streamrl.check import check_data_file

    path = prompts_with_bad_lines(tmp_path)
    with caplog.at_level(logging.WARNING, logger="streamrl.check"):
        check_data_file(str(path), "prompt", "label", data_config(path, on_bad_line="skip"))
    assert f"{path}:3: malformed JSON" in caplog.text
    assert "the run skips them" in caplog.text


def test_rows_the_run_refuses_are_found_with_the_runs_own_rules(tmp_path):
    from streamrl.check import check_data_file

    path = tmp_path / "chat.jsonl"
    path.write_text('{"q": "fine", "label": 1}\n{"q": [{"role": "user", "content": "hi"}]}\n')
    check_data_file(str(path), "q", "label", data_config(path, input_key="q"))
    no_template = data_config(path, input_key="q", apply_chat_template=False)
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: 'q' is a list of chat messages"):
        check_data_file(str(path), "q", "label", no_template)


def test_a_bad_parquet_row_is_named_by_its_row_number(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamrl.check import check_data_file

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "label": [1, 2, 3]}), path)
    with pytest.raises(
        ValueError,
        match=r"prompts\.parquet:2: 'prompt' must be a string .*"
        r"\(1 of 3 records bad\)",
    ):
        check_data_file(str(path), "prompt", "label", data_config(path))


def test_records_past_the_limit_are_not_read_and_a_warning_says_so(tmp_path, caplog, monkeypatch):
    from streamrl import check

    path = prompts_with_bad_lines(tmp_path)
    monkeypatch.setattr(check, "MAX_DATA_ROWS", 2)
    with caplog.at_level(logging.WARNING, logger="streamrl.check"):
        check.check_data_file(str(path), "prompt", "label", data_config(path))
    assert "only the first 2 records were checked" in caplog.text


def test_streamrl_check_exits_2_on_a_malformed_line_and_names_it(tmp_path):
    path = prompts_with_bad_lines(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{path}"\n')
    result = streamrl_check(config)
    assert result.returncode == 2, result.stderr
    assert f"data.path: {path}:3: malformed JSON" in result.stderr
    assert "(2 of 6 records bad)" in result.stderr


def test_reward_kwargs_the_function_refuses_are_reported_by_their_key(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "2 + 2?", "label": "4"}\n')
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
[model]
path = "random:qwen3-tiny"
[data]
path = "{data}"
[rollout]
reward_fn = "streamrl.rewards.remote:remote_reward"
reward_kwargs = {{ url = "http://127.0.0.1:1/score", batch_size = 0 }}
[eval]
interval = 1
[[eval.datasets]]
name = "a"
path = "{data}"
reward_fn = "streamrl.rewards.math:exact_match"
reward_kwargs = {{ url = "http://127.0.0.1:1/score" }}
"""
    )
    result = streamrl_check(config)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr
    assert ": rollout.reward_kwargs: batch_size = 0: an integer >= 1" in errors[0]
    assert (
        ": eval.datasets[0].reward_kwargs: streamrl.rewards.math:exact_match does not " in errors[1]
    )


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
