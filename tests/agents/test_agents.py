"""Multi-turn agents: exact token layouts, tools that fail, episodes across weight versions.

The engine is a scripted fake here (these test the agent logic, not the engine):
it returns prepared `GenerateResult`s and records what it was sent. Expected
layouts are written out independently of `streamrl.agents.env.ChatFormat`,
from the ChatML text SmolLM2's template produces.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from streamrl.actors.rollout import RolloutWorker
from streamrl.agents import env as agent_env
from streamrl.agents import tools as agent_tools
from streamrl.agents.api import GenerateContext
from streamrl.agents.examples.calculator import CALCULATOR, CalculatorError, evaluate
from streamrl.agents.examples.guess_number import GuessNumber
from streamrl.backends.batching import pack_micro_batches
from streamrl.backends.step import train_step
from streamrl.config import config_from_dict
from streamrl.data.source import render_prompt, tokenize_prompt
from streamrl.fleet.results import EngineFinish, GenerateResult
from streamrl.queues.buffer import Buffer
from streamrl.types import NO_VERSION, Group, Prompt

pytestmark = pytest.mark.anyio
IM_END = 2


# ---------------------------------------------------------------- fakes


def result(
    tokenizer, text: str, *, versions, logprob: float = -0.5, finish: str = "stop", eos: bool = True
) -> GenerateResult:
    """A scripted engine answer: `text` tokenized (+ <|im_end|> when `eos`)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([IM_END] if eos else [])
    if isinstance(versions, int):
        versions = [versions] * len(ids)
    logprobs = [logprob - 0.01 * i for i in range(len(ids))]
    return GenerateResult(
        rid="r",
        text=text,
        output_ids=ids,
        logprobs=logprobs,
        versions=list(versions),
        versions_exact=True,
        weight_version=max(versions, default=0),
        finish_reason=EngineFinish(type=finish),
        prompt_tokens=0,
        cached_tokens=0,
        meta={},
    )


class ScriptedEngine:
    """Answers `generate` with prepared results, in order, recording every request."""

    def __init__(self, results: list[GenerateResult]) -> None:
        self.results = list(results)
        self.requests: list[tuple[list[int], dict]] = []

    async def generate(self, input_ids, params):
        self.requests.append((list(input_ids), dict(params)))
        return self.results.pop(0)


class OneEngine:
    """The slice of `EngineSet` that `GenerateContext` uses."""

    router = None

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine

    def session(self, key: str) -> ScriptedEngine:
        return self.engine


def make_prompt(tokenizer, value, label=None, metadata=None) -> Prompt:
    text = render_prompt(tokenizer, value, apply_chat_template=True, system_prompt="")
    ids = tokenize_prompt(tokenizer, text, apply_chat_template=True)
    return Prompt(
        seq=0, index=0, epoch=0, text=text, input_ids=ids, label=label, metadata=metadata or {}
    )


