"""Conformance: `/generate` as streamrl reads it, from the server and through sglang-router.

What streamrl relies on (streamrl.fleet.client.parse_result, the learner):
`output_ids` hold every generated token, a matched stop token included;
`meta_info.output_token_logprobs` is `[[logprob, token_id, null], ...]`, one
entry per output token, the logprob under logits / temperature (temperature 1
here, where every convention agrees); `finish_reason.type` is stop (with the
matched token id or string) or length (with the budget); `weight_version` is a
string ("default" or digits) and `weight_versions` spans, when sent, cover the
output tokens in order, `end` exclusive.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from conformance_support import PROMPT, assert_matches_teacher, assert_spans_cover

from streamrl.fleet.client import EngineClient
from streamrl.fleet.results import parse_result, parse_version

pytestmark = pytest.mark.anyio

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=300)


def test_a_response_carries_every_field_streamrl_reads(via):
    rid = f"fields-{uuid.uuid4().hex[:8]}"
    body = {
        "input_ids": PROMPT,
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0},
    }
    response = _post(via, body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert isinstance(payload, dict) and isinstance(payload["text"], str)
    output_ids = payload["output_ids"]
    assert len(output_ids) == 8 and all(isinstance(t, int) for t in output_ids)
    meta = payload["meta_info"]
    assert meta["id"] == rid
    assert meta["finish_reason"]["type"] == "length" and meta["finish_reason"]["length"] == 8
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8
    assert isinstance(meta["weight_version"], str)
    parse_version(meta["weight_version"])  # "default" or digits
    entries = meta["output_token_logprobs"]
    assert len(entries) == 8
    for entry, token in zip(entries, output_ids, strict=True):
        assert len(entry) == 3 and entry[2] is None, entry
        assert isinstance(entry[0], float) and entry[0] <= 0.0 and entry[1] == token, entry
    spans = assert_spans_cover(meta, 8)
    if spans is not None:
        assert {span["version"] for span in spans} == {meta["weight_version"]}
    result = parse_result(payload)
    assert result.rid == rid and result.output_ids == output_ids and len(result.versions) == 8


async def test_logprobs_equal_a_teacher_forced_forward_pass(via, target, teacher):
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(via, timeout_s=300) as client:
        result = await client.generate(PROMPT, params)
    assert len(result.output_ids) == len(result.logprobs) == 24
    assert_matches_teacher(target, teacher, PROMPT, result)


async def test_a_stop_token_id_ends_generation_and_stays_in_the_output_ids(via):
    async with EngineClient(via, timeout_s=300) as client:
        free = await client.generate(PROMPT, GREEDY)
        candidates = free.output_ids[:-1] if free.finish_reason.type == "stop" else free.output_ids
        if len(candidates) < 2:
            pytest.skip("the model stops within two tokens of this prompt")
        stop_id = candidates[min(5, len(candidates) - 1)]
        first = free.output_ids.index(stop_id)
        stopped = await client.generate(PROMPT, {**GREEDY, "stop_token_ids": [stop_id]})
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason.type == "stop" and stopped.finish_reason.matched == stop_id
    assert len(stopped.logprobs) == len(stopped.output_ids)


async def test_a_stop_string_ends_generation_and_is_trimmed_from_the_text_only(via):
    async with EngineClient(via, timeout_s=300) as client:
        free = await client.generate(PROMPT, GREEDY)
        stop_text = free.text[len(free.text) // 2 :][:4]
        if not stop_text.strip():
            pytest.skip(f"no usable stop string in the greedy text {free.text!r}")
        trimmed = await client.generate(PROMPT, {**GREEDY, "stop": [stop_text]})
        kept = await client.generate(PROMPT, {**GREEDY, "stop": stop_text, "no_stop_trim": True})
    assert trimmed.finish_reason.type == "stop" and trimmed.finish_reason.matched == stop_text
    assert stop_text not in trimmed.text and free.text.startswith(trimmed.text)
    assert trimmed.output_ids == free.output_ids[: len(trimmed.output_ids)]
    assert len(trimmed.logprobs) == len(trimmed.output_ids)
    assert stop_text in kept.text and kept.output_ids == trimmed.output_ids


def test_unknown_top_level_keys_are_ignored(via):
    # sglang-router adds keys such as these on its way through; a server must ignore them.
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2},
        "model": None,
        "log_metrics": True,
        "return_bytes": False,
        "stream": False,
        "return_text_in_logprobs": False,
        "not_a_field": 1,
    }
    response = _post(via, body)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 2


def test_an_unknown_sampling_param_is_refused_and_the_server_goes_on(target):
    # The embedded engine answers 400 naming the key. SGLang 0.5.17 on the H200 answered
    # 500 with the body "Internal Server Error" (a TypeError inside it:
    # bench/results/gpu/conformance_sglang_h200x1.txt): streamrl's client would take a 5xx
    # for a failing engine and retry it, so it refuses unknown keys itself before sending
    # (next test).
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus_param": 1}}
    response = _post(target.url, body)
    assert response.status_code in (400, 500), response.text
    if response.status_code == 400:
        assert "bogus_param" in response.text
    assert httpx.get(f"{target.url}/health", timeout=30).status_code == 200


async def test_the_client_refuses_what_the_server_cannot_serve_before_sending(target, model_dir):
    from streamrl.fleet.engine_set import EngineSet
    from streamrl.fleet.limits import RequestRejected
    from streamrl.models import model_config

    config = model_config(model_dir)
    async with EngineSet([target.url], timeout_s=60) as engines:
        limits = await engines.read_limits(
            vocab_size=config.vocab_size, model_max=config.max_position_embeddings
        )
        engines.set_limits(limits)
        client = engines.engines[0]
        # An id past the embedding killed SGLang 0.5.17 (a device-side assert on the H200).
        for prompt, params, reason in (
            ([*PROMPT, config.vocab_size], {"max_new_tokens": 2}, "token_out_of_vocab"),
            (PROMPT, {"max_new_tokens": 2, "bogus_param": 1}, "unknown_sampling_param"),
            (PROMPT, {"max_new_tokens": limits.context_length}, "context_overflow"),
        ):
            with pytest.raises(RequestRejected) as rejected:
                await client.generate(prompt, params)
            assert rejected.value.reason == reason
        result = await client.generate(PROMPT, {"max_new_tokens": 2})
        assert len(result.output_ids) == 2  # the server still serves


def test_the_router_registers_the_server_and_answers_404_to_control_calls(router, target):
    assert router.worker_urls() == [target.url]
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
    for path in (
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/destroy_weights_update_group",
    ):
        assert httpx.post(f"{router.url}{path}", json={}, timeout=10).status_code == 404, path
