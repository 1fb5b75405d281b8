"""Sessions through the real `openai` and `anthropic` clients over HTTP, with the model's
outputs chosen exactly by a scripted engine (`gateway_helpers.ScriptedEngine`).

What these prove: the API layer (tool calls parsed from the exact text a model wrote and
returned in each API's format, streamed and not; tool results rendered after the model's
own tokens), the token bookkeeping (each engine request is the previous request + the
model's tokens + the rendered new messages; masks, logprobs and versions per token), and
divergence, n, limits and sampling. `test_gateway_clients.py` runs the same paths
against a real engine, with the model's real outputs.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from gateway_helpers import (
    IM_END,
    ScriptedEngine,
    anthropic_client,
    context,
    encode,
    open_session,
    openai_client,
    result,
)

from streamrl.agents.gateway import serving
from streamrl.types import NO_VERSION

pytestmark = pytest.mark.anyio

TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}},
    }
]
TOOL_PROMPT = (
    "<|im_start|>system\nYou may call these tools:\n<tools>\n"
    '{"name": "add", "description": "Add.", "parameters": {"type": "object"}}\n</tools>\n'
    "To call a tool, reply with a JSON object inside tool_call tags:\n"
    '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>\n'
    "Each result comes back inside <tool_response></tool_response> tags.<|im_end|>\n"
)
CALL_TEXT = 'Adding.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
RESULT_TURN = (
    "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def check_two_turn_layout(tokenizer, engine, session, first_prompt_text: str) -> None:
    """Turn 2's engine input is turn 1's input + the model's tokens + the rendered tool
    result; the trajectory is exactly that, masked on the model's tokens only."""
    (first, _), (second, _) = engine.requests
    assert first == encode(tokenizer, first_prompt_text)
    model_1 = [*encode(tokenizer, CALL_TEXT), IM_END]
    observation = encode(tokenizer, RESULT_TURN)
    assert second == first + model_1 + observation
    trajectory = session.result().trajectory
    model_2 = [*encode(tokenizer, "5"), IM_END]
    assert trajectory.prompt_ids == first
    assert trajectory.response_ids == model_1 + observation + model_2
    assert trajectory.loss_mask == [1] * len(model_1) + [0] * len(observation) + [1] * len(model_2)
    expected_logprobs = [-0.25 - 0.01 * i for i in range(len(model_1))]
    assert trajectory.logprobs[: len(model_1)] == pytest.approx(expected_logprobs)
    assert trajectory.logprobs[len(model_1) : -len(model_2)] == [0.0] * len(observation)
    versions = [0] * len(model_1) + [NO_VERSION] * len(observation) + [1] * len(model_2)
    assert trajectory.versions == versions
    assert trajectory.turn_starts == [0, len(model_1) + len(observation)]
    assert trajectory.metadata["tool_calls"] == 1 and trajectory.metadata["gateway/calls"] == 2


async def test_an_openai_tool_call_round_trip_keeps_the_models_tokens_and_masks_the_result(
    tokenizer,
):
    engine = ScriptedEngine([result(tokenizer, CALL_TEXT), result(tokenizer, "5", version=1)])
    async with open_session(context(engine, tokenizer)) as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "2+3?"}]
        first = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content == "Adding."
        (call,) = message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 2,
            "b": 3,
        }
        assert first.usage.completion_tokens == len(encode(tokenizer, CALL_TEXT)) + 1
        messages += [message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        assert (
            second.choices[0].message.content == "5" and second.system_fingerprint == "streamrl-v1"
        )
    prompt = TOOL_PROMPT + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    check_two_turn_layout(tokenizer, engine, session, prompt)


async def test_a_streamed_openai_tool_call_arrives_as_chunks_that_rebuild_the_same_reply(
    tokenizer,
):
    engine = ScriptedEngine([result(tokenizer, CALL_TEXT), result(tokenizer, "5", version=1)])
    async with open_session(context(engine, tokenizer)) as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "2+3?"}]
        stream = await client.chat.completions.create(
            model="any",
            messages=messages,
            tools=TOOLS,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, logprobs, usage = "", {}, None, [], None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += delta.id or ""
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
                logprobs += [
                    e.logprob for e in (choice.logprobs.content if choice.logprobs else [])
                ]
                finish = choice.finish_reason or finish
        assert content == "Adding." and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("add", {"a": 2, "b": 3})
        ]
        n_model = len(encode(tokenizer, CALL_TEXT))  # the final <|im_end|> has no entry
        assert logprobs == pytest.approx([-0.25 - 0.01 * i for i in range(n_model)])
        assert usage.completion_tokens == n_model + 1
        messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls.values()
                ],
            },
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"},
        ]
        chunks = await client.chat.completions.create(
            model="any", messages=messages, tools=TOOLS, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == "5"
    prompt = TOOL_PROMPT + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    check_two_turn_layout(tokenizer, engine, session, prompt)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_tool_use_round_trip_keeps_the_models_tokens(tokenizer, stream):
    engine = ScriptedEngine([result(tokenizer, CALL_TEXT), result(tokenizer, "5", version=1)])
    tools = [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}]
    async with open_session(context(engine, tokenizer)) as session:
        client = anthropic_client(session)
        messages = [{"role": "user", "content": "2+3?"}]

        async def ask():
            if not stream:
                return await client.messages.create(
                    model="any", max_tokens=64, messages=messages, tools=tools
                )
            async with client.messages.stream(
                model="any", max_tokens=64, messages=messages, tools=tools
            ) as events:
                kinds = [event.type async for event in events]
                assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
                return await events.get_final_message()

        first = await ask()
        assert first.stop_reason == "tool_use"
        text, use = first.content
        assert text.type == "text" and text.text == "Adding."
        assert (use.type, use.name, use.input) == ("tool_use", "add", {"a": 2, "b": 3})
        messages += [
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
            },
        ]
        second = await ask()
        assert second.content[0].text == "5" and second.stop_reason == "end_turn"
    prompt = TOOL_PROMPT + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    check_two_turn_layout(tokenizer, engine, session, prompt)


