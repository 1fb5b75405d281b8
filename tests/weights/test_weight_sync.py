"""The weight-update group: this process is rank 0 (the trainer), a child process rank 1."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from streamrl.process import spawn
from streamrl.weights.group import (
    FLATTENED_BUCKET,
    FlatLayout,
    broadcast_flat,
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
    torch_dtype,
)
from streamrl.weights.staging import Staging

CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs CUDA")],
    ),
]  # fmt: skip
"""Tests that run on the CPU here and on a GPU where there is one."""

_RECEIVER = textwrap.dedent(
    """
    import json, sys
    import torch
    from streamrl.weights.group import (
        destroy_weight_update_group, init_weight_update_group, receive_tensors)
    port_list, group_name, spec_path, out_path, load_format = sys.argv[1:6]
    spec = json.load(open(spec_path))
    rounds = []
    for port in port_list.split(","):  # one group per round, same name each time
        group = init_weight_update_group(master_address="127.0.0.1", master_port=int(port),
            rank=1, world_size=2, group_name=group_name, backend="gloo", timeout_s=60)
        received = receive_tensors(group, spec["names"], spec["dtypes"], spec["shapes"], "cpu",
            load_format or None)
        rounds.append({name: tensor.clone() for name, tensor in received})  # views of one buffer
        destroy_weight_update_group(group)
    torch.save(rounds, out_path)
    """
)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator),
        "model.norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        # A non-contiguous view: the sender must send its contiguous copy.
        "lm_head.weight": torch.randn(5, 7, generator=generator).t(),
        "scalar_like": torch.tensor([3], dtype=torch.int64),
    }


def _send_to_child(
    tmp_path,
    free_port,
    tensors: dict[str, torch.Tensor],
    group_name: str,
    rounds: int = 1,
    load_format: str = "",
) -> list[dict]:
    """Broadcast `tensors` to a child process `rounds` times, re-creating the group each time
    (one broadcast per tensor, or one flat one with `load_format = "flattened_bucket"`)."""
    spec = {
        "names": list(tensors),
        "dtypes": [
            # Exercise both spellings SGLang clients use.
            str(t.dtype) if i % 2 else dtype_name(t.dtype)
            for i, t in enumerate(tensors.values())
        ],
        "shapes": [list(t.shape) for t in tensors.values()],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "receiver.py").write_text(_RECEIVER)
    ports = [free_port() for _ in range(rounds)]
    out_path = tmp_path / "received.pt"
    argv = [sys.executable, str(tmp_path / "receiver.py"), ",".join(map(str, ports)), group_name]
    argv += [str(tmp_path / "spec.json"), str(out_path), load_format]
    child = spawn("receiver", argv, log_path=tmp_path / "receiver.log")
    try:
        for port in ports:
            group = init_weight_update_group(
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name=group_name,
                backend="gloo",
                timeout_s=60,
            )
            if load_format == FLATTENED_BUCKET:
                layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors.values()])
                flat = torch.empty(layout.num_bytes, dtype=torch.uint8)
                layout.pack(list(tensors.values()), flat)
                broadcast_flat(group, flat)
            else:
                broadcast_tensors(group, list(tensors.values()))
            destroy_weight_update_group(group)
        assert child.popen.wait(60) == 0, child.log_tail()
    finally:
        child.stop()
    return torch.load(out_path)


def test_a_broadcast_over_the_named_group_arrives_intact_in_another_process(tmp_path, free_port):
    tensors = _tensors()
    (received,) = _send_to_child(tmp_path, free_port, tensors, "weight_update_group")
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name


def test_a_flattened_bucket_of_mixed_dtypes_arrives_intact_as_one_broadcast(tmp_path, free_port):
    tensors = _tensors()
    # Offsets 0, 140, 150, 290: the fp32 and int64 tensors after the 10-byte bf16 one are
    # misaligned for their dtype, so the receiver must copy rather than view them.
    layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors.values()])
    assert layout.offsets == [0, 140, 150, 290] and layout.num_bytes == 298
    (received,) = _send_to_child(
        tmp_path, free_port, tensors, "flat_group", load_format=FLATTENED_BUCKET
    )
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_bucket_packed_in_one_foreach_copy_holds_every_tensor_at_its_offset(device):
    """The pack copies every tensor's bytes at once, misaligned offsets included (a 10-byte
    bf16 tensor puts the next ones off their dtype's alignment), and a zero-size tensor."""
    tensors = [t.to(device) for t in _tensors().values()]
    tensors.insert(2, torch.empty(0, 3, device=device))
    tensors += [torch.randn(4099, device=device).to(torch.bfloat16) for _ in range(40)]
    layout = FlatLayout([(tuple(t.shape), t.dtype) for t in tensors])
    flat = torch.full((layout.num_bytes,), 7, dtype=torch.uint8, device=device)
    layout.pack(tensors, flat)
    for tensor, packed in zip(tensors, layout.unpack(flat), strict=True):
        assert packed.dtype == tensor.dtype and torch.equal(packed, tensor)
    with pytest.raises(ValueError, match="!="):
        layout.pack([tensors[1], *tensors[1:]], flat)