def context(tokenizer, engine: ScriptedEngine, **kwargs) -> GenerateContext:
    return GenerateContext(
        engines=OneEngine(engine),
        tokenizer=tokenizer,
        sampling_params={"max_new_tokens": 32, "temperature": 1.0},
        kwargs=kwargs,
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- layouts


def test_the_chat_format_of_smollm2_is_chatml_with_user_observation_turns(tokenizer):
    chat = agent_env.ChatFormat(tokenizer)
    assert chat.turn_close == "<|im_end|>\n"
    assert chat.turn_prefix == "<|im_start|>user\n"
    assert chat.turn_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    assert chat.closing([5, IM_END]) == "\n"  # the model closed its turn itself
    assert chat.closing([5, 6]) == "<|im_end|>\n"  # cut off: the observation closes it


async def test_loss_masks_are_exact_for_a_scripted_multi_turn_episode_with_tool_output(tokenizer):
    system = agent_tools.system_prompt([CALCULATOR], "Use the calculator.")
    question = "Ana buys 12 boxes with 7 pens each. How many pens?"
    prompt = make_prompt(
        tokenizer,
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        label="84",
    )
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    engine = ScriptedEngine(
        [result(tokenizer, call, versions=0), result(tokenizer, "84", versions=1, logprob=-0.25)]
    )
    ctx = context(tokenizer, engine, tools=["streamrl.agents.examples.calculator:CALCULATOR"])

    trajectory = await agent_tools.generate(ctx, prompt)

    turn1 = [*encode(tokenizer, call), IM_END]
    observation = encode(
        tokenizer,
        '\n<|im_start|>user\n<tool_response>\n{"name": "calculator", "result": "84"}\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    turn2 = [*encode(tokenizer, "84"), IM_END]
    assert trajectory.response_ids == turn1 + observation + turn2
    assert trajectory.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert trajectory.versions == [0] * len(turn1) + [NO_VERSION] * len(observation) + [1] * len(
        turn2
    )
    expected_logprobs = (
        engine_logprobs(-0.5, len(turn1))
        + [0.0] * len(observation)
        + engine_logprobs(-0.25, len(turn2))
    )
    assert trajectory.logprobs == pytest.approx(expected_logprobs)
    # The whole sequence is what the template renders for the conversation (minus the final
    # "\n" the model never writes), and the second engine call saw exactly the first turn's ids.
    conversation = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": call},
            {
                "role": "user",
                "content": '<tool_response>\n{"name": "calculator", "result": "84"}\n'
                "</tool_response>",
            },
            {"role": "assistant", "content": "84"},
        ],
        tokenize=False,
    )
    assert prompt.input_ids + trajectory.response_ids == encode(tokenizer, conversation[:-1])
    assert engine.requests[1][0] == prompt.input_ids + turn1 + observation
    assert trajectory.text == "84" and trajectory.reward is None  # rollout.reward_fn scores it
    assert trajectory.metadata["tool_calls"] == 1 and trajectory.metadata["tool_errors"] == 0
    assert trajectory.metadata["end_reason"] == "done" and trajectory.num_turns == 2


def engine_logprobs(first: float, count: int) -> list[float]:
    return [first - 0.01 * i for i in range(count)]