async def test_tokens_that_retokenise_differently_from_their_text_are_kept_as_generated(
    tokenizer,
):
    """The model wrote " Par" + "is": as text that is one token, " Paris"."""
    par, is_ = tokenizer.convert_tokens_to_ids("ĠPar"), tokenizer.convert_tokens_to_ids("is")
    assert encode(tokenizer, tokenizer.decode([par, is_])) == [
        tokenizer.convert_tokens_to_ids("ĠParis")
    ]
    engine = ScriptedEngine([result(tokenizer, ids=[par, is_]), result(tokenizer, "Yes")])
    async with open_session(context(engine, tokenizer)) as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "Capital of France?"}]
        first = await client.chat.completions.create(model="any", messages=messages)
        assert first.choices[0].message.content == " Paris"
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="any", messages=messages)
    (first_input, _), (second_input, _) = engine.requests
    kept = [*first_input, par, is_, IM_END]
    assert second_input[: len(kept)] == kept
    trajectory = session.result().trajectory
    assert trajectory.response_ids[:3] == [par, is_, IM_END]
    # Rendering the conversation from its text, as a text-level proxy would, loses them.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert encode(tokenizer, text) != second_input
    assert encode(tokenizer, text)[len(first_input)] == tokenizer.convert_tokens_to_ids("ĠParis")


async def test_an_edited_history_starts_a_counted_branch_and_the_last_branch_is_trained(tokenizer):
    engine = ScriptedEngine([result(tokenizer, t) for t in ("one", "two", "three")])
    async with open_session(context(engine, tokenizer)) as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "a"}]
        one = await client.chat.completions.create(model="any", messages=messages)
        messages += [
            one.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "b"},
        ]
        await client.chat.completions.create(model="any", messages=messages)
        # The agent rewrites turn 1's reply (e.g. it summarised it) and goes on from there.
        edited = [
            messages[0],
            {"role": "assistant", "content": "ONE"},
            {"role": "user", "content": "b"},
        ]
        await client.chat.completions.create(model="any", messages=edited)
    trajectory = session.result().trajectory
    assert engine.requests[2][0] == encode(
        tokenizer,
        tokenizer.apply_chat_template(edited, tokenize=False, add_generation_prompt=True),
    )  # rendered from scratch: "ONE" is not a model turn, so it is prompt
    assert trajectory.prompt_ids == engine.requests[2][0]
    assert trajectory.response_ids == [*encode(tokenizer, "three"), IM_END]
    meta = trajectory.metadata
    assert (meta["gateway/fresh_starts"], meta["gateway/branches"]) == (1, 2)
    assert meta["gateway/abandoned_model_tokens"] == len(encode(tokenizer, "onetwo")) + 2


async def test_with_on_divergence_error_an_edited_history_is_refused_naming_the_message(tokenizer):
    engine = ScriptedEngine([result(tokenizer, "one"), result(tokenizer, "two")])
    async with open_session(context(engine, tokenizer), on_divergence="error") as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "a"}]
        one = await client.chat.completions.create(model="any", messages=messages)
        edited = [
            *messages,
            {"role": "assistant", "content": "ONE"},
            {"role": "user", "content": "b"},
        ]
        with pytest.raises(openai.ConflictError, match=r"messages\[1\]\.content: recorded 'one'"):
            await client.chat.completions.create(model="any", messages=edited)
        kept = [*messages, one.choices[0].message.model_dump(exclude_none=True), edited[2]]
        assert (await client.chat.completions.create(model="any", messages=kept)).choices


