"""The gateway against a real `streamrl engine serve`, driven by the real `openai` and
`anthropic` clients, non-streaming and streaming.

The tiny random model's outputs are random tokens: they show that the trajectory is
token for token what the engine generated (each engine request and answer is recorded),
that every request was the trajectory's own prefix, that the rendered parts are the
template's text, and, by a teacher-forced forward pass over the whole trajectory, that
each model token's logprob is the model's under exactly the tokens before it. Random
text also retokenises differently from its tokens, which the drift test checks
happens. A random model writes no tool calls; the SmolLM2 test (slow) drives the tool
path with a real model's output: prompted with three worked examples and decoded
greedily, SmolLM2-135M-Instruct writes a well-formed call.
"""

from __future__ import annotations

import json

import pytest
from engine_helpers import running_engines, teacher_forced_logprobs
from gateway_helpers import (
    IM_END,
    RecordingEngineSet,
    anthropic_client,
    context,
    encode,
    open_session,
    openai_client,
)

from streamrl.types import NO_VERSION

pytestmark = pytest.mark.anyio


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def check_trajectory(tokenizer, engines, trajectory, first_text: str, user_texts: list[str]):
    """Every engine call's input is the trajectory's prefix at that turn and its output the
    turn's tokens; prompt and observations are the template's text; masks exact."""
    calls = engines.calls
    assert len(calls) == len(trajectory.turn_starts) == len(user_texts) + 1
    context_ids = trajectory.prompt_ids + trajectory.response_ids
    assert trajectory.prompt_ids == encode(tokenizer, first_text)
    bounds = [*trajectory.turn_starts, len(trajectory.response_ids)]
    expected_mask: list[int] = []
    for turn, (sent, _, answer) in enumerate(calls):
        start = len(trajectory.prompt_ids) + trajectory.turn_starts[turn]
        assert sent == context_ids[:start]
        model_end = trajectory.turn_starts[turn] + len(answer.output_ids)
        assert (
            trajectory.response_ids[trajectory.turn_starts[turn] : model_end] == answer.output_ids
        )
        assert trajectory.logprobs[trajectory.turn_starts[turn] : model_end] == answer.logprobs
        assert trajectory.versions[trajectory.turn_starts[turn] : model_end] == answer.versions
        expected_mask += [1] * len(answer.output_ids)
        if turn < len(user_texts):  # the observation: the rest of the turn close, the user turn
            closing = "\n" if answer.output_ids[-1] == IM_END else "<|im_end|>\n"
            observation = trajectory.response_ids[model_end : bounds[turn + 1]]
            assert observation == encode(tokenizer, closing + user_turn(user_texts[turn]))
            expected_mask += [0] * len(observation)
    assert trajectory.loss_mask == expected_mask
    masked = [i for i, m in enumerate(trajectory.loss_mask) if not m]
    assert all(trajectory.versions[i] == NO_VERSION and trajectory.logprobs[i] == 0 for i in masked)


def check_logprobs_by_teacher_forcing(model_dir, trajectory) -> None:
    forced = teacher_forced_logprobs(model_dir, trajectory.prompt_ids, trajectory.response_ids)
    pairs = [
        (a, b)
        for a, b, m in zip(trajectory.logprobs, forced, trajectory.loss_mask, strict=True)
        if m
    ]
    assert max(abs(a - b) for a, b in pairs) <= 1e-4


async def test_an_openai_conversation_is_the_engines_tokens_turn_by_turn(
    tokenizer, engine_url, tiny_model_dir
):
    users = ["Tell me a story.", "Go on.", "And then?"]
    async with (
        RecordingEngineSet([engine_url]) as engines,
        open_session(context(engines, tokenizer, max_new_tokens=8)) as session,
    ):
        client = openai_client(session)
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": users[0]},
        ]
        first_text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        for turn, user in enumerate([*users[1:], None]):
            if turn == 1:  # streamed, with usage and logprobs
                stream = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    seed=turn,
                    stream=True,
                    logprobs=True,
                    stream_options={"include_usage": True},
                )
                chunks = [chunk async for chunk in stream]
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                streamed = [
                    e.logprob
                    for c in chunks
                    if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content
                ]
                assert chunks[-1].usage.completion_tokens == len(engines.calls[-1][2].output_ids)
                assert streamed == engines.calls[-1][2].logprobs[: len(streamed)]
                reply = {"role": "assistant", "content": content}
            else:
                response = await client.chat.completions.create(
                    model="policy", messages=messages, seed=turn, logprobs=True
                )
                choice = response.choices[0]
                answer = engines.calls[-1][2]
                assert choice.message.content == answer.text
                assert [e.logprob for e in choice.logprobs.content] == answer.logprobs[
                    : len(choice.logprobs.content)
                ]
                assert response.usage.prompt_tokens == len(engines.calls[-1][0])
                reply = choice.message.model_dump(exclude_none=True)
            messages.append(reply)
            if user is not None:
                messages.append({"role": "user", "content": user})
    trajectory = session.result().trajectory
    check_trajectory(tokenizer, engines, trajectory, first_text, users[1:])
    check_logprobs_by_teacher_forcing(tiny_model_dir, trajectory)
    assert (
        trajectory.metadata["gateway/branches"] == 1 and trajectory.metadata["gateway/calls"] == 3
    )


