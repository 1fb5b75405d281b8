"""The gateway's generate function in the rollout worker, against a real engine: agents as
coroutines, threads and separate processes; rewards over the whole episode; failures and
timeouts that are counted and leave no process behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from engine_helpers import wait_until

from streamrl.actors.rollout import RolloutWorker
from streamrl.agents import gateway
from streamrl.fleet.engine_set import EngineSet
from streamrl.types import Prompt, SampleStatus

pytestmark = pytest.mark.anyio
AGENTS = str(Path(__file__).resolve().parents[1] / "gateway_agents.py")


def prompt() -> Prompt:
    return Prompt(seq=7, index=3, epoch=0, text="Name a colour.", input_ids=[1, 2], label="red")


def response_length(inp) -> float:
    return float(len(inp.response))


async def sample(engine_url, tokenizer, **generate_kwargs):
    async with EngineSet([engine_url]) as engines:
        worker = RolloutWorker(
            worker_id="w",
            source=None,
            sender=None,
            engines=engines,
            tokenizer=tokenizer,
            generate_fn=gateway.generate,
            reward_fn=response_length,
            n_samples_per_prompt=1,
            sampling_params={"max_new_tokens": 6, "temperature": 1.0},
            max_consecutive_failures=0,
            generate_kwargs=generate_kwargs,
        )
        return await worker.run_sample(prompt(), 0), worker


async def test_a_coroutine_agent_becomes_one_multi_turn_sample_scored_by_the_reward_fn(
    engine_url, tokenizer
):
    import gateway_agents

    async with gateway.serving() as process_gateway:
        result, _ = await sample(engine_url, tokenizer, agent="gateway_agents:two_turns")
    assert gateway_agents.BASE_URLS[-1].startswith(process_gateway.url + "/s/sess-")
    assert result.status == SampleStatus.OK
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi."}], tokenize=False, add_generation_prompt=True
    )
    assert result.prompt_ids.tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert len(result.turn_starts) == 2 and result.turn_starts[0] == 0
    assert result.metadata["num_turns"] == 2 and result.metadata["gateway/calls"] == 2
    assert result.reward == float(len(result.response_text))  # rollout.reward_fn on the answer
    mask = result.loss_mask.tolist()
    second = result.turn_starts[1]
    assert mask[second] == 1 and mask[second - 1] == 0 and mask[0] == 1


async def test_a_synchronous_agent_runs_in_a_thread_and_its_result_can_carry_the_reward(
    engine_url, tokenizer
):
    result, _ = await sample(engine_url, tokenizer, agent="gateway_agents:synchronous")
    assert result.status == SampleStatus.OK and result.reward == 0.5
    assert result.metadata["num_turns"] == 1


async def test_an_agent_process_gets_its_session_in_the_env_and_the_reward_sees_the_episode(
    engine_url, tokenizer
):
    result, _ = await sample(
        engine_url,
        tokenizer,
        command=["{python}", AGENTS, "anthropic"],
        episode_reward="gateway_agents:episode_reward",
    )
    assert result.status == SampleStatus.OK
    # user, assistant, user, assistant: the trained branch as the reward saw it
    assert result.reward == pytest.approx(0.4) and result.metadata["reward/turns"] == 2
    assert result.metadata["gateway/calls"] == 2 and len(result.turn_starts) == 2


async def test_a_failing_agent_process_fails_its_sample_with_the_output_tail(engine_url, tokenizer):
    result, worker = await sample(engine_url, tokenizer, command=[sys.executable, AGENTS, "fail"])
    assert result.status == SampleStatus.GENERATION_FAILED
    assert "exited with 3" in result.metadata["error"]
    assert "something went wrong in the agent" in result.metadata["error"]
    assert worker.counters.generation_failures == 1


async def test_a_hung_agent_process_is_killed_with_its_children_at_the_timeout(
    engine_url, tokenizer, tmp_path
):
    pids_file = tmp_path / "pids"
    result, _ = await sample(
        engine_url,
        tokenizer,
        command=[sys.executable, AGENTS, "hang"],
        env={"PIDS_FILE": str(pids_file)},
        timeout_s=3.0,
    )
    assert result.status == SampleStatus.GENERATION_FAILED
    assert "timeout_s = 3" in result.metadata["error"]
    for pid in map(int, pids_file.read_text().split()):
        wait_until(lambda pid=pid: not _alive(pid), what=f"process {pid} gone", timeout_s=10)


async def test_an_agent_that_never_calls_the_model_fails_its_sample(engine_url, tokenizer):
    result, _ = await sample(engine_url, tokenizer, agent="gateway_agents:no_calls")
    assert result.status == SampleStatus.GENERATION_FAILED
    assert "made no model call" in result.metadata["error"]


async def test_a_failing_episode_reward_marks_the_sample_and_is_counted(engine_url, tokenizer):
    result, worker = await sample(
        engine_url,
        tokenizer,
        agent="gateway_agents:two_turns",
        episode_reward="gateway_agents:failing_reward",
    )
    assert result.status == SampleStatus.REWARD_FAILED and result.reward == 0.0
    assert "the verifier is down" in result.metadata["reward_error"]
    assert worker.counters.reward_failures == 1


async def test_bad_generate_kwargs_are_refused_naming_the_key(engine_url, tokenizer):
    result, _ = await sample(engine_url, tokenizer, agent="gateway_agents:two_turns", turns=3)
    assert (
        "rollout.generate_kwargs" in result.metadata["error"]
        and "turns" in result.metadata["error"]
    )
    result, _ = await sample(engine_url, tokenizer)
    assert "exactly one of agent" in result.metadata["error"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
