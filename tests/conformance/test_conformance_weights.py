"""Conformance: weight updates as streamrl's weight publisher drives them.

What streamrl relies on: `/init_weights_update_group` joins a group that this
process hosts as rank 0 (built the SGLang way, `streamrl.weights.group`),
the engine taking ranks `rank_offset + tp_rank` of `world_size = 1 + tp_size`
(`streamrl.weights.layout`); `/update_weights_from_distributed` receives one
broadcast per name, in order, loads them and, with `weight_version`, reports
that version in `/get_model_info` and in `meta_info`; a request in flight
across an `in_place` update reports both versions in its `weight_versions`
spans when the server sends spans; an engine can hold one group per learner
pipeline stage; `/update_weights_from_disk` loads a checkpoint and sets the
version; `/destroy_weights_update_group` leaves the group. Every test puts the
served checkpoint and version back (from disk) before it ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import anyio
import httpx
import pytest
import torch
from conformance_support import (
    PROMPT,
    Target,
    Teacher,
    assert_matches_teacher,
    assert_spans_cover,
    logprob_error,
    perturbed,
    wait_running,
)

from streamrl.fleet.client import EngineClient
from streamrl.fleet.results import GenerateResult, parse_version
from streamrl.process import free_port
from streamrl.weights.group import (
    FLATTENED_BUCKET,
    broadcast_flat,
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
)
from streamrl.weights.layout import WeightGroupLayout, engine_gpu_count, weight_group_layout

pytestmark = pytest.mark.anyio

SAMPLE = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(target) -> dict:
    """The checkpoint and version the server started with (restored after every test)."""
    info = httpx.get(f"{target.url}/get_model_info", timeout=30).json()
    return {"model_path": info["model_path"], "weight_version": info["weight_version"]}


@pytest.fixture
async def engine(target, served):
    async with EngineClient(target.url, timeout_s=600) as client:
        try:
            yield client
        finally:
            await client.continue_generation()
            reply = await client.update_weights_from_disk(
                served["model_path"], weight_version=served["weight_version"]
            )
            assert reply["success"] is True, reply


async def _layout(engine: EngineClient) -> WeightGroupLayout:
    return weight_group_layout([engine_gpu_count(await engine.server_info())])


async def _join(engine: EngineClient, target: Target, layout: WeightGroupLayout, name: str):
    """The engine's init call in flight while this process hosts rank 0 of group `name`."""
    port = free_port(target.master_address)
    replies: list[dict] = []
    handle = None

    async def engine_side() -> None:
        replies.append(
            await engine.init_weights_update_group(
                master_address=target.master_address,
                master_port=port,
                rank_offset=layout.rank_offsets[0],
                world_size=layout.world_size,
                group_name=name,
                backend=target.backend,
            )
        )

    def trainer_side() -> None:
        nonlocal handle
        handle = init_weight_update_group(
            master_address=target.master_address,
            master_port=port,
            rank=0,
            world_size=layout.world_size,
            group_name=name,
            backend=target.backend,
            timeout_s=120,
        )

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine_side)
        await anyio.to_thread.run_sync(trainer_side)
    assert replies[0]["success"] is True, replies
    return handle


async def _send(
    engine: EngineClient,
    target: Target,
    group,
    name: str,
    weights: dict[str, torch.Tensor],
    version: str | None,
    load_format: str | None = None,
    flush_cache: bool = False,
) -> None:
    """One bucket, as the publisher sends it: the update call in flight during the broadcast
    (one broadcast per tensor, or one of their bytes back to back with "flattened_bucket";
    `flush_cache` as the publisher sets it on the last bucket in `abort` mode)."""
    tensors = [tensor.to(target.device).contiguous() for tensor in weights.values()]
    replies: list[dict] = []

    async def engine_side() -> None:
        replies.append(
            await engine.update_weights_from_distributed(
                list(weights),
                [tensor.dtype for tensor in tensors],
                [tensor.shape for tensor in tensors],
                group_name=name,
                weight_version=version,
                flush_cache=flush_cache,
                load_format=load_format,
            )
        )

    def trainer_side() -> None:
        if load_format == FLATTENED_BUCKET:
            flat = torch.cat([tensor.reshape(-1).view(torch.uint8) for tensor in tensors])
            broadcast_flat(group, flat)
        else:
            broadcast_tensors(group, tensors)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine_side)
        await anyio.to_thread.run_sync(trainer_side)
    assert replies[0]["success"] is True, replies


async def _leave(engine: EngineClient, groups: Sequence[tuple[str, object]]) -> None:
    for name, handle in groups:
        reply = await engine.destroy_weights_update_group(name)
        destroy_weight_update_group(handle)
        assert reply["success"] is True, reply


def _new_weights(target: Target, teacher: Teacher, seed: int) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, target.weights_dtype)
    return {n: t.to(dtype) for n, t in perturbed(teacher.parameters(), seed=seed).items()}


def _next_version(served: dict, step: int) -> str:
    return str(parse_version(served["weight_version"]) + step)