async def test_an_anthropic_conversation_is_the_engines_tokens_turn_by_turn(
    tokenizer, engine_url, tiny_model_dir
):
    users = ["Hello.", "More."]
    async with (
        RecordingEngineSet([engine_url]) as engines,
        open_session(context(engines, tokenizer, max_new_tokens=8)) as session,
    ):
        client = anthropic_client(session)
        messages = [{"role": "user", "content": users[0]}]
        first_text = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, *messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        first = await client.messages.create(
            model="policy", max_tokens=6, system="Be brief.", messages=messages
        )
        assert first.stop_reason in ("max_tokens", "end_turn")
        assert first.usage.output_tokens == len(engines.calls[0][2].output_ids) <= 6
        messages += [
            {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": users[1]},
        ]
        async with client.messages.stream(
            model="policy", max_tokens=6, system="Be brief.", messages=messages
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == final.content[0].text == engines.calls[1][2].text
    trajectory = session.result().trajectory
    check_trajectory(tokenizer, engines, trajectory, first_text, users[1:])
    check_logprobs_by_teacher_forcing(tiny_model_dir, trajectory)


async def test_a_random_models_text_retokenises_differently_yet_the_trajectory_keeps_its_tokens(
    tokenizer, engine_url
):
    async with (
        RecordingEngineSet([engine_url]) as engines,
        open_session(context(engines, tokenizer, max_new_tokens=32)) as session,
    ):
        client = openai_client(session)
        messages = [{"role": "user", "content": "Say something."}]
        for turn in range(3):
            response = await client.chat.completions.create(
                model="policy", messages=messages, seed=100 + turn
            )
            messages += [
                response.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Again."},
            ]
    trajectory = session.result().trajectory
    generated = [answer.output_ids for _, _, answer in engines.calls]
    # The precondition: decoding the model's tokens and encoding the text again gives other
    # tokens for at least one turn (so a text-level proxy would train on tokens never sampled).
    retokenised = [
        encode(tokenizer, tokenizer.decode(ids, skip_special_tokens=True)) for ids in generated
    ]
    without_eos = [ids[:-1] if ids[-1] == IM_END else ids for ids in generated]
    drifted = [g != r for g, r in zip(without_eos, retokenised, strict=True)]
    assert any(drifted), "choose other seeds: no turn retokenises differently"
    model_tokens = [
        t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m
    ]
    assert model_tokens == [t for ids in generated for t in ids]
    rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    assert encode(tokenizer, rendered) != trajectory.prompt_ids + trajectory.response_ids


async def test_completions_and_models_answer_from_the_real_engine(tokenizer, engine_url):
    async with (
        RecordingEngineSet([engine_url]) as engines,
        open_session(context(engines, tokenizer)) as session,
    ):
        client = openai_client(session)
        assert [m.id for m in (await client.models.list()).data] == ["policy"]
        first = await client.completions.create(
            model="policy", prompt="Once upon", max_tokens=5, seed=1
        )
        text = first.choices[0].text
        chunks = [c async for c in await client.completions.create(
            model="policy", prompt="Once upon" + text + " a time", max_tokens=5, seed=2, stream=True
        )]  # fmt: skip
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    (first_in, _, first_out), (second_in, _, second_out) = engines.calls
    assert text == first_out.text and streamed == second_out.text
    assert second_in == first_in + first_out.output_ids + encode(tokenizer, " a time")
    trajectory = session.result().trajectory
    assert trajectory.loss_mask.count(1) == len(first_out.output_ids) + len(second_out.output_ids)


# ---------------------------------------------------------------- a real model's tool call


PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}


def demonstration(question: str, code: str, output: str, call_id: str) -> list[dict]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "python", "arguments": json.dumps({"code": code})},
    }
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output + "\n"},
        {"role": "assistant", "content": output},
    ]


