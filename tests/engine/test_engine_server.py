"""The embedded engine over real HTTP: the session's shared `streamrl engine serve` process
(`tiny_engine`) and the same split in two processes (`tiny_split_engine`, `--http-process
on`: every test of the `engine` fixture runs on both), and one of its own for the shutdown
test."""

from __future__ import annotations

import signal
import time

import anyio
import httpx
import pytest
from engine_helpers import engine_load, running_engines, teacher_forced_logprobs, wait_until

from streamrl.fleet.client import EngineClient, EngineError
from streamrl.fleet.results import parse_result

pytestmark = pytest.mark.anyio

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 3}


@pytest.fixture
async def client(engine):
    async with EngineClient(engine.url, timeout_s=120) as client:
        yield client
        # Leave the engine as the next test expects it.
        await client.continue_generation()


async def test_c_logprobs_returned_over_http_equal_a_teacher_forced_forward_pass(engine, client):
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    result = await client.generate(PROMPT, params, rid="teacher-forced")
    assert result.rid == "teacher-forced"
    assert len(result.output_ids) == 24 and len(result.logprobs) == 24
    assert result.finish_reason.type == "length" and result.finish_reason.length == 24
    assert result.prompt_tokens == len(PROMPT)
    expected = teacher_forced_logprobs(engine.model_dir, PROMPT, result.output_ids)
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) <= 1e-4
    spans = result.meta["weight_versions"]
    assert spans == [{"version": "default", "start": 0, "end": 24}]
    assert result.versions == [0] * 24 and result.versions_exact
    assert [entry[1] for entry in result.meta["output_token_logprobs"]] == result.output_ids