def test_the_trainers_own_default_group_does_not_interfere(tmp_path, free_port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        tensors = _tensors()
        (received,) = _send_to_child(tmp_path, free_port, tensors, "wg_beside_default")
        assert all(torch.equal(received[n], t) for n, t in tensors.items())
        # The default group still works and is still the default.
        value = torch.ones(2)
        dist.all_reduce(value)
        assert dist.get_world_size() == 1 and torch.equal(value, torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_a_default_group_bound_to_a_device_is_not_split_from(tmp_path, free_port):
    """A trainer that passed device_id to init_process_group: the weight group must still be
    a fresh communicator with the engines (on GPU a split would be a collective over the
    trainer's own ranks). On CPU this checks the guard's bookkeeping and that the group works."""
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    default = c10d._get_default_group()
    default.bound_device_id = torch.device("cuda", 0)
    try:
        (received,) = _send_to_child(tmp_path, free_port, {"w": torch.arange(3.0)}, "wg_bound")
        assert torch.equal(received["w"], torch.arange(3.0))
        assert default.bound_device_id == torch.device("cuda", 0)
    finally:
        default.bound_device_id = None
        dist.destroy_process_group()


def test_a_group_name_can_be_reused_after_destroy(tmp_path, free_port):
    rounds = _send_to_child(tmp_path, free_port, {"w": torch.arange(4.0)}, "reused", rounds=2)
    assert len(rounds) == 2 and all(torch.equal(r["w"], torch.arange(4.0)) for r in rounds)


@pytest.mark.parametrize("name", ["bfloat16", "torch.bfloat16", "float32", "torch.float16"])
def test_dtype_names_in_both_spellings_resolve(name):
    assert dtype_name(torch_dtype(name)) == name.removeprefix("torch.")


def test_an_unknown_dtype_name_is_an_error():
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("float33")


# ---- acceptance (b): a live engine receives weights over gloo -----------------------------

_ENGINE_PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    """Parameters (HF names, tied ones once) of another random qwen3-tiny."""
    from streamrl.models import build_random_model

    return {
        name: p.detach().clone()
        for name, p in build_random_model("qwen3-tiny", seed=seed).named_parameters()
    }


async def _push(
    engines, group, weights: dict[str, torch.Tensor], version: int, during=None
) -> None:
    """What a weight publisher does: the update call in flight while rank 0 broadcasts.

    With `during` (a client), first check that the engine keeps generating while it
    waits inside the receive (before rank 0 has sent anything)."""
    import anyio
    from engine_helpers import engine_load, wait_until

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            lambda: engines.update_weights_from_distributed(
                list(weights),
                [t.dtype for t in weights.values()],
                [t.shape for t in weights.values()],
                weight_version=version,
                group_name="wg_test",
            )
        )
        if during is not None:
            await anyio.to_thread.run_sync(
                lambda: wait_until(
                    lambda: engine_load(during.url)["is_receiving_weights"], what="receiving"
                )
            )
            meanwhile = await during.generate(_ENGINE_PROMPT, {"max_new_tokens": 3})
            assert len(meanwhile.output_ids) == 3 and meanwhile.weight_version == version - 1
            assert engine_load(during.url)["is_receiving_weights"]
        await anyio.to_thread.run_sync(broadcast_tensors, group, list(weights.values()))


@pytest.mark.anyio
async def test_b_after_a_gloo_broadcast_the_engine_generates_from_the_new_weights(
    engine,
):
    import anyio
    from engine_helpers import (
        engine_load,
        joined_update_group,
        teacher_forced_logprobs,
        wait_until,
    )

    from streamrl.fleet.engine_set import EngineSet

    async with EngineSet([engine.url], timeout_s=120) as engines:
        group = await joined_update_group(engines, "wg_test")
        try:
            client = engines.engines[0]
            new_weights = _random_weights(seed=1)
            await _push(engines, group, new_weights, version=1, during=client)
            params = {
                "max_new_tokens": 16,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": 0,
            }
            after = await client.generate(_ENGINE_PROMPT, params)
            assert after.meta["weight_version"] == "1" and after.versions == [1] * 16
            expected = teacher_forced_logprobs(
                engine.model_dir, _ENGINE_PROMPT, after.output_ids, new_weights
            )
            assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) <= 1e-4
            assert await client.weight_version() == 1

            # A request in flight across the next update: pause in place, update, continue.
            long_params = {"max_new_tokens": 1500, "temperature": 1.0, "ignore_eos": True}
            results = []

            async def generate() -> None:
                results.append(await client.generate(_ENGINE_PROMPT, long_params))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(generate)
                await anyio.to_thread.run_sync(
                    lambda: wait_until(
                        lambda: engine_load(engine.url)["num_running_reqs"] == 1, what="running"
                    )
                )
                await engines.pause("in_place")
                await _push(engines, group, _random_weights(seed=2), version=2)
                await engines.continue_generation()
            (straddler,) = results
            spans = straddler.meta["weight_versions"]
            assert [span["version"] for span in spans] == ["1", "2"], spans
            split = spans[0]["end"]
            assert spans == [
                {"version": "1", "start": 0, "end": split},
                {"version": "2", "start": split, "end": 1500},
            ]
            assert 0 < split < 1500 and straddler.meta["weight_version"] == "2"
            assert straddler.versions == [1] * split + [2] * (1500 - split)
            # Tokens before the update came from the version-1 weights.
            head = teacher_forced_logprobs(
                engine.model_dir, _ENGINE_PROMPT, straddler.output_ids[:split], new_weights
            )
            assert (
                max(abs(a - b) for a, b in zip(straddler.logprobs[:split], head, strict=True))
                <= 1e-4
            )
        finally:
            await engines.destroy_weights_update_group("wg_test")
            destroy_weight_update_group(group)