async def test_n_choices_branch_and_the_one_the_agent_continues_is_trained(tokenizer):
    engine = ScriptedEngine(
        [result(tokenizer, "left"), result(tokenizer, "right"), result(tokenizer, "on")]
    )
    async with open_session(context(engine, tokenizer), on_divergence="error") as session:
        client = openai_client(session)
        messages = [{"role": "user", "content": "pick"}]
        both = await client.chat.completions.create(model="any", messages=messages, n=2)
        assert [c.message.content for c in both.choices] == ["left", "right"]
        assert engine.requests[0][1]["n"] == 2
        messages += [
            both.choices[1].message.model_dump(exclude_none=True),
            {"role": "user", "content": "go"},
        ]
        await client.chat.completions.create(model="any", messages=messages)
    trajectory = session.result().trajectory
    right = [*encode(tokenizer, "right"), IM_END]
    assert trajectory.response_ids[: len(right)] == right
    assert (
        trajectory.metadata["gateway/abandoned_model_tokens"] == len(encode(tokenizer, "left")) + 1
    )


async def test_a_stop_string_ends_the_turn_and_anthropic_names_it(tokenizer):
    engine = ScriptedEngine([result(tokenizer, "x = 1 END", eos=False)])
    async with open_session(context(engine, tokenizer, stop=["<end>"])) as session:
        message = await anthropic_client(session).messages.create(
            model="any",
            max_tokens=8,
            stop_sequences=["END"],
            messages=[{"role": "user", "content": "go"}],
        )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    ((_, params),) = engine.requests
    assert params["stop"] == ["<end>", "END"] and params["max_new_tokens"] == 8


async def test_limits_answer_clear_errors_and_config_sampling_wins_unless_asked(tokenizer):
    engine = ScriptedEngine(
        [result(tokenizer, "a"), result(tokenizer, "b"), result(tokenizer, "c")]
    )
    ctx = context(engine, tokenizer, temperature=1.0, max_new_tokens=16)
    async with open_session(ctx, max_calls=2, max_total_tokens=60) as session:
        client = openai_client(session)
        await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}], temperature=0.2, max_tokens=99
        )
        assert engine.requests[0][1]["temperature"] == 1.0  # the learner's temperature
        assert engine.requests[0][1]["max_new_tokens"] == 16  # capped by the episode's
        with pytest.raises(openai.BadRequestError, match="max_total_tokens = 60"):
            await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "y " * 100}]
            )
        with pytest.raises(openai.RateLimitError, match="limit of 2 model calls"):
            await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "z"}]
            )
    assert session.result().trajectory.metadata["gateway/sampling_ignored"] == 1
    async with open_session(context(engine, tokenizer), sampling="request") as session:
        await openai_client(session).chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}], temperature=0.2
        )
    assert engine.requests[-1][1]["temperature"] == 0.2


async def test_a_completions_prompt_that_extends_the_last_one_reuses_its_tokens(tokenizer):
    engine = ScriptedEngine(
        [result(tokenizer, " upon", eos=False, finish="length"), result(tokenizer, " lived")]
    )
    async with open_session(context(engine, tokenizer)) as session:
        client = openai_client(session)
        first = await client.completions.create(
            model="any", prompt="Once", max_tokens=2, logprobs=0
        )
        assert first.choices[0].text == " upon" and first.choices[0].finish_reason == "length"
        upon = encode(tokenizer, " upon")
        logprobs = first.choices[0].logprobs
        assert logprobs.token_logprobs == pytest.approx(
            [-0.25 - 0.01 * i for i in range(len(upon))]
        )
        assert "".join(logprobs.tokens) == " upon"
        await client.completions.create(model="any", prompt="Once upon a time there", max_tokens=2)
    (first_input, _), (second_input, _) = engine.requests
    assert first_input == list(tokenizer("Once")["input_ids"])
    assert second_input == first_input + encode(tokenizer, " upon") + encode(
        tokenizer, " a time there"
    )
    assert (
        session.result().trajectory.loss_mask.count(1) == len(encode(tokenizer, " upon lived")) + 1
    )


async def test_the_api_key_names_the_session_and_an_unknown_one_is_a_404(tokenizer):
    engine = ScriptedEngine([result(tokenizer, "hi")])
    async with serving() as gateway:
        session = gateway.open_session(context(engine, tokenizer))
        async with (
            openai.AsyncOpenAI(
                base_url=gateway.url + "/v1", api_key=session.session_id, max_retries=0
            ) as client,
            anthropic.AsyncAnthropic(base_url=gateway.url, api_key="any") as other,
        ):
            messages = [{"role": "user", "content": "x"}]
            reply = await client.chat.completions.create(model="m", messages=messages)
            assert reply.choices[0].message.content == "hi"
            assert [m.id for m in (await client.models.list()).data] == ["policy"]
            assert [m.id for m in (await other.models.list()).data] == ["policy"]
            gateway.close_session(session)
            with pytest.raises(openai.NotFoundError, match="no open session"):
                await client.chat.completions.create(model="m", messages=messages)