async def test_text_batches_and_n_samples_come_back_prompt_major(client):
    response = httpx.post(
        f"{client.url}/generate",
        json={
            "text": ["Hello there", "The sky is"],
            "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 3, "n": 2, "sampling_seed": 1},
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    results = [parse_result(item) for item in response.json()]
    assert [r.rid for r in results] == ["a-0", "a-1", "b-0", "b-1"]
    assert all(len(r.output_ids) == 3 and r.logprobs == [] for r in results)
    assert results[0].prompt_tokens == results[1].prompt_tokens
    many = await client.generate_many([PROMPT, PROMPT[:3]], {"max_new_tokens": 2})
    assert [r.prompt_tokens for r in many] == [len(PROMPT), 3]


async def test_stop_token_ids_and_stop_strings_end_generation_and_trim_the_text(client):
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    free = await client.generate(PROMPT, greedy)
    stop_id = free.output_ids[5]
    first = free.output_ids.index(stop_id)
    stopped = await client.generate(PROMPT, {**greedy, "stop_token_ids": [stop_id]})
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason.type == "stop" and stopped.finish_reason.matched == stop_id

    stop_text = free.text[len(free.text) // 2 :][:4]
    assert stop_text.strip(), free.text
    by_string = await client.generate(PROMPT, {**greedy, "stop": [stop_text]})
    assert by_string.finish_reason.type == "stop" and by_string.finish_reason.matched == stop_text
    assert stop_text not in by_string.text
    untrimmed = await client.generate(PROMPT, {**greedy, "stop": stop_text, "no_stop_trim": True})
    assert untrimmed.text.endswith(stop_text) or stop_text in untrimmed.text


async def test_d_an_unknown_sampling_param_is_a_400_and_unknown_top_level_keys_are_ignored(client):
    with pytest.raises(EngineError) as error:
        await client.generate(PROMPT, {"max_new_tokens": 2, "bogus_param": 1})
    assert error.value.status == 400 and "bogus_param" in error.value.body
    assert "message" in httpx.Response(400, content=error.value.body).json()["error"]
    # What sglang-router adds on its way through, plus nulls meaning "default".
    response = httpx.post(
        f"{client.url}/generate",
        json={
            "input_ids": PROMPT,
            "model": None,
            "return_bytes": False,
            "log_metrics": True,
            "stream": False,
            "return_text_in_logprobs": False,
            "sampling_params": {"max_new_tokens": 2, "top_k": None, "frequency_penalty": 0.0},
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 2


async def test_bad_requests_are_400_with_an_error_message(client):
    for body in (
        b"not json",
        b"{}",
        b'{"input_ids": []}',
        b'{"input_ids": [1, 2], "sampling_params": {"temperature": -1}}',
        b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}',
        b'{"input_ids": [[1], [2]], "rid": "one"}',
        b'{"input_ids": [1, true]}',
        b'{"input_ids": [1, 2.5]}',
        b'{"input_ids": [[1, 2], [3, "x"]]}',
        b'{"input_ids": [[1, 2], []]}',
        b'{"input_ids": [1, 2], "stream": true, "sampling_params": {"n": 2}}',
        b'{"input_ids": [[1], [2]], "stream": true}',
        b'{"input_ids": [1, 2], "stream": true, "sampling_params": {"stream_interval": 0}}',
    ):
        response = httpx.post(f"{client.url}/generate", content=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["message"]


def stream_events(url: str, body: dict) -> list:
    """The JSON payloads of a streamed `/generate`, then the literal `[DONE]`."""
    events = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(
                    payload if payload == "[DONE]" else httpx.Response(200, content=payload).json()
                )
    return events


async def test_a_streamed_generate_sends_the_response_so_far_and_ends_like_the_plain_one(client):
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    plain = await client.generate(PROMPT, greedy)
    body = {"input_ids": PROMPT, "sampling_params": greedy, "return_logprob": True, "stream": True}
    events = stream_events(client.url, body)
    assert events[-1] == "[DONE]"
    *running, final = [parse_result(event) for event in events[:-1]]
    assert final.output_ids == plain.output_ids and final.text == plain.text
    assert final.finish_reason.type == "length"
    assert max(abs(a - b) for a, b in zip(final.logprobs, plain.logprobs, strict=True)) <= 1e-5
    # One event per token (stream_interval 1), each a prefix of the final output, unfinished.
    assert [len(event.output_ids) for event in running] == list(range(1, 6))
    assert all(event.output_ids == plain.output_ids[: len(event.output_ids)] for event in running)
    assert all(event["meta_info"]["finish_reason"] is None for event in events[:-2])
    # SGLang's interval rule: events after tokens 1, 1 + k, 1 + 2k, ..., then the final one.
    spaced = {**body, "sampling_params": {**greedy, "stream_interval": 4}}
    counts = [
        event["meta_info"]["completion_tokens"] for event in stream_events(client.url, spaced)[:-1]
    ]
    assert counts == [1, 5, 6]


async def test_d_a_paused_generate_waits_rather_than_fails(engine, client):
    assert (await client.pause("in_place"))["status"] == "ok"
    results = []

    async def generate() -> None:
        results.append(await client.generate(PROMPT, {"max_new_tokens": 4}))

    async with anyio.create_task_group() as group:
        group.start_soon(generate)
        await anyio.to_thread.run_sync(
            lambda: wait_until(
                lambda: engine_load(engine.url)["num_paused_reqs"] == 1, what="request held"
            )
        )
        assert results == []
        await client.continue_generation()
    assert results[0].finish_reason.type == "length" and len(results[0].output_ids) == 4


async def test_d_abort_returns_200_with_finish_reason_abort_and_partial_output(engine, client):
    results = []

    async def generate() -> None:
        results.append(await client.generate(PROMPT, LONG, rid="to-abort"))

    async with anyio.create_task_group() as group:
        group.start_soon(generate)
        await anyio.to_thread.run_sync(
            lambda: wait_until(
                lambda: engine_load(engine.url)["num_running_reqs"] == 1, what="request running"
            )
        )
        # A step boundary after the request started: it holds at least its first token.
        await client.pause("in_place")
        await client.abort("to-abort")
        await client.continue_generation()
    (result,) = results
    assert result.is_aborted and result.rid == "to-abort"
    assert 0 < len(result.output_ids) < LONG["max_new_tokens"]
    assert len(result.logprobs) == len(result.output_ids) == len(result.versions)
    expected = teacher_forced_logprobs(engine.model_dir, PROMPT, result.output_ids)
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) <= 1e-4


async def test_abort_all_ends_requests_waiting_behind_a_pause(client):
    await client.pause("abort")
    results = []

    async def generate(rid: str) -> None:
        results.append(await client.generate(PROMPT, {"max_new_tokens": 4}, rid=rid))

    async with anyio.create_task_group() as group:
        for rid in ("w1", "w2"):
            group.start_soon(generate, rid)
        await anyio.to_thread.run_sync(
            lambda: wait_until(
                lambda: engine_load(client.url)["num_paused_reqs"] == 2, what="requests held"
            )
        )
        await client.abort(abort_all=True)
    assert sorted(r.rid for r in results) == ["w1", "w2"]
    assert all(r.is_aborted and r.output_ids == [] for r in results)


async def test_a_client_that_disconnects_aborts_its_request(client):
    async with EngineClient(client.url, timeout_s=120) as impatient:
        with anyio.move_on_after(60) as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(impatient.generate, PROMPT, LONG)
                await anyio.to_thread.run_sync(
                    lambda: wait_until(
                        lambda: engine_load(client.url)["num_running_reqs"] == 1, what="running"
                    )
                )
                group.cancel_scope.cancel()
        assert not scope.cancelled_caught
    # The handler is cancelled with the connection and the core drops the request.
    await anyio.to_thread.run_sync(
        lambda: wait_until(
            lambda: engine_load(client.url)["num_reqs"] == 0, what="request dropped", timeout_s=20
        )
    )


async def test_health_info_and_cache_endpoints_answer_like_sglang(engine, client):
    await client.health()
    await client.health_generate()
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{engine.url}{path}", timeout=10).json()
        assert info["model_path"] == engine.model_dir and info["is_generation"] is True
        assert info["weight_version"] == "default" and "architectures" in info
    server_info = await client.server_info()
    assert server_info["port"] == int(engine.url.rsplit(":", 1)[1]) and server_info["tp_size"] == 1
    assert "version" in server_info
    assert httpx.get(f"{engine.url}/get_server_info", timeout=10).status_code == 200
    assert await client.flush_cache() is True
    with pytest.raises(EngineError) as error:
        await client.pause("sideways")
    assert error.value.status == 400


async def test_update_weights_from_disk_switches_weights_and_version(engine, client, tmp_path):
    from safetensors.torch import load_file

    from streamrl.models import save_random_model

    other = save_random_model("qwen3-tiny", tmp_path / "other", seed=1)
    result = await client.update_weights_from_disk(str(other), weight_version=5)
    assert result["success"] is True
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    after = await client.generate(PROMPT, params)
    assert after.weight_version == 5 and after.versions == [5] * 8
    state = load_file(str(other / "model.safetensors"))
    expected = teacher_forced_logprobs(engine.model_dir, PROMPT, after.output_ids, state)
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) <= 1e-4
    assert (await client.model_info())["weight_version"] == "5"
    # Put the original weights back for the other tests.
    await client.update_weights_from_disk(engine.model_dir, weight_version="default")
    with pytest.raises(EngineError) as error:
        await client.update_weights_from_disk(str(tmp_path / "missing"))
    assert error.value.status == 400 and '"success":false' in error.value.body.replace(" ", "")


def test_the_client_expands_version_spans_and_falls_back_to_the_final_version():
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 2}
    with_spans = {
        **meta,
        "weight_version": "4",
        "weight_versions": [
            {"version": "default", "start": 0, "end": 1},
            {"version": "4", "start": 1, "end": 3},
        ],
        "output_token_logprobs": [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]],
    }
    result = parse_result({"text": "x", "output_ids": [7, 8, 9], "meta_info": with_spans})
    assert result.versions == [0, 4, 4] and result.versions_exact and result.weight_version == 4
    assert result.logprobs == [-0.5, -1.0, -2.0] and result.finish_reason.length == 3
    # A server that reports only the final version: every token gets it, flagged inexact.
    plain = parse_result({"output_ids": [7, 8], "meta_info": {**meta, "weight_version": "6"}})
    assert plain.versions == [6, 6] and not plain.versions_exact and plain.logprobs == []
    with pytest.raises(ValueError, match="cover"):
        bad = {**with_spans, "weight_versions": [{"version": "4", "start": 0, "end": 2}]}
        parse_result({"output_ids": [7, 8, 9], "meta_info": bad})
    with pytest.raises(ValueError, match="neither"):
        parse_result({"output_ids": [7], "meta_info": {**meta, "weight_version": "v7"}})


def test_the_fast_text_decoder_gives_what_the_tokenizer_decode_gives():
    import random

    from streamrl.engine.protocol import TextDecoder
    from streamrl.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    decode = TextDecoder(tokenizer)
    assert decode._rust is not None  # the path under test, not the fallback
    draw = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(100):
        ids = [draw.randrange(len(tokenizer)) for _ in range(draw.randrange(1, 30))]
        ids.insert(draw.randrange(len(ids)), draw.choice(specials))
        for skip in (True, False):
            ours = decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)
            assert ours == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_the_server_loop_is_uvloop_when_installed_and_asyncio_otherwise(monkeypatch):
    import sys

    uvloop = pytest.importorskip("uvloop")
    from streamrl.mains.engine import event_loop_factory

    assert event_loop_factory() is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop_factory() is None