def _assert_changed(
    target: Target, teacher: Teacher, result: GenerateResult, new: dict[str, torch.Tensor]
) -> None:
    """The outputs follow the new weights, not the served ones: their logprobs are farther
    from the served weights' than from the new ones' by a clear margin. (The margin was 10x
    the tolerance; on the H200 with SGLang's bf16 tolerance of 0.05 the perturbation moved
    the logprobs by 0.40 on average, which the fixed factor wrongly read as unchanged.)"""
    to_served, _ = logprob_error(result.logprobs, teacher.logprobs(PROMPT, result.output_ids))
    to_new, _ = logprob_error(result.logprobs, teacher.logprobs(PROMPT, result.output_ids, new))
    assert to_served > 3 * target.logprob_tol and to_served > 5 * to_new, (
        f"the outputs still follow the served weights: {to_served:.3g} from them, "
        f"{to_new:.3g} from the new ones"
    )


async def test_a_broadcast_update_changes_outputs_and_tags_the_version_even_mid_request(
    target, teacher, served, engine
):
    layout = await _layout(engine)
    name = f"conformance-{uuid.uuid4().hex[:8]}"
    group = await _join(engine, target, layout, name)
    new = _new_weights(target, teacher, seed=11)
    version = _next_version(served, 7)
    try:
        straddling: list[GenerateResult] = []
        async with anyio.create_task_group() as tasks:

            async def generate() -> None:
                straddling.append(await engine.generate(PROMPT, target.long_params))

            tasks.start_soon(generate)
            await anyio.to_thread.run_sync(wait_running, target)
            await engine.pause("in_place")
            await _send(engine, target, group, name, new, version)
            await engine.continue_generation()
        # The engine is idle now. SGLang kept the straddling request's prefix in its radix
        # cache, computed with the old weights, and a new request would reuse it (on the
        # H200 the next request's logprobs were 0.24 nats off the new weights' teacher on
        # average); nothing could flush it during the update while the request was held.
        # streamrl therefore pauses SGLang with `abort` (next test); here the cache is
        # flushed by hand before checking the new weights.
        assert await engine.flush_cache()
        after = await engine.generate(PROMPT, SAMPLE)
    finally:
        await _leave(engine, [(name, group)])

    (request,) = straddling
    assert request.finish_reason.type == "length" and request.weight_version == int(version)
    spans = assert_spans_cover(request.meta, len(request.output_ids))
    if spans is not None:
        assert [span["version"] for span in spans] == [served["weight_version"], version], spans
    assert await engine.weight_version() == int(version)
    assert after.meta["weight_version"] == version and after.versions == [int(version)] * 16
    assert_matches_teacher(target, teacher, PROMPT, after, new)
    _assert_changed(target, teacher, after, new)


async def test_an_abort_update_gives_exact_versions_per_segment_and_no_stale_prefix(
    target, teacher, served, engine
):
    """What the publisher does with `weights.pause_mode = "abort"` (the default for SGLang):
    pause with abort, update with `flush_cache` on the last bucket, continue. The request in
    flight comes back aborted with its partial output and is resumed from it as a new
    request (`GenerateContext.generate`); each response then comes from one version, so
    every token's version is exact even without spans, and the resumed part, prefilled
    again, follows the new weights."""
    from streamrl.agents.api import GenerateContext, VersionRule
    from streamrl.fleet.engine_set import EngineSet

    layout = await _layout(engine)
    name = f"conformance-{uuid.uuid4().hex[:8]}"
    group = await _join(engine, target, layout, name)
    new = _new_weights(target, teacher, seed=15)
    old_version, version = parse_version(served["weight_version"]), _next_version(served, 4)
    await engine.generate(PROMPT, SAMPLE)  # the prompt's prefix is now in any prefix cache
    try:
        async with EngineSet([target.url]) as engines, anyio.create_task_group() as tasks:
            ctx = GenerateContext(
                engines=engines,
                tokenizer=None,
                sampling_params=target.long_params,
                version_rule=VersionRule(single_version=True),
            )
            completions = []

            async def generate() -> None:
                completions.append(await ctx.generate(PROMPT))

            tasks.start_soon(generate)
            await anyio.to_thread.run_sync(wait_running, target)
            await engine.pause("abort")
            await _send(engine, target, group, name, new, version, flush_cache=True)
            await engine.continue_generation()
    finally:
        await _leave(engine, [(name, group)])

    (completion,) = completions
    split = completion.versions.index(int(version))
    assert completion.num_resumes >= 1 and completion.versions_exact
    assert 0 < split < target.long_tokens == len(completion.output_ids)
    assert completion.versions == [old_version] * split + [int(version)] * (
        target.long_tokens - split
    )
    assert completion.resume_prompt_tokens == len(PROMPT) + split
    before = teacher.logprobs(PROMPT, completion.output_ids[:split])
    after = teacher.logprobs(
        PROMPT + completion.output_ids[:split], completion.output_ids[split:], new
    )
    for actual, expected in (
        (completion.logprobs[:split], before),
        (completion.logprobs[split:], after),
    ):
        mean, worst = logprob_error(actual, expected)
        assert mean <= target.logprob_tol and worst <= 10 * target.logprob_tol, (mean, worst)


