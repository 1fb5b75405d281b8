"""Weights by reference (`streamrl.weights.ipc`): another process maps the sender's
memory (shared memory on CPU; CUDA IPC handles on a GPU, not run here)."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from streamrl.weights.group import FlatLayout
from streamrl.weights.ipc import deserialize_named_tensors, serialize_named_tensors

_RECEIVER = """
import sys, torch
from streamrl.weights.ipc import deserialize_named_tensors
named = deserialize_named_tensors(sys.stdin.read())
torch.save({name: tensor.clone() for name, tensor in named}, sys.argv[1])
"""


def test_views_of_a_staging_buffer_arrive_in_another_process_by_reference(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator),
        "model.norm.weight": torch.randn(6, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(5, 7, generator=generator),
    }
    layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors.values()])
    flat = torch.empty(layout.num_bytes, dtype=torch.uint8)
    layout.pack(list(tensors.values()), flat)
    payload = serialize_named_tensors(list(zip(tensors, layout.unpack(flat), strict=True)))
    # By reference: the payload is a few hundred bytes whatever the tensors' size.
    assert len(base64.b64decode(payload)) < 2_000 < layout.num_bytes * 10
    out = tmp_path / "received.pt"
    done = subprocess.run(
        [sys.executable, "-c", _RECEIVER, str(out)], input=payload, text=True, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    received = torch.load(out)
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_a_payload_naming_anything_but_torch_rebuilders_is_refused():
    payload = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
    with pytest.raises(ValueError, match="refused to load"):
        deserialize_named_tensors(payload)
    with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps({"x": 1})).decode())


@pytest.mark.anyio
async def test_the_publisher_hands_a_live_engine_its_weights_by_reference(tiny_model_dir, tmp_path):
    import anyio
    from engine_helpers import running_engines, teacher_forced_logprobs

    from streamrl.fleet.client import EngineClient, engine_gpu_counts
    from streamrl.models import build_random_model
    from streamrl.publish.ipc_transport import IpcTransport
    from streamrl.publish.publisher import WeightPublisher

    prompt = [1, 504, 3458, 314, 253, 1380, 30, 2]
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    weights: dict[str, torch.Tensor] = {}
    published: list[int] = []
    asked: list[list[str]] = []

    async def on_published(version: int) -> None:
        published.append(version)

    async def gpu_counts(engines: list[EngineClient]) -> list[int]:
        asked.append([engine.url for engine in engines])
        return await engine_gpu_counts(engines)

    pauses: list[str] = []

    class Client(EngineClient):
        async def pause(self, mode: str = "abort") -> dict:
            pauses.append(mode)
            return await super().pause(mode)

    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with Client(engine.url, timeout_s=120) as client:
            publisher = WeightPublisher(
                weights=lambda: iter(weights.items()),
                members=lambda: [client],
                on_published=on_published,
                transport=IpcTransport(gpu_counts=gpu_counts),
                pause_mode="in_place",
                bucket_bytes=256 * 1024,  # several buckets
            )
            async with anyio.create_task_group() as tasks:
                await tasks.start(publisher.run)
                for version in (1, 2):
                    model = build_random_model("qwen3-tiny", seed=10 + version)
                    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
                    await publisher.publish(version)
                    await publisher.wait_idle()
                after = await client.generate(prompt, params)
                tasks.cancel_scope.cancel()
    assert published == [1, 2] and all(record.ok for record in publisher.records)
    assert after.meta["weight_version"] == "2"
    # Staged while generating, then loaded at one step boundary: never paused over HTTP;
    # the engine's own measure of its stand-still is the record's pause.
    assert pauses == []
    assert asked == [[engine.url]]  # an engine's GPU count is asked once, not per update
    for record in publisher.records:
        assert 0 < record.engine_pause_s <= record.broadcast_s and record.staging_s > 0
        # Where the staging went: the engine's parts lie within the calls' round trips, which
        # lie within the staging; the publisher's own digest came before it.
        parts = record.staging_parts
        assert set(parts) == {"server_info_s", "digest_s", "serialize_s", "request_s",
                              "engine_lock_s", "engine_map_s", "engine_unflatten_s",
                              "engine_digest_s", "engine_plan_s"}  # fmt: skip
        engine_s = sum(seconds for part, seconds in parts.items() if part.startswith("engine_"))
        assert 0 < engine_s <= parts["request_s"] <= record.staging_s
        assert parts["digest_s"] > 0 and parts["server_info_s"] >= 0
        assert record.as_metrics()["weights/staging/engine_map_s"] == parts["engine_map_s"]
        # And where the load went: the engine's wait for a step boundary and its copy lie
        # within the call's round trip, which lies within the send.
        sent = record.send_parts
        assert set(sent) == {"load_request_s", "engine_wait_s", "engine_pause_s"}
        assert sent["engine_pause_s"] == record.engine_pause_s and sent["engine_wait_s"] >= 0
        assert sent["engine_wait_s"] + sent["engine_pause_s"] <= sent["load_request_s"]
        assert sent["load_request_s"] <= record.broadcast_s
        assert record.as_metrics()["weights/send/engine_wait_s"] == sent["engine_wait_s"]
    expected = teacher_forced_logprobs(tiny_model_dir, prompt, after.output_ids, weights)
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) <= 1e-4
    served_before = teacher_forced_logprobs(tiny_model_dir, prompt, after.output_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, served_before, strict=True)) > 1e-2


@pytest.mark.anyio
async def test_a_staged_update_loads_nothing_until_it_is_loaded_whole(tiny_model_dir, tmp_path):
    """Buckets staged under one name are checked (digest, names, shapes) and kept; the engine
    serves its old weights until `/load_staged_weights`, which loads them all at once, once.
    A bucket whose digest does not match is refused and not kept; staging under a new name
    drops the old one."""
    from engine_helpers import running_engines

    from streamrl.fleet.client import EngineClient, EngineError
    from streamrl.models import build_random_model
    from streamrl.weights.digest import digest

    prompt = [1, 504, 3458, 314, 253, 1380, 30, 2]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    model = build_random_model("qwen3-tiny", seed=77)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    halves = [named[: len(named) // 2], named[len(named) // 2 :]]
    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=120) as client:
            before = await client.generate(prompt, params)

            async def stage(name: str, half: list, expected: str | None = None) -> dict:
                payload = serialize_named_tensors(half)
                expected = expected or digest([t for _, t in half])
                return await client.update_weights_from_tensor(
                    [payload], weights_digest=expected, stage=name
                )

            assert (await stage("old", halves[0]))["success"]
            for half in halves:
                assert (await stage("v1", half))["success"]
            with pytest.raises(EngineError, match="digest_mismatch"):
                await stage("v1", halves[1], expected="0" * 32)
            flat = torch.zeros(10, dtype=torch.uint8)  # a flattened bucket of the wrong size
            with pytest.raises(EngineError, match="the bucket holds 10 bytes, its layout 16"):
                await client.update_weights_from_tensor(
                    [serialize_named_tensors([("flattened_bucket", flat)])],
                    stage="v1",
                    flattened=(["model.norm.weight"], ["float32"], [[4]]),
                )
            staged = await client.generate(prompt, params)
            assert staged.output_ids == before.output_ids
            assert staged.meta["weight_version"] == "0"
            with pytest.raises(EngineError, match="nothing is staged as 'old'"):
                await client.load_staged_weights("old")
            loaded = await client.load_staged_weights("v1", weight_version=1)
            assert loaded["success"] and 0 < loaded["engine_pause_s"] < 60
            after = await client.generate(prompt, params)
            with pytest.raises(EngineError, match="nothing is staged as 'v1'"):
                await client.load_staged_weights("v1")
    assert after.meta["weight_version"] == "1"
    assert after.output_ids != before.output_ids or after.logprobs != before.logprobs


def test_weights_by_reference_need_the_engines_on_the_learners_gpu():
    from streamrl.config import ConfigError, config_from_dict

    base = {"data": {"path": "x"}, "weights": {"transport": "ipc"}}
    config_from_dict({**base, "cluster": {"engine_gpus": [0], "learner_gpus": [0]}})
    with pytest.raises(ConfigError, match="every engine on the learner's GPU"):
        config_from_dict({**base, "cluster": {"engine_gpus": [1], "learner_gpus": [0]}})
    with pytest.raises(ConfigError, match=r"GPU\(s\) \[0, 1\]"):  # two engines: GPUs 0 and 1
        config_from_dict({**base, "engine": {"num_engines": 2}})
    with pytest.raises(ConfigError, match=r"learner\.num_gpus = 1"):
        config_from_dict({**base, "learner": {"backend": "megatron", "num_gpus": 2}, "cluster": {}})


@pytest.mark.anyio
async def test_a_bucket_staged_again_from_the_same_buffer_reuses_its_plan_and_loads_new_values(
    tiny_engine, tiny_model_dir
):
    """The publisher stages every version in the same buffers: the engine keeps the last
    loaded buckets mapped and planned, and a bucket from the same memory with the same layout
    is staged without planning again (`kept`) yet loads the values written there since. A
    bucket from other memory is planned afresh, and a kept one is still digest-checked."""
    from streamrl.fleet.client import EngineClient, EngineError
    from streamrl.models import build_random_model
    from streamrl.weights.digest import digest
    from streamrl.weights.group import FLATTENED_BUCKET
    from streamrl.weights.staging import Staging

    prompt = [1, 504, 3458, 314, 253, 1380, 30, 2]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
        model = build_random_model("qwen3-tiny", seed=seed)
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]

    async with EngineClient(tiny_engine.url, timeout_s=120) as client:

        async def publish(staging: Staging, seed: int, version: int) -> tuple[dict, list]:
            (bucket,) = staging.pack(weights(seed))
            staged = await client.update_weights_from_tensor(
                [serialize_named_tensors([(FLATTENED_BUCKET, bucket.flat)])],
                weights_digest=digest([bucket.flat]),
                stage=f"v{version}",
                flattened=(bucket.names, bucket.dtypes, bucket.shapes),
            )
            assert (await client.load_staged_weights(f"v{version}", weight_version=version))[
                "success"
            ]
            answer = await client.generate(prompt, params)
            assert answer.meta["weight_version"] == str(version)
            return staged, answer.logprobs

        reused = Staging(1 << 30, "cpu")
        first, first_seed_1 = await publish(reused, seed=1, version=1)
        second, seed_2 = await publish(reused, seed=2, version=2)
        third, again_seed_1 = await publish(reused, seed=1, version=3)
        elsewhere, elsewhere_seed_2 = await publish(Staging(1 << 30, "cpu"), seed=2, version=4)

        (bucket,) = reused.pack(weights(3))
        with pytest.raises(EngineError, match="digest_mismatch"):
            await client.update_weights_from_tensor(
                [serialize_named_tensors([(FLATTENED_BUCKET, bucket.flat)])],
                weights_digest="0" * 32,
                stage="v5",
                flattened=(bucket.names, bucket.dtypes, bucket.shapes),
            )
    assert [first["kept"], second["kept"], third["kept"], elsewhere["kept"]] == [
        False, True, True, False,
    ]  # fmt: skip
    assert again_seed_1 == first_seed_1 and elsewhere_seed_2 == seed_2
    assert seed_2 != first_seed_1
    assert "unflatten_s" in second["timings"] and "plan_s" in second["timings"]
