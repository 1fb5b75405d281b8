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

    from streamrl.fleet.client import EngineClient
    from streamrl.models import build_random_model
    from streamrl.publish.ipc_transport import IpcTransport
    from streamrl.publish.publisher import WeightPublisher

    prompt = [1, 504, 3458, 314, 253, 1380, 30, 2]
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    weights: dict[str, torch.Tensor] = {}
    published: list[int] = []

    async def on_published(version: int) -> None:
        published.append(version)

    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=120) as client:
            publisher = WeightPublisher(
                weights=lambda: iter(weights.items()),
                members=lambda: [client],
                on_published=on_published,
                transport=IpcTransport(),
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
    expected = teacher_forced_logprobs(tiny_model_dir, prompt, after.output_ids, weights)
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) <= 1e-4
    served_before = teacher_forced_logprobs(tiny_model_dir, prompt, after.output_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, served_before, strict=True)) > 1e-2


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