def test_stop_signals_that_keep_coming_through_the_shutdown_leave_exit_code_0(
    tiny_model_dir, tmp_path
):
    """A launcher's stop() after its first SIGTERM, or a user's repeated Ctrl-C, must not
    kill the engine with the signal's default action at any moment of its shutdown."""
    with running_engines(tiny_model_dir, tmp_path) as engines:  # it asserts exit code 0
        process = engines[0].process
        deadline = time.monotonic() + 60
        while process.is_alive():  # before, during and after the event loop's shutdown
            assert time.monotonic() < deadline, "the engine did not stop within 60 s"
            process.signal(signal.SIGTERM)
            process.signal(signal.SIGINT)
    assert process.popen.returncode == 0


async def test_once_loaded_the_server_keeps_its_objects_out_of_the_collectors_reach(
    tiny_model_dir,
):
    """A full collection would otherwise walk every torch/transformers object while holding
    the GIL the engine thread needs between steps."""
    import gc

    from streamrl.engine.app import EngineServer
    from streamrl.engine.options import EngineOptions

    server = EngineServer(EngineOptions(model=tiny_model_dir, max_batch_size=2))
    try:
        await server.load()
        assert server.is_ready and gc.get_freeze_count() > 0
        assert not any(obj is server.core for obj in gc.get_objects())
    finally:
        await server.close()
        gc.unfreeze()  # the rest of the session collects as before
