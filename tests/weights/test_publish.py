"""The trainer side of the weight wire (`streamrl.publish`): which transport the config
chooses, and the publisher's loop (stage, prepare, pause, send, continue, settle, record,
resync) against a fake transport and fake engines."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
import torch

from streamrl.config import config_from_dict
from streamrl.fleet.client import EngineError
from streamrl.publish.adapter_files import AdapterFileTransport
from streamrl.publish.factory import tensor_transport, weight_publisher
from streamrl.publish.group_transport import GroupTransport
from streamrl.publish.ipc_transport import IpcTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.publish.transport import Staged, WeightTransport
from streamrl.weights.stages import RemoteStages

# ---------------------------------------------------------------- the factory


def publisher_for(settings: dict, device: str = "cpu", leader=None) -> WeightPublisher:
    cfg = config_from_dict({"data": {"path": "x"}, **settings})

    async def on_published(version: int) -> None:
        pass

    return weight_publisher(
        cfg,
        weights=lambda: [],
        members=lambda: [],
        on_published=on_published,
        device=torch.device(device),
        master_address="10.0.0.1",
        adapter_directory=Path("/run/adapters"),
        base_model="/models/base",
        leader=leader,
    )


def test_a_cpu_run_sends_over_a_gloo_group_staged_in_host_memory():
    publisher = publisher_for({"weights": {"bucket_bytes": 8 * 2**20, "pause_mode": "abort"}})
    transport = publisher.transport
    assert isinstance(transport, GroupTransport) and transport.stages is None
    assert (transport.backend, transport.master_address, transport.flattened) == (
        "gloo",
        "10.0.0.1",
        True,
    )
    assert (publisher.staging_device, publisher.bucket_bytes) == ("cpu", 8 * 2**20)
    assert publisher.pause_mode == "abort"


def test_nccl_stages_on_the_learners_device_and_per_tensor_buckets_reach_the_group():
    settings = {"weights": {"transport": "nccl", "flattened_buckets": False}}
    publisher = publisher_for(settings, device="cuda:0")
    assert isinstance(publisher.transport, GroupTransport)
    assert (publisher.transport.backend, publisher.transport.flattened) == ("nccl", False)
    assert publisher.staging_device == "cuda:0"


def test_engines_on_the_learners_gpu_take_the_weights_by_reference():
    settings = {
        "weights": {"transport": "ipc"},
        "cluster": {"engine_gpus": [0], "learner_gpus": [0]},
    }
    publisher = publisher_for(settings, device="cuda:0")
    assert isinstance(publisher.transport, IpcTransport)
    assert publisher.staging_device == "cuda:0"


def test_lora_on_sglang_engines_sends_adapter_files_whatever_the_tensor_transport():
    settings = {
        "model": {"path": "/models/base"},
        "engine": {"backend": "sglang"},
        "learner": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}},
    }
    transport = publisher_for(settings).transport
    assert isinstance(transport, AdapterFileTransport)
    assert (transport.directory, transport.rank) == (Path("/run/adapters"), 8)
    assert (transport.target_modules, transport.base_model) == (
        ("q_proj", "v_proj"),
        "/models/base",
    )


def test_lora_on_embedded_engines_sends_the_adapters_as_tensors():
    settings = {"learner": {"lora": {"rank": 8, "target_modules": ["q_proj"]}}}
    assert isinstance(publisher_for(settings).transport, GroupTransport)


def test_a_learner_with_stage_publishers_gives_the_group_transport_its_stages():
    leader = SimpleNamespace(stage_publisher_ranks=[1])
    transport = publisher_for({}, leader=leader).transport
    assert isinstance(transport.stages, RemoteStages) and transport.stages.leader is leader
    assert transport.stages.staging == "cpu"  # gloo groups broadcast from host memory
    transport.stages.close()
    no_stages = SimpleNamespace(stage_publisher_ranks=[])  # one stage (TP only)
    assert publisher_for({}, leader=no_stages).transport.stages is None


def test_weights_by_reference_refuse_pipeline_stages():
    stages = RemoteStages(SimpleNamespace(stage_publisher_ranks=[1]))
    try:
        with pytest.raises(ValueError, match="cannot carry pipeline stages"):
            tensor_transport("ipc", members=lambda: [], stages=stages)
    finally:
        stages.close()


# ---------------------------------------------------------------- the loop


class FakeEngine:
    """Stands in for an EngineClient: records each pause and continue it answered in the
    shared log. The call named `fails` (`pause` or `continue`) fails once, at once, as a
    dead engine's would; a live engine answers a moment later."""

    def __init__(self, url: str, log: list[str], fails: str = "") -> None:
        self.url = url
        self.log = log
        self.fails = fails

    async def pause(self, mode: str) -> dict:
        return await self._answer("pause", f"pause {self.url} {mode}")

    async def continue_generation(self) -> dict:
        return await self._answer("continue", f"continue {self.url}")

    async def _answer(self, call: str, entry: str) -> dict:
        if self.fails == call:
            self.fails = ""
            self.log.append(entry)
            raise EngineError(self.url, f"/{call}", None, "ConnectError: peer gone")
        for _ in range(3):  # a live engine answers a few turns of the event loop later
            await anyio.lowlevel.checkpoint()
        self.log.append(entry)
        return {"success": True}