@pytest.mark.slow
async def test_smollm2_writes_a_tool_call_that_both_apis_return_and_its_result_follows_its_tokens(
    tokenizer, tmp_path
):
    shots = [
        *demonstration("What is 12 * 7?", "print(12 * 7)", "84", "d1"),
        *demonstration("What is 345 + 289?", "print(345 + 289)", "634", "d2"),
        *demonstration("What is 91 - 17?", "print(91 - 17)", "74", "d3"),
    ]
    # One request at a time: one KV slot. The default 64 slots of 2048 rows are 6 GB of
    # float32 cache for SmolLM2's 30 layers, which the engine zeroes at start (6 CPU-s).
    with running_engines("smollm2", tmp_path, extra_args=["--max-batch-size", "1"]) as processes:
        async with RecordingEngineSet([processes[0].url]) as engines:
            ctx = context(engines, tokenizer, max_new_tokens=40, temperature=0.0)
            async with open_session(ctx) as session:
                client = openai_client(session)
                messages = [*shots, {"role": "user", "content": "What is 56 * 23?"}]
                first = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[PYTHON_TOOL]
                )
                (call,) = first.choices[0].message.tool_calls
                assert (
                    first.choices[0].finish_reason == "tool_calls"
                    and call.function.name == "python"
                )
                code = json.loads(call.function.arguments)["code"]
                assert "56" in code and "23" in code
                messages += [
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "1288\n"},
                ]
                await client.chat.completions.create(
                    model="policy", messages=messages, tools=[PYTHON_TOOL]
                )
            openai_trajectory = session.result().trajectory
            openai_calls, engines.calls = engines.calls, []

            async with open_session(ctx) as session:  # the same episode through Anthropic's API
                client = anthropic_client(session)
                tools = [
                    {
                        "name": "python",
                        "description": PYTHON_TOOL["function"]["description"],
                        "input_schema": PYTHON_TOOL["function"]["parameters"],
                    }
                ]
                question = [{"role": "user", "content": "What is 56 * 23?"}]
                history = anthropic_history(shots)
                first = await client.messages.create(
                    model="policy", max_tokens=40, messages=[*history, *question], tools=tools
                )
                assert first.stop_reason == "tool_use"
                use = next(block for block in first.content if block.type == "tool_use")
                assert use.input == json.loads(call.function.arguments)
                follow = [
                    {
                        "role": "assistant",
                        "content": [b.model_dump(exclude_none=True) for b in first.content],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "1288\n"}
                        ],
                    },
                ]
                await client.messages.create(
                    model="policy",
                    max_tokens=40,
                    messages=[*history, *question, *follow],
                    tools=tools,
                )
            anthropic_trajectory = session.result().trajectory
    # Both APIs rendered the same conversation, so the same greedy tokens came back.
    assert anthropic_trajectory.response_ids == openai_trajectory.response_ids
    assert anthropic_trajectory.prompt_ids == openai_trajectory.prompt_ids
    (sent_1, _, answer_1), (sent_2, _, answer_2) = openai_calls
    observation = encode(
        tokenizer,
        "\n<|im_start|>user\n<tool_response>\n1288\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    assert answer_1.output_ids[-1] == IM_END
    assert sent_2 == sent_1 + answer_1.output_ids + observation
    model_1, model_2 = len(answer_1.output_ids), len(answer_2.output_ids)
    assert openai_trajectory.response_ids == answer_1.output_ids + observation + answer_2.output_ids
    assert openai_trajectory.loss_mask == [1] * model_1 + [0] * len(observation) + [1] * model_2
    assert openai_trajectory.metadata["tool_calls"] == 1


def anthropic_history(openai_messages: list[dict]) -> list[dict]:
    """The worked examples in Anthropic's form: tool calls as tool_use blocks, results as
    tool_result blocks in a user turn."""
    out: list[dict] = []
    for message in openai_messages:
        if message.get("tool_calls"):
            blocks = [
                {
                    "type": "tool_use",
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"]),
                }
                for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": blocks})
        elif message["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": message["tool_call_id"],
                            "content": message["content"],
                        }
                    ],
                }
            )
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out
