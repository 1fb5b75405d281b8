"""The embedded engine's memory handoff over real HTTP (`/release_memory_occupation`,
`/resume_memory_occupation`) on the session's shared engine, in one process and in two (a
refusal then comes from the model's process over the bridge)."""

from __future__ import annotations

import anyio
import pytest
from engine_helpers import engine_load, wait_until

from streamrl.fleet.client import EngineClient, EngineError

pytestmark = pytest.mark.anyio

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 3}


async def _wait_for(url: str, count: str) -> None:
    """Until the engine's `/get_load` `count` is 1 (waited in a thread: the loop runs on)."""
    await anyio.to_thread.run_sync(
        lambda: wait_until(lambda: engine_load(url)[count] == 1, what=count)
    )


@pytest.fixture
async def client(engine):
    async with EngineClient(engine.url, timeout_s=120) as client:
        yield client


async def test_a_release_frees_weights_and_kv_cache_and_generate_is_refused_until_weights_come_back(
    engine, client
):
    before = await client.generate(PROMPT, GREEDY)
    resident = engine_load(engine.url)["resident_bytes"]
    assert resident["weights"] > 0 and resident["kv_cache"] > 0

    answer = await client.release_memory_occupation()
    assert answer["released_bytes"] == resident["weights"] + resident["kv_cache"]
    load = engine_load(engine.url)
    assert load["resident_bytes"] == {"weights": 0, "kv_cache": 0}
    assert load["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(EngineError) as refused:
        await client.generate(PROMPT, GREEDY)
    assert refused.value.status == 400 and "released" in refused.value.body
    assert (await client.health_generate()) is None  # a handed-over engine is healthy

    await client.resume_memory_occupation()
    assert engine_load(engine.url)["resident_bytes"] == resident
    with pytest.raises(EngineError) as stale:  # the values did not survive the release
        await client.generate(PROMPT, GREEDY)
    assert stale.value.status == 400 and "not updated" in stale.value.body

    pushed = await client.update_weights_from_disk(engine.model_dir, weight_version="default")
    assert pushed["success"] is True
    after = await client.generate(PROMPT, GREEDY)
    assert after.output_ids == before.output_ids
    assert after.logprobs == before.logprobs


async def test_a_kv_cache_release_alone_keeps_the_weights_and_needs_no_push(engine, client):
    before = await client.generate(PROMPT, GREEDY)
    await client.release_memory_occupation(["kv_cache"])
    load = engine_load(engine.url)
    assert load["resident_bytes"]["kv_cache"] == 0 and load["resident_bytes"]["weights"] > 0
    await client.resume_memory_occupation(["kv_cache"])
    after = await client.generate(PROMPT, GREEDY)
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs


async def test_a_release_with_requests_running_is_refused_and_a_paused_call_waits_out_the_handoff(
    engine, client
):
    before = await client.generate(PROMPT, GREEDY)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(client.generate, PROMPT, LONG)
        await _wait_for(engine.url, "num_running_reqs")
        with pytest.raises(EngineError) as busy:
            await client.release_memory_occupation()
        assert busy.value.status == 400 and "running" in busy.value.body
        await client.pause("abort")  # ends the long request with its partial output
    await client.release_memory_occupation()
    results = []

    async def held_call() -> None:
        results.append(await client.generate(PROMPT, GREEDY))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(held_call)
        await _wait_for(engine.url, "num_paused_reqs")
        await client.resume_memory_occupation()
        await client.update_weights_from_disk(engine.model_dir, weight_version="default")
        await client.continue_generation()
    assert results[0].output_ids == before.output_ids


async def test_unknown_tags_and_resuming_what_is_not_released_are_400s(client):
    with pytest.raises(EngineError) as unknown:
        await client.release_memory_occupation(["activations"])
    assert unknown.value.status == 400 and "unknown memory tags" in unknown.value.body
    with pytest.raises(EngineError) as not_released:
        await client.resume_memory_occupation(["weights"])
    assert not_released.value.status == 400 and "not released" in not_released.value.body