class FakeTransport(WeightTransport):
    """Records each step in the shared log; `fail_sends` sends fail (an engine died)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.fail_sends = 0
        self.sent: list[Staged] = []
        self.release = anyio.Event()
        self.release.set()

    def stage(self, version, weights, staging) -> Staged:
        self.log.append(f"stage {version}")
        return super().stage(version, weights, staging)

    async def prepare(self, engines, staged: Staged) -> None:
        self.log.append(f"prepare {staged.version} to {len(engines)}")

    async def send(self, engines, staged: Staged, *, flush_cache: bool) -> None:
        self.log.append(f"send {staged.version} flush={flush_cache}")
        self.sent.append(staged)
        await self.release.wait()
        if self.fail_sends:
            self.fail_sends -= 1
            raise RuntimeError("http://b: receiving weights failed: peer gone")

    async def settle(self, engines, staged: Staged) -> None:
        self.log.append(f"settle {staged.version}")

    def invalidate(self) -> None:
        self.log.append("invalidate")

    async def drop(self) -> None:
        self.log.append("drop")

    async def close(self) -> None:
        self.log.append("close")

    @property
    def num_digest_mismatches(self) -> int:
        return 5


def fake_publisher(
    log: list[str], engines: list, published: list[int], pause_mode: str = "in_place"
):
    async def on_published(version: int) -> None:
        log.append(f"published {version}")
        published.append(version)

    return WeightPublisher(
        weights=lambda: [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(2))],
        members=lambda: engines,
        on_published=on_published,
        transport=FakeTransport(log),
        pause_mode=pause_mode,
    )


pytestmark = pytest.mark.anyio


async def test_one_publish_stages_then_sends_inside_one_pause_and_reports_the_version():
    log: list[str] = []
    published: list[int] = []
    engines = [FakeEngine("http://a", log), FakeEngine("http://b", log)]
    publisher = fake_publisher(log, engines, published)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        record = await publisher.publish(1)
        assert log == ["stage 1"]  # the update runs behind the learner
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert log == [
        "stage 1",
        "prepare 1 to 2",
        "pause http://a in_place",
        "pause http://b in_place",
        "send 1 flush=False",
        "continue http://a",
        "continue http://b",
        "settle 1",
        "published 1",
        "close",
    ]
    assert publisher.records == [record] and published == [1]
    assert (record.num_bytes, record.num_engines, record.ok) == (24, 2, True)
    assert record.engine_pause_s >= record.broadcast_s >= 0
    assert publisher.num_digest_mismatches == 5  # the transport's count
    assert set(record.as_metrics()) == {
        "weights/version",
        "weights/learner_stall_s",
        "weights/snapshot_s",
        "weights/engine_pause_s",
        "weights/staging_s",
        "weights/broadcast_s",
        "weights/bytes",
        "weights/gb_per_s",
        "weights/num_engines",
        "weights/ok",
    }


class StagingTransport(FakeTransport):
    """Stages the update on engine a in `prepare`; a then loads it by itself in `send`."""

    def needs_pause(self, engine) -> bool:
        return engine.url != "http://a"

    @property
    def staging_s(self) -> float:
        return 0.25

    @property
    def engine_pauses(self) -> dict[str, float]:
        return {"http://a": 30.0}  # longer than any window this test can take


@pytest.mark.parametrize("pause_mode", ["in_place", "abort", "retract_abort"])
async def test_an_engine_that_loads_a_staged_update_is_not_paused_and_reports_its_pause(
    pause_mode,
):
    log: list[str] = []
    engines = [FakeEngine("http://a", log), FakeEngine("http://b", log)]
    publisher = fake_publisher(log, engines, [], pause_mode=pause_mode)
    publisher.transport = StagingTransport(log)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        record = await publisher.publish(1)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    # the modes that empty the engines pause every engine, staged or not
    paused = {"in_place": ["b"], "abort": ["a", "b"], "retract_abort": ["a", "b"]}[pause_mode]
    assert [line for line in log if line.startswith(("pause", "continue"))] == [
        *(f"pause http://{name} {pause_mode}" for name in paused),
        *(f"continue http://{name}" for name in paused),
    ]
    assert record.engine_pause_s == 30.0 and record.staging_s == 0.25
    assert record.gb_per_s == pytest.approx(24 / (0.25 + record.broadcast_s) / 1e9)


@pytest.mark.parametrize(
    "pause_mode, flush", [("abort", True), ("retract_abort", True), ("in_place", False),
                          ("retract", False)],
)  # fmt: skip
async def test_only_the_modes_that_empty_the_engines_ask_for_the_prefix_cache_flush(
    pause_mode, flush
):
    log: list[str] = []
    publisher = fake_publisher(log, [FakeEngine("http://a", log)], [], pause_mode=pause_mode)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(1)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert f"pause http://a {pause_mode}" in log and f"send 1 flush={flush}" in log


@pytest.mark.parametrize("failing", ["send", "pause", "continue"])
async def test_a_failed_send_still_continues_the_engines_and_drops_what_the_transport_built(
    failing,
):
    """The transport's send fails, or engine b (dead) fails its pause or its continue: engine
    a's calls are not cut short, every engine is asked to continue, the update is dropped
    and the next one goes through."""
    log: list[str] = []
    published: list[int] = []
    engines = [FakeEngine("http://a", log), FakeEngine("http://b", log, fails=failing)]
    publisher = fake_publisher(log, engines, published)
    publisher.transport.fail_sends = int(failing == "send")
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(1)
        await publisher.wait_idle()
        await publisher.publish(2)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    first = log[: log.index("stage 2")]
    assert first[:2] == ["stage 1", "prepare 1 to 2"]
    assert set(first[2:4]) == {"pause http://a in_place", "pause http://b in_place"}
    assert first[4:-3] == ([] if failing == "pause" else ["send 1 flush=False"])
    assert set(first[-3:-1]) == {"continue http://a", "continue http://b"}
    assert first[-1] == "drop"
    assert [record.ok for record in publisher.records] == [False, True] and published == [2]


async def test_a_resync_sends_the_newest_staged_version_again_without_staging_it():
    log: list[str] = []
    published: list[int] = []
    publisher = fake_publisher(log, [FakeEngine("http://a", log)], published)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.resync()  # nothing published yet: nothing to send
        await publisher.publish(3)
        await publisher.wait_idle()
        publisher.invalidate()  # an engine restarted
        await publisher.resync()  # returns once the engines hold version 3 again
        tasks.cancel_scope.cancel()
    assert log.count("stage 3") == 1 and log.count("send 3 flush=False") == 2
    assert log.index("invalidate") < log.index("send 3 flush=False", log.index("invalidate"))
    first, again = publisher.transport.sent
    assert again is first and published == [3, 3]
    assert [(record.version, record.num_bytes) for record in publisher.records] == [(3, 24), (3, 0)]


async def test_the_next_version_is_staged_only_after_the_previous_update_finished():
    """Staging overwrites the buffers the update in flight is sending from."""
    log: list[str] = []
    publisher = fake_publisher(log, [FakeEngine("http://a", log)], [])
    publisher.transport.release = anyio.Event()
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(1)
        tasks.start_soon(publisher.publish, 2)
        await anyio.wait_all_tasks_blocked()
        assert "send 1 flush=False" in log and "stage 2" not in log
        publisher.transport.release.set()
        await anyio.wait_all_tasks_blocked()
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert log.index("stage 2") > log.index("settle 1")
    assert [record.version for record in publisher.records] == [1, 2]


async def test_with_no_live_engine_the_version_counts_as_published_without_a_pause():
    log: list[str] = []
    published: list[int] = []
    publisher = fake_publisher(log, [], published)
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(1)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert log == ["stage 1", "published 1", "close"]
    assert publisher.records[0].num_engines == 0 and published == [1]
