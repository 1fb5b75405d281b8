"""The gateway's pure parts, on exact strings: tool-call parsing (Hermes, Llama 3), request
conversion (OpenAI and Anthropic to one message form), template rendering and the token
layout of a continuation, and the stream's text deltas."""

from __future__ import annotations

import pytest
from gateway_helpers import HERMES_TEMPLATE, LLAMA3_TEMPLATE, encode, with_template

from streamrl.agents.gateway import anthropic_api, openai_api
from streamrl.agents.gateway.messages import Message, RequestError, ToolSpec
from streamrl.agents.gateway.sse import split_text
from streamrl.agents.gateway.templates import ChatTemplate, TemplateError
from streamrl.agents.gateway.tool_calls import (
    ToolCall,
    detect_format,
    parse_hermes,
    parse_llama3,
)

IM_END = 2


# ---------------------------------------------------------------- tool calls


def test_hermes_tool_calls_are_split_from_the_text_around_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("neg", {"x": 3})]
    assert parsed.problems == []
    assert parsed.calls[0].id != parsed.calls[1].id and parsed.calls[0].id.startswith("call_")


def test_a_hermes_call_cut_off_before_its_closing_tag_is_still_a_call():
    parsed = parse_hermes('<tool_call>{"name": "f", "parameters": {"q": "x"}}')
    assert parsed.calls == [ToolCall("f", {"q": "x"})] and parsed.content == ""


def test_an_unreadable_hermes_block_stays_in_the_content_and_is_reported():
    text = 'Sure <tool_call>{"name": "f", "arguments": {"a": </tool_call> done'
    parsed = parse_hermes(text)
    assert parsed.calls == [] and parsed.content == text
    assert len(parsed.problems) == 1 and "unreadable" in parsed.problems[0]
    (problem,) = parse_hermes('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').problems
    assert "not an object" in problem


def test_llama3_json_tool_calls_are_whole_turns_with_an_optional_python_tag():
    assert parse_llama3('{"name": "f", "parameters": {"a": 1}}').calls == [ToolCall("f", {"a": 1})]
    parsed = parse_llama3(
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": 2}}'
    )
    assert parsed.calls == [ToolCall("f", {}), ToolCall("g", {"b": 2})] and parsed.content == ""
    prose = 'I would call {"name": "f", "parameters": {}}'
    assert parse_llama3(prose).calls == [] and parse_llama3(prose).content == prose
    answer = '{"answer": 42}'  # JSON that is not a call is the model's answer
    assert parse_llama3(answer).calls == [] and parse_llama3(answer).problems == []


def test_the_tool_format_is_read_from_the_template_source():
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    assert detect_format(LLAMA3_TEMPLATE) == "llama3"
    assert detect_format("{{ messages }}") is None


# ---------------------------------------------------------------- requests


OPENAI_BODY = {
    "model": "m",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "2+3"}, {"type": "text", "text": "?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    "n": 2,
    "max_tokens": 7,
    "stop": "END",
    "temperature": 0.5,
    "seed": 3,
    "logprobs": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}

EXPECTED_MESSAGES = (
    Message("system", "Be brief."),
    Message("user", "2+3?"),
    Message("assistant", "", (ToolCall("add", {"a": 2, "b": 3}),)),
    Message("tool", "5"),
)


def test_an_openai_request_becomes_canonical_messages_and_sampling():
    request, flags = openai_api.parse_chat(OPENAI_BODY)
    assert request.messages == EXPECTED_MESSAGES
    assert request.messages[2].tool_calls[0].id == "c1" and request.messages[3].tool_call_id == "c1"
    assert request.tools == (ToolSpec.make("add", "", {"type": "object"}),)
    sampling = request.sampling
    assert (
        sampling.n,
        sampling.max_tokens,
        sampling.stop,
        sampling.temperature,
        sampling.seed,
    ) == (
        2,
        7,
        ("END",),
        0.5,
        3,
    )
    assert flags == {"model": "m", "stream": True, "include_usage": True, "logprobs": True}


def test_an_anthropic_request_becomes_the_same_messages_as_its_openai_equivalent():
    body = {
        "model": "m",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}],
            },
        ],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
    }
    request, _flags = anthropic_api.parse_messages(body)
    assert request.messages == EXPECTED_MESSAGES
    assert request.tools == openai_api.parse_chat(OPENAI_BODY)[0].tools
    assert request.sampling.stop == ("END",) and request.sampling.max_tokens == 7
    body["messages"][2]["content"][0]["is_error"] = True
    assert anthropic_api.parse_messages(body)[0].messages[3] == Message("tool", "Error: 5")


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 1.5}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools[0]"),
        ({"messages": []}, "messages"),
    ],
)
def test_a_bad_openai_request_is_refused_naming_the_field(body, named):
    with pytest.raises(RequestError, match=r"^" + named.replace("[", r"\[").replace("]", r"\]")):
        openai_api.parse_chat(body)