async def test_a_flattened_bucket_update_loads_the_same_weights(target, teacher, served, engine):
    name = f"conformance-{uuid.uuid4().hex[:8]}"
    group = await _join(engine, target, await _layout(engine), name)
    new = _new_weights(target, teacher, seed=14)
    version = _next_version(served, 3)
    try:
        await engine.pause("in_place")
        await _send(engine, target, group, name, new, version, load_format=FLATTENED_BUCKET)
        await engine.continue_generation()
    finally:
        await _leave(engine, [(name, group)])
    result = await engine.generate(PROMPT, SAMPLE)
    assert result.versions == [int(version)] * 16
    assert_matches_teacher(target, teacher, PROMPT, result, new)
    _assert_changed(target, teacher, result, new)


async def test_the_publisher_hands_its_weights_over_by_reference_twice_from_one_buffer(
    target, teacher, served, engine
):
    """`weights.transport = "ipc"` as a run drives it: the real `WeightPublisher` and
    `IpcTransport` (on this process's GPU where there is one: CUDA IPC handles; else shared
    memory), two versions staged in the same buffers, `in_place`. SGLang is paused around its
    per-tensor `/update_weights_from_tensor` calls; the embedded engine stages each version
    while it generates and loads it at a step boundary (the second one from the buckets it
    kept mapped). Each engine's GPU count is asked once; the outputs follow the last version."""
    from streamrl.fleet.client import engine_gpu_counts
    from streamrl.publish.ipc_transport import IpcTransport
    from streamrl.publish.publisher import WeightPublisher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights: dict[str, torch.Tensor] = {}
    published: list[int] = []
    asked: list[int] = []

    async def on_published(version: int) -> None:
        published.append(version)

    async def gpu_counts(engines: list[EngineClient]) -> list[int]:
        asked.append(len(engines))
        return await engine_gpu_counts(engines)

    publisher = WeightPublisher(
        weights=lambda: iter(weights.items()),
        members=lambda: [engine],
        on_published=on_published,
        transport=IpcTransport(gpu_counts=gpu_counts),
        pause_mode="in_place",
        bucket_bytes=1 << 20,  # several buckets
        staging_device=device,
    )
    first = parse_version(served["weight_version"]) + 5
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        for version, seed in ((first, 21), (first + 1, 22)):
            new = _new_weights(target, teacher, seed=seed)
            weights = {name: tensor.to(device) for name, tensor in new.items()}
            await publisher.publish(version)
            await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    # Nothing held a request across the update, but SGLang's radix cache may keep the
    # prompt's prefix from before it (the `in_place` test above): flushed by hand.
    assert await engine.flush_cache()
    result = await engine.generate(PROMPT, SAMPLE)
    assert published == [first, first + 1] and all(r.ok for r in publisher.records)
    assert asked == [1]  # once per engine, not per update
    assert result.versions == [first + 1] * 16
    assert_matches_teacher(target, teacher, PROMPT, result, new)
    _assert_changed(target, teacher, result, new)


async def test_update_weights_from_disk_brings_back_the_checkpoint_and_sets_the_version(
    target, teacher, served, engine
):
    name = f"conformance-{uuid.uuid4().hex[:8]}"
    group = await _join(engine, target, await _layout(engine), name)
    try:
        await _send(engine, target, group, name, _new_weights(target, teacher, seed=12), "1")
    finally:
        await _leave(engine, [(name, group)])
    version = _next_version(served, 9)
    reply = await engine.update_weights_from_disk(served["model_path"], weight_version=version)
    assert reply["success"] is True, reply
    result = await engine.generate(PROMPT, SAMPLE)
    assert result.versions == [int(version)] * 16
    assert (await engine.model_info())["weight_version"] == version
    assert_matches_teacher(target, teacher, PROMPT, result)


async def test_one_engine_takes_updates_from_two_groups_as_two_pipeline_stages_would(
    target, teacher, served, engine
):
    layout = await _layout(engine)
    names = [f"conformance-stage{stage}-{uuid.uuid4().hex[:8]}" for stage in (0, 1)]
    groups = [(name, await _join(engine, target, layout, name)) for name in names]
    new = _new_weights(target, teacher, seed=13)
    half = len(new) // 2
    stages = [dict(list(new.items())[:half]), dict(list(new.items())[half:])]
    version = _next_version(served, 5)
    try:
        await engine.pause("in_place")
        for (name, group), weights, stage_version in zip(
            groups, stages, (None, version), strict=True
        ):
            await _send(engine, target, group, name, weights, stage_version)
        await engine.continue_generation()
    finally:
        await _leave(engine, groups)
    result = await engine.generate(PROMPT, SAMPLE)
    assert result.versions == [int(version)] * 16
    assert_matches_teacher(target, teacher, PROMPT, result, new)