async def test_a_turn_cut_off_by_the_token_limit_is_closed_by_the_masked_observation(tokenizer):
    prompt = make_prompt(
        tokenizer,
        "Guess a number from 1 to 1000.",
        label=700,
        metadata={"low": 1, "high": 1000, "max_guesses": 3},
    )
    engine = ScriptedEngine(
        [
            result(tokenizer, "I think it is", versions=0, finish="length", eos=False),
            result(tokenizer, "500", versions=0),
            result(tokenizer, "700", versions=0),
        ]
    )
    ctx = context(
        tokenizer, engine, env="streamrl.agents.examples.guess_number:GuessNumber", max_turns=5
    )
    trajectory = await agent_env.generate(ctx, prompt)

    cut = encode(tokenizer, "I think it is")
    first_observation = encode(
        tokenizer,
        "<|im_end|>\n<|im_start|>user\nReply with one number from 1 to 1000."
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    second = [*encode(tokenizer, "500"), IM_END]
    second_observation = encode(
        tokenizer,
        "\n<|im_start|>user\nHigher. From 501 to 1000.<|im_end|>\n<|im_start|>assistant\n",
    )
    third = [*encode(tokenizer, "700"), IM_END]
    assert trajectory.response_ids == cut + first_observation + second + second_observation + third
    assert trajectory.loss_mask == (
        [1] * len(cut)
        + [0] * len(first_observation)
        + [1] * len(second)
        + [0] * len(second_observation)
        + [1] * len(third)
    )
    assert trajectory.metadata["done"] and trajectory.metadata["env_info"]["found"]
    assert trajectory.num_turns == 3
    # Found on the last allowed guess: credits 0, 1 (middle of [1, 1000] is 500.5), then 1 + bonus.
    assert trajectory.reward == pytest.approx(trajectory.metadata["step_rewards"][1] + 1 / 3 + 0.5)


async def test_the_token_budget_ends_an_episode_before_the_context_overflows(tokenizer):
    prompt = make_prompt(
        tokenizer,
        "Guess a number from 1 to 1000.",
        label=3,
        metadata={"low": 1, "high": 1000, "max_guesses": 10},
    )
    engine = ScriptedEngine([result(tokenizer, "500", versions=0) for _ in range(10)])
    budget = len(prompt.input_ids) + 40
    ctx = context(
        tokenizer,
        engine,
        env="streamrl.agents.examples.guess_number:GuessNumber",
        max_turns=10,
        max_total_tokens=budget,
    )
    trajectory = await agent_env.generate(ctx, prompt)
    assert trajectory.metadata["end_reason"] == "token_budget"
    assert len(prompt.input_ids) + len(trajectory.response_ids) <= budget
    assert trajectory.loss_mask[-1] == 1  # an episode ends on a model turn
    for input_ids, params in engine.requests:
        assert len(input_ids) + params["max_new_tokens"] <= budget


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class LastMessageOnly:
        chat_template = "x"
        all_special_ids = ()

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return f"[{messages[-1]['content']}]" + ("A:" if add_generation_prompt else "")

    with pytest.raises(agent_env.TemplateError, match="prefix property"):
        agent_env.ChatFormat(LastMessageOnly())


async def test_unknown_generate_kwargs_are_rejected_naming_the_key(tokenizer):
    prompt = make_prompt(tokenizer, "hi", label=1)
    ctx = context(tokenizer, ScriptedEngine([]), env="x:y", max_turn=3)
    with pytest.raises(ValueError, match="max_turn"):
        await agent_env.generate(ctx, prompt)


async def test_an_environment_with_its_own_first_observation_becomes_the_samples_prompt(
    tokenizer,
):
    class OwnInstructions(GuessNumber):
        async def reset(self, prompt):
            await super().reset(prompt)
            return "Secret in 1..1000. Guess."

    async def generate(ctx, prompt):
        return await agent_env.run_episode(
            ctx,
            prompt,
            OwnInstructions(),
            agent_env.EpisodeLimits(max_turns=1),
            system_prompt="Play.",
        )

    prompt = make_prompt(tokenizer, "unused row text", label=5, metadata={"max_guesses": 10})
    engine = ScriptedEngine([result(tokenizer, "500", versions=0)])
    worker = RolloutWorker(
        worker_id="w",
        source=None,
        sender=None,
        engines=OneEngine(engine),
        tokenizer=tokenizer,
        generate_fn=generate,
        reward_fn=None,
        n_samples_per_prompt=1,
        sampling_params={"max_new_tokens": 8},
        max_consecutive_failures=0,
    )
    sample = await worker.run_sample(prompt, 0)
    expected = encode(
        tokenizer,
        "<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\nSecret in 1..1000. Guess."
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    assert sample.prompt_ids.tolist() == expected == engine.requests[0][0]
    assert sample.response_ids.tolist() == [*encode(tokenizer, "500"), IM_END]


# ---------------------------------------------------------------- tools


async def test_a_tool_that_hangs_or_raises_ends_its_turn_with_an_error_and_never_blocks(
    tokenizer, monkeypatch
):
    release = threading.Event()

    async def hangs_async(x: int) -> str:
        await anyio.sleep_forever()

    def hangs_in_a_thread(x: int) -> str:
        release.wait(30)
        return "late"

    def raises(x: int) -> str:
        raise RuntimeError("boom")

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    registry = [
        agent_tools.Tool(name, name, schema, fn)
        for name, fn in [("hang", hangs_async), ("block", hangs_in_a_thread), ("fail", raises)]
    ]
    monkeypatch.setattr(agent_tools, "load_tools", lambda specs: {t.name: t for t in registry})
    prompt = make_prompt(
        tokenizer,
        [
            {"role": "system", "content": agent_tools.system_prompt(registry)},
            {"role": "user", "content": "go"},
        ],
    )

    def calls(*names: str) -> str:
        return "".join(
            f'<tool_call>{{"name": "{n}", "arguments": {{"x": 1}}}}</tool_call>' for n in names
        )

    engine = ScriptedEngine(
        [
            result(tokenizer, calls("hang"), versions=0),
            result(tokenizer, calls("block", "fail"), versions=0),
            result(tokenizer, calls("nope") + "<tool_call>{not json</tool_call>", versions=0),
            result(tokenizer, "done: 42", versions=0),
        ]
    )
    ctx = context(tokenizer, engine, tools=["tests:registry"], tool_timeout_s=0.5, max_turns=6)
    started = time.monotonic()
    try:
        trajectory = await agent_tools.generate(ctx, prompt)
    finally:
        release.set()
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, f"a hung tool blocked the episode for {elapsed:.1f} s"
    metadata = trajectory.metadata
    assert (metadata["tool_calls"], metadata["tool_timeouts"], metadata["tool_errors"]) == (5, 2, 3)
    assert trajectory.text == "done: 42" and metadata["end_reason"] == "done"
    observations = observation_texts(tokenizer, trajectory)
    assert '"error": "timed out after 0.5 s"' in observations[0]
    assert '"error": "timed out after 0.5 s"' in observations[1]
    assert '"error": "RuntimeError: boom"' in observations[1]
    assert "unknown tool" in observations[2] and "unreadable tool call" in observations[2]


def observation_texts(tokenizer, trajectory) -> list[str]:
    texts, current = [], []
    for token, mask in zip(trajectory.response_ids, trajectory.loss_mask, strict=True):
        if mask == 0:
            current.append(token)
        elif current:
            texts.append(tokenizer.decode(current))
            current = []
    return texts


def test_tool_calls_are_parsed_tolerantly_and_bad_ones_are_described():
    parse = agent_tools.parse_tool_calls
    calls, problems = parse('<tool_call>\n{"name": "c", "arguments": {"e": "1+1"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("c", {"e": "1+1"})] and not problems
    calls, _ = parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>')
    assert [c.name for c in calls] == ["a", "b"]
    calls, _ = parse('<tool_call>```json\n{"name": "c", "arguments": "{\\"e\\": 2}"}\n```')
    assert calls[0].arguments == {"e": 2}  # fenced, string arguments, no closing tag
    calls, _ = parse('<tool_call>{"name": "c", "parameters": {"e": 3}}</tool_call>')
    assert calls[0].arguments == {"e": 3}
    calls, problems = parse('<tool_call>{"arguments": {}}</tool_call><tool_call>nope</tool_call>')
    assert not calls and len(problems) == 2
    assert parse("The answer is 4.") == ([], [])


def test_the_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert evaluate("(12 + 7) * 3") == 57
    assert evaluate("2^10 - 1,024") == 0
    assert evaluate("-7 // 2") == -4 and evaluate("7 % 3") == 1 and evaluate("1/4") == 0.25
    assert evaluate("6 / 3") == 2 and isinstance(evaluate("6 / 3"), int)
    for bad in (
        "__import__('os').system('true')",
        "open('x')",
        "a + 1",
        "(1).real",
        "[1, 2]",
        "lambda: 1",
        "1 if 1 else 2",
        "2 ** 1000",
        "10 ** 31",
        "1 / 0",
        "True + 1",
        "1j",
        "9" * 201,
        "(-8) ** 0.5",
        "1e309",
        "0 ** -1",
        "",
    ):
        with pytest.raises(CalculatorError):
            evaluate(bad)


# ---------------------------------------------------------------- versions


async def test_an_episode_spanning_three_versions_trains_with_its_per_token_versions_and_logprobs(
    tokenizer, tiny_model_dir
):
    """Turn 1 at v0; turn 2 aborted by an update and resumed (v1 then v2); turn 3 at v2."""
    prompt = make_prompt(
        tokenizer,
        "Guess a number from 1 to 1000.",
        label=900,
        metadata={"low": 1, "high": 1000, "max_guesses": 10},
    )
    partial = result(tokenizer, "7", versions=1, logprob=-1.0, finish="abort", eos=False)
    engine = ScriptedEngine(
        [
            result(tokenizer, "500", versions=0, logprob=-0.5),
            partial,
            result(tokenizer, "50", versions=2, logprob=-2.0),
            result(tokenizer, "880", versions=2, logprob=-3.0),
        ]
    )
    worker = RolloutWorker(
        worker_id="w",
        source=None,
        sender=None,
        engines=OneEngine(engine),
        tokenizer=tokenizer,
        generate_fn=agent_env.generate,
        reward_fn=None,
        n_samples_per_prompt=2,
        sampling_params={"max_new_tokens": 8, "temperature": 1.0},
        max_consecutive_failures=0,
        generate_kwargs={
            "env": "streamrl.agents.examples.guess_number:GuessNumber",
            "max_turns": 3,
        },
    )
    sample = await worker.run_sample(prompt, 0)
    # The resumed request continued from the partial output, with the remaining budget.
    resumed_ids, resumed_params = engine.requests[2]
    assert resumed_ids == engine.requests[1][0] + partial.output_ids
    assert resumed_params["max_new_tokens"] == 8 - len(partial.output_ids)

    model = sample.loss_mask == 1
    turn_versions = [0] * 4 + [1] + [2] * 3 + [2] * 4  # "500<eos>", "7"+"50<eos>", "880<eos>"
    assert sample.versions[model].tolist() == turn_versions
    assert (sample.versions[~model] == NO_VERSION).all() and (sample.logprobs[~model] == 0).all()
    assert sample.metadata["num_turns"] == 3 and sample.metadata["end_reason"] == "max_turns"

    other = await RolloutWorker(
        worker_id="w",
        source=None,
        sender=None,
        engines=OneEngine(ScriptedEngine([result(tokenizer, g, versions=2) for g in "123"])),
        tokenizer=tokenizer,
        generate_fn=agent_env.generate,
        reward_fn=None,
        n_samples_per_prompt=2,
        sampling_params={"max_new_tokens": 8},
        max_consecutive_failures=0,
        generate_kwargs=worker.generate_kwargs,
    ).run_sample(prompt, 1)
    group = Group(group_id="g", prompt_seq=0, prompt_index=0, samples=[sample, other])
    assert (group.oldest_version, group.newest_version, group.num_versions_spanned) == (0, 2, 3)

    # Staleness is measured from the oldest trained token, not the newest.
    strict = Buffer(capacity=2, max_staleness=2, staleness_rule="episode", filters=())
    strict.put(group)
    assert strict.pop_batch(1, version=3) is None and strict.stats.evicted["stale"] == 1
    buffer = Buffer(capacity=2, max_staleness=3, staleness_rule="episode", filters=())
    buffer.put(group)
    assert buffer.pop_batch(1, version=3) == [group]
    assert buffer.stats.staleness == {3: 1} and buffer.stats.versions_spanned == {3: 1}

    # Micro-batches carry each token's behaviour logprob and mask at its position.
    (micro_batch,) = pack_micro_batches(group.samples, [0, 1], token_budget=4096, pad_id=0)
    for row, index in enumerate(micro_batch.sample_indices):
        s = group.samples[index]
        start, end = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        assert micro_batch.loss_mask[row, start:end].tolist() == s.loss_mask.tolist()
        assert micro_batch.behaviour_logprobs[row, start:end].numpy() == pytest.approx(
            np.where(s.loss_mask == 1, s.logprobs, 0.0)
        )
        assert micro_batch.loss_mask[row, :start].sum() == 0

    # A real training step on a tiny model uses exactly those behaviour logprobs.
    from streamrl.backends.torch import TorchBackend

    cfg = config_from_dict(
        {
            "data": {"path": "builtin:arithmetic"},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
            "learner": {"lr": 1e-3, "num_threads": 1},
        }
    )
    torch.manual_seed(0)
    backend = TorchBackend(
        tiny_model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32
    )
    (proximal,) = backend.compute_logprobs([micro_batch], temperature=1.0)
    mask = micro_batch.loss_mask > 0
    expected_diff = (proximal - micro_batch.behaviour_logprobs)[mask].abs().mean().item()
    before = [p.detach().clone() for p in backend.model.parameters()]
    metrics = train_step(backend, [group], cfg, pad_id=0)
    assert metrics["train/trained_tokens"] == sum(s.num_trained_tokens for s in group.samples)
    assert metrics["train/logprob_abs_diff_mean"] == pytest.approx(expected_diff, rel=1e-4)
    assert any(
        not torch.equal(a, b) for a, b in zip(before, backend.model.parameters(), strict=True)
    )


async def test_a_real_engine_episode_runs_across_weight_updates_with_each_turn_tagged(
    tokenizer, tiny_engine, tiny_model_dir
):
    """`streamrl engine serve` on a tiny model; the weights change after every turn."""

    from streamrl.fleet.engine_set import EngineSet

    prompt = make_prompt(
        tokenizer,
        "Guess a number from 1 to 1000.",
        label=1000,
        metadata={"low": 1, "high": 1000, "max_guesses": 10},
    )
    async with EngineSet([tiny_engine.url]) as engine_set:

        class UpdatedAfterEachTurn(GuessNumber):
            async def step(self, action):
                outcome = await super().step(action)
                await engine_set.engines[0].update_weights_from_disk(
                    tiny_model_dir, weight_version=self.num_turns
                )
                return outcome

        ctx = GenerateContext(
            engines=engine_set,
            tokenizer=tokenizer,
            sampling_params={"max_new_tokens": 4, "temperature": 1.0},
        )
        trajectory = await agent_env.run_episode(
            ctx, prompt, UpdatedAfterEachTurn(), agent_env.EpisodeLimits(max_turns=3)
        )
    turns, current = [], []
    for version, mask in zip(trajectory.versions, trajectory.loss_mask, strict=True):
        if mask:
            current.append(version)
        elif current:
            turns.append(current)
            current = []
    turns.append(current)
    assert [set(t) for t in turns] == [{0}, {1}, {2}]
    assert all(lp < 0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m)


# ---------------------------------------------------------------- the example environment


async def test_guess_number_rewards_climb_the_ladder_and_unfound_episodes_last_all_guesses(
    tokenizer,
):
    prompt = make_prompt(
        tokenizer, "x", label=321, metadata={"low": 1, "high": 1000, "max_guesses": 10}
    )

    async def play(actions: list[str]) -> tuple[float, int]:
        env = GuessNumber()
        await env.reset(prompt)
        total, turns = 0.0, 0
        for action in actions:
            step = await env.step(action)
            total, turns = total + step.reward, turns + 1
            if step.done:
                break
        return total, turns

    words, _ = await play(["hello"] * 12)
    out_of_range, turns = await play(["2000"] * 12)
    in_range, _ = await play([str(v) for v in (999, 998, 997, 996, 995, 994, 993, 992, 991, 990)])
    bisect, _ = await play(["500", "250", "375", "312", "343", "327", "319", "323", "321"])
    assert turns == 10  # an unfound episode uses every guess, then ends
    assert words == 0 < out_of_range < in_range < 1 < bisect


async def test_the_environment_generate_fn_is_importable_by_name_from_the_shipped_configs():
    from streamrl.config import load_config
    from streamrl.utils import import_object

    root = Path(__file__).resolve().parents[2]
    for name in ("guess_number", "calculator"):
        cfg = load_config(root / "examples" / name / "config.toml")
        assert import_object(cfg.rollout.generate_fn, "rollout.generate_fn")
        kwargs = dict(cfg.rollout.generate_kwargs)
        if "env" in kwargs:
            assert isinstance(
                agent_env.make_env(kwargs["env"], kwargs.get("env_kwargs", {})),
                agent_env.Environment,
            )
        else:
            assert agent_tools.load_tools(tuple(kwargs["tools"]))
        assert (root / cfg.data.path).exists()
        json.loads((root / cfg.data.path).read_text().splitlines()[0])
