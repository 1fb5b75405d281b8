"""Pipeline stages publishing their own layers (`streamrl.weights.stages`).

The live-engine test runs the real `WeightPublisher` (stage 0) and a real
`StageServer` (stage 1, its serving thread in this process) against an
embedded engine process; only the learner's default group is replaced, by
`TwoStageLeader`, which hands the server stage 1's tensors the way the
follower's SNAPSHOT call does. The ordering and failure tests use recording
fakes for the engines and the stages.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from streamrl.publish.group_transport import GroupTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.weights.digest import digest
from streamrl.weights.stages import (
    BucketSpec,
    Drop,
    Host,
    RemoteStages,
    Send,
    StagePlan,
    StageReply,
    StageServer,
)

pytestmark = pytest.mark.anyio

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]


def is_stage1(name: str) -> bool:
    """qwen3-tiny at PP=2: layer 1, the final norm and the output layer live on stage 1."""
    return name.startswith(("model.layers.1.", "model.norm.", "lm_head."))


def random_weights(seed: int) -> dict[str, torch.Tensor]:
    from streamrl.models import build_random_model

    model = build_random_model("qwen3-tiny", seed=seed)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class TwoStageLeader:
    """The Leader's snapshot side at PP=2, in one process: stage 0's tensors are yielded here,
    stage 1's are staged by `server` (as the follower's SNAPSHOT call does)."""

    def __init__(self, server: StageServer) -> None:
        self.server = server
        self.weights: dict[str, torch.Tensor] = {}
        self._plan = b""

    def snapshot(self, version: int, *, bucket_bytes: int, staging: str):
        stage1 = [(n, t) for n, t in self.weights.items() if is_stage1(n)]
        plan = self.server.take(stage1, version=version, bucket_bytes=bucket_bytes, staging=staging)
        self._plan = msgspec.msgpack.encode(plan)
        yield from ((n, t) for n, t in self.weights.items() if not is_stage1(n))

    def stage_plans(self) -> list[bytes]:
        return [self._plan]


@pytest.fixture
def stage_server():
    server = StageServer(1, torch.device("cpu"))
    server.start()
    yield server
    server.close()


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "per-tensor"])
async def test_two_stage_groups_bring_every_layer_to_a_live_engine(
    tiny_model_dir, tmp_path, stage_server, flattened
):
    from engine_helpers import running_engines, teacher_forced_logprobs

    from streamrl.fleet.client import EngineClient

    leader = TwoStageLeader(stage_server)
    published: list[int] = []

    async def on_published(version: int) -> None:
        published.append(version)

    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    extra = ["--weight-version", "0"]
    with running_engines(tiny_model_dir, tmp_path, extra_args=extra) as (engine,):
        async with EngineClient(engine.url, timeout_s=120) as client:
            publisher = WeightPublisher(
                weights=lambda: pytest.fail("stages snapshot through the leader"),
                members=lambda: [client],
                on_published=on_published,
                transport=GroupTransport(
                    members=lambda: [client], flattened=flattened, stages=RemoteStages(leader)
                ),
                pause_mode="in_place",
                bucket_bytes=256 * 1024,  # several buckets per stage
            )
            async with anyio.create_task_group() as tasks:
                await tasks.start(publisher.run)
                for version in (1, 2):
                    leader.weights = random_weights(seed=version)
                    await publisher.publish(version)
                    await publisher.wait_idle()
                    if version == 1:  # an engine set change rebuilds both groups
                        publisher.invalidate()
                after = await client.generate(PROMPT, params)
                tasks.cancel_scope.cancel()
    assert published == [1, 2] and all(r.ok for r in publisher.records)
    (first, second) = publisher.records[0].num_bytes, publisher.records[1].num_bytes
    assert first == second == sum(t.numel() * 4 for t in leader.weights.values())
    assert after.meta["weight_version"] == "2"
    expected = teacher_forced_logprobs(tiny_model_dir, PROMPT, after.output_ids, leader.weights)
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) <= 1e-4


class RecordingEngine:
    """Stands in for an EngineClient; `fail_group_suffix` makes updates to such groups fail."""

    def __init__(self, url: str, fail_group_suffix: str = "") -> None:
        self.url = url
        self.fail_group_suffix = fail_group_suffix
        self.calls: list[tuple[str, dict]] = []

    async def _ok(self, name: str, **kwargs) -> dict:
        self.calls.append((name, kwargs))
        return {"success": True, "message": "ok"}

    async def accepts_digest(self) -> bool:
        return False  # as an SGLang server: no weights_digest field

    async def pause(self, mode: str) -> dict:
        return await self._ok("pause")

    async def continue_generation(self) -> dict:
        return await self._ok("continue")

    async def init_weights_update_group(self, **kwargs) -> dict:
        return await self._ok("init", **kwargs)

    async def update_weights_from_distributed(self, names, dtypes, shapes, **kwargs) -> dict:
        await self._ok("update", names=names, **kwargs)
        failing = self.fail_group_suffix and kwargs["group_name"].endswith(self.fail_group_suffix)
        return {"success": not failing, "message": "receiving weights failed: peer gone"}

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._ok("destroy", group_name=group_name)


class RecordingStages:
    """Stands in for RemoteStages at PP=2: stage 1 holds two buckets, on another node."""

    def __init__(self) -> None:
        self.requests: list[Host | Send | Drop] = []
        self.closed = False

    def snapshot(self, version: int, bucket_bytes: int):
        yield "model.embed_tokens.weight", torch.ones(4, 2)

    def plans(self, version: int) -> list[StagePlan]:
        spec = BucketSpec(names=["model.norm.weight"], dtypes=["float32"], shapes=[[2]])
        return [StagePlan(1, version, "tcp://unused", [spec, spec], num_bytes=16)]

    async def request(self, stage: int, request) -> None:
        assert stage == 1
        self.requests.append(request)

    async def rendezvous(self, stage: int) -> tuple[str, int]:
        assert stage == 1
        return "10.0.0.2", 29500  # the stage's node: what its group's members are told

    def close(self) -> None:
        self.closed = True


def recording_publisher(monkeypatch, engines, stages) -> WeightPublisher:
    from streamrl.publish import group_transport as group_transport_module
    from streamrl.publish import update_groups as update_groups_module

    async def host(**kwargs) -> str:
        return kwargs["group_name"]

    monkeypatch.setattr(update_groups_module, "join_in_daemon_thread", host)
    monkeypatch.setattr(group_transport_module, "broadcast_flat", lambda group, flat: None)
    monkeypatch.setattr(update_groups_module, "destroy_weight_update_group", lambda group: None)

    async def one_gpu_each(clients) -> list[int]:
        return [1] * len(clients)

    async def on_published(version: int) -> None:
        pass

    return WeightPublisher(
        weights=lambda: [],
        members=lambda: engines,
        on_published=on_published,
        transport=GroupTransport(members=lambda: engines, gpu_counts=one_gpu_each, stages=stages),
        pause_mode="in_place",
    )


async def test_the_version_is_tagged_only_on_the_last_bucket_of_the_last_stage(monkeypatch):
    engines = [RecordingEngine("http://a"), RecordingEngine("http://b")]
    stages = RecordingStages()
    publisher = recording_publisher(monkeypatch, engines, stages)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(7)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert stages.closed
    calls = engines[0].calls
    assert [name for name, _ in calls] == ["init", "init", "pause", *["update"] * 3, "continue"]
    stage0, stage1 = calls[0][1]["group_name"], calls[1][1]["group_name"]
    assert stage0 != stage1 and stage1.endswith("-stage1")
    assert [call["rank_offset"] for _, call in calls[:2]] == [1, 1]
    assert {call["world_size"] for _, call in calls[:2]} == {3}
    updates = [call for name, call in calls if name == "update"]
    assert [u["group_name"] for u in updates] == [stage0, stage1, stage1]
    assert [u["weight_version"] for u in updates] == [None, None, 7]
    (host, *sends) = stages.requests
    assert host.group_name == stage1 and host.world_size == 3
    assert (host.master_address, host.master_port) == ("10.0.0.2", 29500)
    assert [(c["master_address"], c["master_port"]) for _, c in calls[1:2]] == [("10.0.0.2", 29500)]
    assert sends == [Send(stage1, 7, 0), Send(stage1, 7, 1)]
    other = engines[1].calls  # the same calls, at its own rank in both groups
    assert [(name, call.get("group_name")) for name, call in other] == [
        (name, call.get("group_name")) for name, call in calls
    ]
    assert [call["rank_offset"] for _, call in other[:2]] == [2, 2]


async def test_a_failed_stage_bucket_fails_the_update_and_rebuilds_every_group(monkeypatch):
    engines = [RecordingEngine("http://a", fail_group_suffix="-stage1")]
    stages = RecordingStages()
    publisher = recording_publisher(monkeypatch, engines, stages)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(1)
        await publisher.wait_idle()
        first_groups = [call["group_name"] for name, call in engines[0].calls if name == "init"]
        engines[0].fail_group_suffix = ""
        await publisher.publish(2)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert [record.ok for record in publisher.records] == [False, True]
    destroyed = [call["group_name"] for name, call in engines[0].calls if name == "destroy"]
    assert destroyed == first_groups
    assert Drop(first_groups[1]) in stages.requests
    inits = [call["group_name"] for name, call in engines[0].calls if name == "init"]
    assert len(inits) == 4 and not set(inits[2:]) & set(first_groups)


async def test_a_stage_refuses_a_version_it_does_not_hold_and_a_group_it_has_not_joined(
    stage_server,
):
    leader = TwoStageLeader(stage_server)
    leader.weights = {"model.norm.weight": torch.ones(3)}
    stages = RemoteStages(leader)
    try:
        with pytest.raises(RuntimeError, match="stage 1 has sent no snapshot plan"):
            await stages.request(1, Drop("nothing"))
        assert list(stages.snapshot(4, bucket_bytes=1024)) == []
        (plan,) = stages.plans(4)
        (spec,) = plan.buckets
        assert (spec.names, spec.dtypes, spec.shapes) == (["model.norm.weight"], ["float32"], [[3]])
        assert spec.digest == digest([torch.ones(3)])  # the stage's bytes, digested where staged
        with pytest.raises(RuntimeError, match="stage 1 holds version 4, not 5"):
            await stages.request(1, Send("g", 5, 0))
        with pytest.raises(RuntimeError, match="stage 1 holds no g"):
            await stages.request(1, Send("g", 4, 0))
        await stages.request(1, Drop("g"))  # dropping what it does not hold is fine
        with pytest.raises(RuntimeError, match="expected stage 1 at version 6"):
            stages.plans(6)
    finally:
        stages.close()


async def test_a_cancelled_request_leaves_the_channel_usable_and_its_late_answer_is_dropped():
    """Rank 0 stops waiting for a stage (an engine failed); the stage's late answer to that
    request must not be taken for the answer to the next one."""
    import threading

    import zmq

    context = zmq.Context()
    server = context.socket(zmq.REP)
    server.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    release = threading.Event()
    received: list[str] = []

    def answer_late() -> None:
        for reply in (StageReply(False, "the late answer"), StageReply(True)):
            *request_id, payload = server.recv_multipart()
            received.append(msgspec.msgpack.decode(payload, type=Drop).group_name)
            if len(received) == 1:
                release.wait(timeout=30)
            server.send_multipart([*request_id, msgspec.msgpack.encode(reply)])

    class PlanOnly:
        def stage_plans(self) -> list[bytes]:
            return [msgspec.msgpack.encode(StagePlan(1, 3, address, [], num_bytes=0))]

    thread = threading.Thread(target=answer_late)
    thread.start()
    stages = RemoteStages(PlanOnly())
    try:
        stages.plans(3)
        with anyio.move_on_after(0.5) as scope:
            await stages.request(1, Drop("first"))
        assert scope.cancelled_caught
        release.set()
        await stages.request(1, Drop("second"))  # the first's failure answer is dropped
        assert received == ["first", "second"]
    finally:
        release.set()
        thread.join()
        stages.close()
        server.close()
        context.term()


def test_stage_publishers_are_tp_rank_0_of_dp_replica_0_of_each_later_stage():
    from types import SimpleNamespace

    from streamrl.backends.megatron.parallel import Layout
    from streamrl.backends.ranks import Leader

    def layout(tp: int, dp: int, pp: int) -> Layout:
        return Layout(tp * dp * pp, 0, tp, pp, dp, tp_rank=0, pp_rank=0, dp_rank=0)

    def ranks(tp: int, dp: int, pp: int) -> list[int]:
        return Leader(SimpleNamespace(layout=layout(tp, dp, pp))).stage_publisher_ranks

    assert ranks(2, 1, 1) == []
    assert ranks(1, 1, 2) == [1]
    assert ranks(2, 2, 2) == [4]  # rank = tp + TP * (dp + DP * pp)
    assert ranks(1, 1, 4) == [1, 2, 3]
    assert Leader(SimpleNamespace()).stage_publisher_ranks == []  # the torch backend