@pytest.mark.anyio
async def test_a_member_that_dies_before_joining_fails_the_update_at_once(tiny_model_dir, tmp_path):
    """A dying engine's join fails while the others already wait in the rendezvous: the update
    fails now (not at the rendezvous timeout), and the live engine, still stuck in the dead
    group's join, takes the next group at once."""
    import anyio
    from engine_helpers import running_engines

    from streamrl.fleet.client import EngineClient, EngineError
    from streamrl.models import build_random_model
    from streamrl.publish.group_transport import GroupTransport
    from streamrl.publish.publisher import WeightPublisher

    class DiesBeforeJoining:
        url = "http://dying-engine"

        async def pause(self, mode: str) -> dict:
            return {"success": True}

        async def continue_generation(self) -> dict:
            return {"success": True}

        async def init_weights_update_group(self, **kwargs) -> dict:
            await anyio.sleep(1.0)  # the live engine is in the rendezvous by now
            raise EngineError(self.url, "/init_weights_update_group", None, "disconnected")

        async def destroy_weights_update_group(self, group_name: str) -> dict:
            raise EngineError(self.url, "/destroy_weights_update_group", None, "gone")

    model = build_random_model("qwen3-tiny", seed=31)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    published: list[int] = []

    async def on_published(version: int) -> None:
        published.append(version)

    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=120) as client:
            members = [client, DiesBeforeJoining()]
            publisher = WeightPublisher(
                weights=lambda: iter(weights.items()),
                members=lambda: members,
                on_published=on_published,
                transport=GroupTransport(
                    members=lambda: members, gpu_counts=lambda engines: _ones(engines)
                ),
                pause_mode="in_place",
            )
            async with anyio.create_task_group() as tasks:
                await tasks.start(publisher.run)
                with anyio.fail_after(60):  # the rendezvous itself would wait 300 s
                    await publisher.publish(1)
                    await publisher.wait_idle()
                    members.pop()  # the fleet dropped it
                    publisher.invalidate()
                    await publisher.publish(2)
                    await publisher.wait_idle()
                version = await client.weight_version()
                tasks.cancel_scope.cancel()
    assert [record.ok for record in publisher.records] == [False, True]
    assert published == [2] and version == 2


async def _ones(engines) -> list[int]:
    return [1] * len(engines)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_snapshot_on_a_gpu_says_how_long_it_waited_for_queued_work_and_how_long_it_copied(
    device,
):
    """`Staging.last_parts` on a GPU: the wait for what was queued before the snapshot (here a
    chain of matrix products) and the snapshot itself, each measured; on the CPU, nothing."""
    staging = Staging(bucket_bytes=1 << 20, device=device)
    x = torch.randn(512, 512, device=device)
    for _ in range(20):
        x = x @ x / 512  # queued on the device before the snapshot
    (bucket,) = staging.pack([("x", x)])
    assert torch.equal(bucket.layout.unpack(bucket.flat)[0], x)
    if device == "cpu":
        assert staging.last_parts == {}
    else:
        assert set(staging.last_parts) == {"wait_s", "copy_s"}
        assert all(seconds >= 0 for seconds in staging.last_parts.values())
