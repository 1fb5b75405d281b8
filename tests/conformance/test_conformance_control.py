"""Conformance: pause modes, abort, flush, health and info, as the weight publisher, the fleet
and the rollout worker use them.

What streamrl relies on: `pause_generation {mode}` returns once the engine is
paused; with `abort` the requests in flight answer HTTP 200 with
`finish_reason.type == "abort"` and their partial output (tokens, logprobs),
which the rollout worker resumes from; with `in_place` and `retract` they are
kept and finish after `continue_generation`; a `/generate` sent while paused
waits (it is not refused); `abort_request` ends one rid, or every request with
`abort_all`; `flush_cache` answers 200, or 400 while requests run (never an
error); `/health`, `/health_generate`, `/get_model_info` and `/get_server_info`
answer (the new `/model_info`, `/server_info` names may be 404: the client
falls back).
"""

from __future__ import annotations

import anyio
import httpx
import pytest
from conformance_support import PROMPT, assert_matches_teacher, wait_held, wait_running

from streamrl.fleet.client import EngineClient
from streamrl.fleet.results import GenerateResult, parse_version
from streamrl.weights.layout import engine_gpu_count

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine(target):
    """A client of the server; it is left unpaused whatever the test did."""
    async with EngineClient(target.url, timeout_s=300) as client:
        yield client
        await client.continue_generation()


async def _wait(fn, *args):
    await anyio.to_thread.run_sync(fn, *args)


def _assert_partial(result: GenerateResult, budget: int) -> None:
    assert result.is_aborted, result.finish_reason
    assert len(result.output_ids) < budget
    assert len(result.logprobs) == len(result.output_ids) == len(result.versions)


async def test_pause_abort_answers_requests_in_flight_with_their_partial_output(
    via, target, teacher, engine
):
    budget = target.long_params["max_new_tokens"]
    results: list[GenerateResult] = []
    async with EngineClient(via, timeout_s=300) as generator, anyio.create_task_group() as tasks:

        async def generate() -> None:
            results.append(await generator.generate(PROMPT, target.long_params))

        tasks.start_soon(generate)
        await _wait(wait_running, target)
        reply = await engine.pause("abort")
        assert reply["status"] == "ok"
    (result,) = results
    _assert_partial(result, budget)
    assert len(result.output_ids) > 0, "a running request had produced no token"
    assert_matches_teacher(target, teacher, PROMPT, result)


async def test_a_generate_sent_while_paused_waits_until_continue(via, target, engine):
    await engine.pause("in_place")
    results: list[GenerateResult] = []
    async with EngineClient(via, timeout_s=300) as generator, anyio.create_task_group() as tasks:

        async def generate() -> None:
            results.append(await generator.generate(PROMPT, {"max_new_tokens": 4}))

        tasks.start_soon(generate)
        await _wait(wait_held, target)
        await anyio.sleep(0.2)
        assert results == [], "a /generate sent while paused was answered before continue"
        reply = await engine.continue_generation()
        assert reply["status"] == "ok"
    (result,) = results
    assert result.finish_reason.type == "length" and len(result.output_ids) == 4


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_in_place_and_retract_keep_requests_in_flight_and_they_finish_after_continue(
    mode, target, teacher, engine
):
    budget = target.long_params["max_new_tokens"]
    results: list[GenerateResult] = []
    async with anyio.create_task_group() as tasks:

        async def generate() -> None:
            results.append(await engine.generate(PROMPT, target.long_params))

        tasks.start_soon(generate)
        await _wait(wait_running, target)
        await engine.pause(mode)
        await anyio.sleep(0.2)
        assert results == [], f"a request in flight was answered during a {mode} pause"
        await engine.continue_generation()
    (result,) = results
    assert result.finish_reason.type == "length" and len(result.output_ids) == budget
    assert_matches_teacher(target, teacher, PROMPT, result)


async def test_abort_request_ends_one_rid_and_abort_all_ends_the_rest(target, engine):
    budget = target.long_params["max_new_tokens"]
    results: dict[str, GenerateResult] = {}
    async with anyio.create_task_group() as tasks:

        async def generate(rid: str) -> None:
            results[rid] = await engine.generate(PROMPT, target.long_params, rid=rid)

        for rid in ("abort-one", "abort-all-a", "abort-all-b"):
            tasks.start_soon(generate, rid)
        await _wait(wait_running, target, 3)
        await engine.abort("abort-one")
        with anyio.fail_after(60):
            while "abort-one" not in results:
                await anyio.sleep(0.02)
        assert set(results) == {"abort-one"}, "abort_request by rid ended other requests"
        await engine.abort(abort_all=True)
    assert results["abort-one"].rid == "abort-one"
    for result in results.values():
        _assert_partial(result, budget)


async def test_flush_cache_is_200_when_idle_and_never_an_error_while_requests_run(target, engine):
    assert await engine.flush_cache() is True
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine.generate, PROMPT, target.long_params)
        await _wait(wait_running, target)
        assert await engine.flush_cache() in (True, False)  # 200, or 400 while busy
        await engine.abort(abort_all=True)


async def test_health_and_health_generate_answer_200(target, engine):
    await engine.health()
    await engine.health_generate(timeout_s=60)


def test_the_router_answers_health_itself(router):
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


def test_model_info_and_server_info_answer_under_the_old_names_and_the_new_or_404(target):
    old = httpx.get(f"{target.url}/get_model_info", timeout=30)
    assert old.status_code == 200, old.text
    info = old.json()
    assert info["model_path"] and info["is_generation"] is True
    parse_version(info["weight_version"])
    new = httpx.get(f"{target.url}/model_info", timeout=30)
    assert new.status_code in (200, 404)
    if new.status_code == 200:
        assert new.json()["model_path"] == info["model_path"]

    old = httpx.get(f"{target.url}/get_server_info", timeout=30)
    assert old.status_code == 200, old.text
    server = old.json()
    assert isinstance(server["version"], str)
    assert engine_gpu_count(server) >= 1  # tp_size, in a layout weight sync supports
    assert httpx.get(f"{target.url}/server_info", timeout=30).status_code in (200, 404)