def test_an_anthropic_request_without_max_tokens_is_refused():
    with pytest.raises(RequestError, match="max_tokens: required"):
        anthropic_api.parse_messages({"messages": [{"role": "user", "content": "x"}]})


# ---------------------------------------------------------------- templates


TOOLS = (ToolSpec.make("add", "Add two numbers.", {"type": "object"}),)
HISTORY = (
    Message("user", "2+3?"),
    Message("assistant", "", (ToolCall("add", {"a": 2, "b": 3}),)),
)
FOLLOWED = (*HISTORY, Message("tool", "5"), Message("tool", "6"))


def test_a_template_without_tools_gets_them_as_hermes_text_in_its_own_roles(tokenizer):
    template = ChatTemplate(tokenizer)
    assert not template.native_tools and template.tool_format == "hermes"
    text = template.render(FOLLOWED, TOOLS, generation=True)
    assert text == (
        "<|im_start|>system\nYou may call these tools:\n<tools>\n"
        '{"name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}\n'
        "</tools>\nTo call a tool, reply with a JSON object inside tool_call tags:\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>\n'
        "Each result comes back inside <tool_response></tool_response> tags.<|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_continuation_is_the_templates_text_after_the_model_turn_minus_what_it_wrote(tokenizer):
    """After a model turn that ended with <|im_end|>, only "\\n" of the turn close is added."""
    template = ChatTemplate(with_template(tokenizer, HERMES_TEMPLATE))
    assert template.native_tools and template.tool_format == "hermes"
    model_ids = [*encode(tokenizer, '<tool_call>{"name": "add"}</tool_call>'), IM_END]
    ids = template.continuation_ids(HISTORY, FOLLOWED, TOOLS, model_ids)
    after = "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    assert ids == encode(tokenizer, "\n" + after)
    cut_off = encode(tokenizer, "<tool_call>{")  # the token limit ended it: the whole close
    assert template.continuation_ids(HISTORY, FOLLOWED, TOOLS, cut_off) == encode(
        tokenizer, "<|im_end|>\n" + after
    )


def test_a_llama3_template_renders_tool_results_in_its_ipython_turns(tokenizer):
    template = ChatTemplate(with_template(tokenizer, LLAMA3_TEMPLATE))
    assert template.tool_format == "llama3" and template.turn_close == "<|eot_id|>"
    ids = template.continuation_ids(HISTORY, FOLLOWED[:3], TOOLS, encode(tokenizer, "{}"))
    expected = (
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids == encode(tokenizer, expected)


def test_a_template_that_rewrites_history_when_messages_follow_is_refused(tokenizer):
    # Marks the last message: adding one changes how the previous one reads.
    rewriting = with_template(
        tokenizer,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}{% if loop.last %} (latest){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    template = ChatTemplate(rewriting, tool_format="none")
    history = (Message("user", "hi"), Message("assistant", "yo"))
    with pytest.raises(TemplateError, match="prefix property"):
        template.continuation_ids(history, (*history, Message("user", "more")), (), [IM_END])


def test_an_explicit_llama3_format_on_a_template_without_tools_is_refused(tokenizer):
    with pytest.raises(TemplateError, match="tool_format = 'llama3'"):
        ChatTemplate(tokenizer, tool_format="llama3")


# ---------------------------------------------------------------- streaming


def test_streamed_text_pieces_follow_token_boundaries_and_join_to_the_reply(tokenizer):
    ids = [*encode(tokenizer, "The capital is Paris."), IM_END]
    pieces = split_text(tokenizer, ids, "The capital is Paris.")
    assert "".join(p for p, _ in pieces) == "The capital is Paris."
    assert [p for p, _ in pieces] == [tokenizer.decode([i]) for i in ids[:-1]]
    # A reply whose content is not the decoded text (a tool call removed) still joins up.
    ids = encode(tokenizer, 'Sure.<tool_call>{"name": "f"}</tool_call>')
    assert "".join(p for p, _ in split_text(tokenizer, ids, "Sure.")) == "Sure."
