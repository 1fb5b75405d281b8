"""`streamrl run` with agents behind the rollout process's API gateway, end to end: a tiny
random model, an OpenAI-client coroutine agent and an Anthropic-client agent process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import step_records

CONFIG = """
[model]
path = "random:qwen3-tiny"
[data]
path = "examples/openai_agent/data/train.jsonl"
apply_chat_template = false
[rollout]
batch_size = 2
n_samples_per_prompt = 2
generate_fn = "streamrl.agents.gateway:generate"
reward_fn = "tests.e2e_rewards:vowel_fraction"
[rollout.sampling]
max_new_tokens = 6
[rollout.generate_kwargs]
{agent}
max_calls = 4
[engine]
num_threads = 1
max_seq_len = 512
[buffer]
max_staleness = 1
filters = []
[learner]
lr = 1e-3
num_threads = 1
[train]
steps = 3
output_dir = "{out}"
[logging]
tensorboard = false
progress = false
"""

AGENTS = {
    "openai_coroutine": 'agent = "tests.gateway_agents:two_turns"',
    "anthropic_process": 'command = ["{python}", "tests/gateway_agents.py", "anthropic"]',
}


@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_a_run_trains_on_gateway_episodes_with_per_turn_metrics(tmp_path, agent):
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(agent=AGENTS[agent], out=out))
    result = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = step_records(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert record["episode/turns_mean"] == 2
        assert record["staleness/turn_max"] == record["staleness_max"]
        assert record["staleness/last_turn_max"] <= 1
        assert "staleness/groups_past_bound" in record
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["rollout"]["generation_failures"] == 0
    assert "turn_staleness_histogram" in summary["buffer"]


EXAMPLES = sorted(Path(__file__).parents[2].glob("examples/*_agent/config.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_the_agent_examples_parse_import_and_switch_to_sglang_by_backend_and_model_path(path):
    """Nothing in them is specific to the embedded engine: with engine.backend = "sglang"
    (and a Hugging Face directory, as SGLang needs) the same file is a valid run."""
    from streamrl.agents.env import parse_options
    from streamrl.agents.gateway.episode import AgentOptions
    from streamrl.config import load_config
    from streamrl.utils import import_object

    cfg = load_config(path)
    assert import_object(cfg.rollout.generate_fn, "rollout.generate_fn").uses_gateway
    options = parse_options(dict(cfg.rollout.generate_kwargs), AgentOptions)
    if options.agent:
        assert callable(import_object(options.agent, "rollout.generate_kwargs.agent"))
    else:
        assert Path(options.command[1]).is_file()
    sglang = load_config(
        path, ["engine.backend=sglang", "model.path=/models/SmolLM2-135M-Instruct"]
    )
    assert sglang.engine.backend == "sglang" and sglang.rollout == cfg.rollout
