"""Shared pieces of the gateway tests: chat templates with native tool support, a scripted
engine (for tests of the API layer with outputs chosen exactly), a recording engine set
(for tests against a real engine), and a gateway + session in one context manager."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

from streamrl.agents.api import GenerateContext
from streamrl.agents.gateway import serving
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.results import EngineFinish, GenerateResult

IM_END = 2  # SmolLM2's <|im_end|>

# A ChatML template that renders tools natively, in the Hermes format (written for these
# tests: tools listed in the system turn, calls as <tool_call> JSON, results as
# <tool_response> blocks in one user turn).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Tools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n"
    "{% endif %}<tool_response>\n{{ message.content }}\n</tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Llama-3-style template (headers, <|eot_id|>, tool results in an `ipython` turn, calls as
# whole-turn JSON with "parameters"), written for these tests.
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Reply with JSON {"name": function name, "parameters": arguments} to call:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{% elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def with_template(tokenizer: Any, template: str) -> Any:
    """A copy of `tokenizer` whose chat template is `template`."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def result(
    tokenizer: Any,
    text: str = "",
    *,
    ids: list[int] | None = None,
    version: int = 0,
    eos: bool = True,
    finish: str = "stop",
) -> GenerateResult:
    """A scripted engine answer: `ids` (or `text` tokenized), then <|im_end|> when `eos`."""
    ids = list(ids) if ids is not None else encode(tokenizer, text)
    ids += [IM_END] if eos else []
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    return GenerateResult(
        rid="r",
        text=shown,
        output_ids=ids,
        logprobs=[-0.25 - 0.01 * i for i in range(len(ids))],
        versions=[version] * len(ids),
        versions_exact=True,
        weight_version=version,
        finish_reason=EngineFinish(type=finish),
        prompt_tokens=0,
        cached_tokens=0,
        meta={},
    )


class ScriptedEngine:
    """Answers with prepared results in order (n of them for a call with `n`), recording
    every request's input ids and sampling params. It stands in for the engine where a
    test must choose the model's output exactly (tool calls, stop strings)."""

    router = None

    def __init__(self, results: list[GenerateResult]) -> None:
        self.results = list(results)
        self.requests: list[tuple[list[int], dict]] = []

    def session(self, key: str) -> ScriptedEngine:
        return self

    async def generate(self, input_ids, params):
        self.requests.append((list(input_ids), dict(params)))
        return self.results.pop(0)

    async def generate_many(self, prompts, params):
        (input_ids,) = prompts
        self.requests.append((list(input_ids), dict(params)))
        return [self.results.pop(0) for _ in range(params.get("n", 1))]


class _Recording:
    """A real engine client that also records every /generate request and answer."""

    def __init__(self, client: Any, log: list) -> None:
        self.client, self.log = client, log

    async def generate(self, input_ids, params, **kwargs):
        answer = await self.client.generate(input_ids, params, **kwargs)
        self.log.append((list(input_ids), dict(params), answer))
        return answer

    async def generate_many(self, prompts, params, **kwargs):
        answers = await self.client.generate_many(prompts, params, **kwargs)
        for answer in answers:
            self.log.append((list(prompts[0]), dict(params), answer))
        return answers


class RecordingEngineSet(EngineSet):
    """An `EngineSet` of real engines whose generate calls are recorded in `calls`:
    (input ids sent, sampling params, `GenerateResult`) in the order they finished."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls)
        self.calls: list[tuple[list[int], dict, GenerateResult]] = []

    def session(self, key: str) -> _Recording:
        return _Recording(super().session(key), self.calls)


def context(engines: Any, tokenizer: Any, **sampling: Any) -> GenerateContext:
    params = {"max_new_tokens": 16, "temperature": 1.0, **sampling}
    return GenerateContext(engines=engines, tokenizer=tokenizer, sampling_params=params)


@contextlib.asynccontextmanager
async def open_session(ctx: GenerateContext, **options: Any) -> AsyncIterator[Any]:
    """A running gateway with one session for `ctx` (options: `SessionOptions` fields,
    plus `tool_format`)."""
    from streamrl.agents.gateway.sessions import SessionOptions

    tool_format = options.pop("tool_format", "auto")
    async with serving() as gateway:
        session = gateway.open_session(ctx, SessionOptions(**options), tool_format=tool_format)
        session.clients = []
        try:
            yield session
        finally:
            for client in session.clients:
                await client.close()


def openai_client(session: Any) -> Any:
    """An `openai.AsyncOpenAI` client of the session (closed with the session)."""
    import openai

    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key="unused", max_retries=0)
    session.clients.append(client)
    return client


def anthropic_client(session: Any) -> Any:
    """An `anthropic.AsyncAnthropic` client of the session (closed with the session)."""
    import anthropic

    client = anthropic.AsyncAnthropic(
        base_url=session.anthropic_base_url, api_key="unused", max_retries=0
    )
    session.clients.append(client)
    return client
