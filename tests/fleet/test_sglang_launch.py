"""SGLang engines: the exact launch commands, the GPU assignment and the weight-group layout."""

from __future__ import annotations

import contextlib
import sys

import anyio
import pytest
import torch

from streamrl.config import ConfigError, RunConfig, config_from_dict
from streamrl.fleet.sglang import (
    LIVENESS_ENV,
    SGLangUnavailable,
    check_sglang_backend,
    sglang_argv_factory,
    sglang_available,
)
from streamrl.placement import engine_gpu_ids
from streamrl.publish import group_transport as group_transport_module
from streamrl.publish import update_groups as update_groups_module
from streamrl.publish.group_transport import GroupTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.weights.layout import engine_gpu_count, weight_group_layout

MODEL = "/models/Qwen2.5-7B-Instruct"


def sglang_config(**engine) -> RunConfig:
    cluster = engine.pop("cluster", {})
    weights = engine.pop("weights", {})
    return config_from_dict(
        {
            "model": {"path": MODEL, "seed": 10},
            "data": {"path": "prompts.jsonl"},
            "engine": {"backend": "sglang", **engine},
            "cluster": cluster,
            "weights": weights,
        }
    )


def launch_argv(tp_size: str, port: int, version: str, seed: str) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", tp_size,
        "--mem-fraction-static", "0.8",
        "--weight-version", version,
        "--random-seed", seed,
    ]  # fmt: skip


# ---------------------------------------------------------------- launch commands


def test_one_engine_with_tp_1_gets_gpu_0_and_the_plain_command():
    factory = sglang_argv_factory(sglang_config(num_engines=1, tp_size=1), MODEL, 0)
    argv, env = factory(0, "127.0.0.1", 30001)
    assert argv == launch_argv("1", 30001, "0", "10")
    assert env == {"CUDA_VISIBLE_DEVICES": "0", **LIVENESS_ENV}


def test_a_launched_sglang_answers_health_without_generating():
    """A paused engine is asked /health (the supervisor); SGLang 0.5.17 generates a token
    there unless this variable is false, which waits at the pause's gate."""
    _, env = sglang_argv_factory(sglang_config(), MODEL, 0)(0, "127.0.0.1", 30001)
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"


def test_three_engines_with_tp_1_get_one_gpu_each_and_their_own_port_and_seed():
    factory = sglang_argv_factory(sglang_config(num_engines=3), MODEL, 4)
    launches = [factory(i, "127.0.0.1", 30001 + i) for i in range(3)]
    assert [argv for argv, _ in launches] == [
        launch_argv("1", 30001 + i, "4", str(10 + i)) for i in range(3)
    ]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launches] == ["0", "1", "2"]


def test_one_engine_with_tp_2_sees_two_gpus():
    factory = sglang_argv_factory(sglang_config(tp_size=2), MODEL, 0)
    argv, env = factory(0, "127.0.0.1", 30001)
    assert argv == launch_argv("2", 30001, "0", "10")
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", **LIVENESS_ENV}


def test_three_engines_with_tp_2_take_consecutive_pairs_of_the_listed_gpus_and_extra_args_last():
    cfg = sglang_config(
        num_engines=3,
        tp_size=2,
        mem_fraction_static=0.7,
        dtype="bfloat16",
        host="10.0.0.5",
        extra_args=["--context-length", "8192", "--enable-deterministic-inference"],
        cluster={"engine_gpus": [2, 3, 4, 5, 6, 7]},
    )
    factory = sglang_argv_factory(cfg, MODEL, 12)
    launches = [factory(i, "10.0.0.5", 31000 + i) for i in range(3)]
    assert [env for _, env in launches] == [
        {"CUDA_VISIBLE_DEVICES": "2,3", **LIVENESS_ENV},
        {"CUDA_VISIBLE_DEVICES": "4,5", **LIVENESS_ENV},
        {"CUDA_VISIBLE_DEVICES": "6,7", **LIVENESS_ENV},
    ]
    assert launches[2][0] == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", MODEL,
        "--host", "10.0.0.5",
        "--port", "31002",
        "--tp-size", "2",
        "--mem-fraction-static", "0.7",
        "--weight-version", "12",
        "--random-seed", "12",
        "--dtype", "bfloat16",
        "--context-length", "8192", "--enable-deterministic-inference",
    ]  # fmt: skip


def test_three_engines_with_tp_2_and_no_gpu_list_use_devices_0_to_5():
    assert engine_gpu_ids(3, 2) == [[0, 1], [2, 3], [4, 5]]
    assert engine_gpu_ids(3, 1) == [[0], [1], [2]]
    assert engine_gpu_ids(1, 2, [6, 7, 0]) == [[6, 7]]  # unused devices are left alone


def test_a_separate_tokenizer_is_passed_as_tokenizer_path():
    cfg = config_from_dict(
        {
            "model": {"path": MODEL, "tokenizer": "/models/tok"},
            "data": {"path": "p.jsonl"},
            "engine": {"backend": "sglang"},
        }
    )
    argv, _ = sglang_argv_factory(cfg, MODEL, 0)(0, "127.0.0.1", 30001)
    assert argv[-2:] == ["--tokenizer-path", "/models/tok"]


def test_colocated_engines_start_with_the_memory_saver():
    cfg = config_from_dict(
        {
            "model": {"path": MODEL},
            "data": {"path": "p.jsonl"},
            "engine": {"backend": "sglang"},
            "cluster": {"colocate": True},
            "train": {"mode": "sync"},
        }
    )
    argv, _ = sglang_argv_factory(cfg, MODEL, 0)(0, "127.0.0.1", 30001)
    assert argv[-1] == "--enable-memory-saver"
    plain, _ = sglang_argv_factory(sglang_config(), MODEL, 0)(0, "127.0.0.1", 30001)
    assert "--enable-memory-saver" not in plain


def test_too_few_or_repeated_gpus_are_a_config_error_naming_the_keys():
    with pytest.raises(ConfigError, match=r"need 6 GPUs.*cluster.engine_gpus = \[0, 1, 2, 3\]"):
        sglang_argv_factory(
            sglang_config(num_engines=3, tp_size=2, cluster={"engine_gpus": [0, 1, 2, 3]}), MODEL, 0
        )
    with pytest.raises(ConfigError, match=r"device\(s\) \[1\] more than once for one engine"):
        sglang_argv_factory(sglang_config(tp_size=2, cluster={"engine_gpus": [1, 1]}), MODEL, 0)


def test_two_sglang_engines_can_share_one_gpu_each_with_its_memory_share():
    cfg = sglang_config(
        num_engines=2,
        mem_fraction_static=0.35,
        cluster={"engine_gpus": [0, 0]},
        weights={"transport": "ipc"},
    )
    factory = sglang_argv_factory(cfg, MODEL, 0)
    for index in range(2):
        argv, env = factory(index, "127.0.0.1", 30001 + index)
        assert env == {"CUDA_VISIBLE_DEVICES": "0", **LIVENESS_ENV}
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.35"
    assert cfg.engine_gpu_ids == {0} and cfg.weight_transport("cuda") == "ipc"


def test_engines_on_the_learners_gpu_are_refused_when_weights_travel_over_nccl():
    nccl = {"transport": "nccl"}
    with pytest.raises(
        ConfigError, match=r"GPU\(s\) \[0, 1\].*cluster.engine_gpus = \[2, 3, 4, 5\]"
    ):
        check_sglang_backend(
            sglang_config(num_engines=2, tp_size=2, cluster={"learner_gpus": [0, 1]}, weights=nccl)
        )
    with pytest.raises(ConfigError, match=r"GPU\(s\) \[0\]"):
        check_sglang_backend(sglang_config(weights=nccl))  # learner on 0, engine 0 on 0
    # With `auto`, an SGLang engine on the learner's one GPU takes its weights by CUDA IPC
    # handle (/update_weights_from_tensor), which passes the GPU check.
    assert sglang_config().weight_transport("cuda") == "ipc"
    with contextlib.suppress(SGLangUnavailable):
        check_sglang_backend(sglang_config())
    gloo = config_from_dict(
        {
            "model": {"path": MODEL},
            "data": {"path": "p.jsonl"},
            "engine": {"backend": "sglang"},
            "weights": {"transport": "gloo"},
        }
    )
    with contextlib.suppress(SGLangUnavailable):  # passing the GPU check is what counts
        check_sglang_backend(gloo)


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        (["--tp-size", "4"], "engine.tp_size"),
        (["--tp", "4"], "engine.tp_size"),
        (["--port=30000"], "free port"),
        (["--model-path", "/other"], "model.path"),
        (["--mem-fraction-static", "0.5"], "engine.mem_fraction_static"),
        (["--base-gpu-id", "2"], "cluster.engine_gpus"),
        (["--pp-size", "2"], "pipeline stages"),
        (["--dp-size", "2"], "without --enable-dp-attention"),
    ],
)
def test_extra_args_that_clash_with_streamrl_or_break_weight_sync_are_refused(extra_args, message):
    with pytest.raises(ConfigError, match=message):
        sglang_argv_factory(sglang_config(extra_args=extra_args), MODEL, 0)


def test_dp_attention_and_pp_size_1_are_allowed_in_extra_args():
    cfg = sglang_config(
        tp_size=2, extra_args=["--dp-size", "2", "--enable-dp-attention", "--pp-size", "1"]
    )
    argv, _ = sglang_argv_factory(cfg, MODEL, 0)(0, "127.0.0.1", 30001)
    assert argv[-5:] == ["--dp-size", "2", "--enable-dp-attention", "--pp-size", "1"]


def test_attached_servers_are_never_launched_and_need_no_sglang_here():
    cfg = sglang_config(urls=["http://gpu-node:30000"])
    check_sglang_backend(cfg)  # no package, no GPU checks: nothing runs here
    factory = sglang_argv_factory(cfg, MODEL, 0)
    with pytest.raises(RuntimeError, match="none is launched"):
        factory(0, "127.0.0.1", 30001)


@pytest.mark.skipif(sglang_available(), reason="SGLang is installed here")
def test_launching_without_sglang_installed_fails_before_anything_starts_and_says_what_to_install():
    cfg = sglang_config(cluster={"engine_gpus": [1]})
    with pytest.raises(SGLangUnavailable, match=r"`sglang` package is not installed.*pip install"):
        check_sglang_backend(cfg)
    embedded = config_from_dict({"data": {"path": "p.jsonl"}})
    check_sglang_backend(embedded)  # the embedded backend needs nothing


@pytest.mark.skipif(sglang_available(), reason="SGLang is installed here: it would really start")
def test_a_server_that_dies_at_start_fails_the_fleet_with_the_tail_of_its_log(tmp_path):
    from streamrl.fleet.supervisor import EngineSupervisor
    from streamrl.process import ProcessDied

    cfg = sglang_config(startup_timeout_s=60)
    fleet = EngineSupervisor(cfg, run_dir=tmp_path, engine_argv=sglang_argv_factory(cfg, MODEL, 0))
    try:
        with pytest.raises(ProcessDied) as error:
            fleet.start()
    finally:
        fleet.stop()
    message = str(error.value)
    assert "engine-0 exited with code 1" in message
    assert "No module named 'sglang'" in message and "engine-0.log" in message


# ---------------------------------------------------------------- weight-group layout


@pytest.mark.parametrize(
    ("counts", "world_size", "rank_offsets"),
    [
        ([1], 2, (1,)),
        ([1, 1, 1], 4, (1, 2, 3)),
        ([2], 3, (1,)),
        ([2, 2, 2], 7, (1, 3, 5)),
        ([2, 1, 4], 8, (1, 3, 4)),
    ],
)
def test_the_trainer_is_rank_0_and_engine_i_starts_after_the_gpus_of_engines_before_it(
    counts, world_size, rank_offsets
):
    layout = weight_group_layout(counts)
    assert layout == (world_size, rank_offsets)
    assert layout.world_size == world_size and layout.rank_offsets == rank_offsets


def test_an_engine_without_gpus_is_refused():
    with pytest.raises(ValueError, match="engine 1 has 0 GPUs"):
        weight_group_layout([1, 0])


def test_an_engines_rank_count_is_its_tp_size_and_unsafe_layouts_are_refused():
    assert engine_gpu_count({"tp_size": 2, "dp_size": 1, "pp_size": 1}) == 2
    assert engine_gpu_count({"port": 30001}) == 1  # a server that does not say: one rank
    assert engine_gpu_count({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}) == 4
    with pytest.raises(ValueError, match="pp_size = 2"):
        engine_gpu_count({"tp_size": 1, "pp_size": 2})
    with pytest.raises(ValueError, match="dp_size = 2 without --enable-dp-attention"):
        engine_gpu_count({"tp_size": 1, "dp_size": 2})


class RecordingEngine:
    """Stands in for an EngineClient: answers every call and records what it was asked."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[tuple[str, dict]] = []

    async def _ok(self, name: str, **kwargs) -> dict:
        self.calls.append((name, kwargs))
        return {"success": True, "message": "ok", "status": "ok"}

    async def accepts_digest(self) -> bool:
        return False  # as an SGLang server: no weights_digest field

    async def pause(self, mode: str) -> dict:
        return await self._ok("pause", mode=mode)

    async def continue_generation(self) -> dict:
        return await self._ok("continue_generation")

    async def init_weights_update_group(self, **kwargs) -> dict:
        return await self._ok("init_weights_update_group", **kwargs)

    async def update_weights_from_distributed(self, names, dtypes, shapes, **kwargs) -> dict:
        return await self._ok("update_weights_from_distributed", names=names, **kwargs)

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._ok("destroy_weights_update_group", group_name=group_name)


@pytest.mark.anyio
@pytest.mark.parametrize(("tp_size", "rank_offsets"), [(1, [1, 2, 3]), (2, [1, 3, 5])])
async def test_the_publisher_joins_three_engines_at_their_rank_offsets(
    monkeypatch, tp_size, rank_offsets
):
    hosted: list[dict] = []
    sent: list[torch.Tensor] = []

    async def host(**kwargs) -> None:
        hosted.append(kwargs)

    monkeypatch.setattr(update_groups_module, "join_in_daemon_thread", host)
    monkeypatch.setattr(
        group_transport_module, "broadcast_flat", lambda group, flat: sent.append(flat)
    )
    monkeypatch.setattr(update_groups_module, "destroy_weight_update_group", lambda group: None)
    engines = [RecordingEngine(f"http://engine-{i}") for i in range(3)]
    published: list[int] = []

    async def counts(clients) -> list[int]:
        return [tp_size] * len(clients)

    async def on_published(version: int) -> None:
        published.append(version)

    publisher = WeightPublisher(
        weights=lambda: [("model.norm.weight", torch.ones(4))],
        members=lambda: engines,
        on_published=on_published,
        transport=GroupTransport(members=lambda: engines, gpu_counts=counts),
        pause_mode="in_place",
    )
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        await publisher.publish(3)
        await publisher.wait_idle()
        tasks.cancel_scope.cancel()

    world_size = 1 + 3 * tp_size
    assert [h["rank"] for h in hosted] == [0] and hosted[0]["world_size"] == world_size
    inits = [dict(e.calls)["init_weights_update_group"] for e in engines]
    assert [init["rank_offset"] for init in inits] == rank_offsets
    assert {init["world_size"] for init in inits} == {world_size}
    assert {init["group_name"] for init in inits} == {hosted[0]["group_name"]}
    assert [name for name, _ in engines[0].calls] == [
        "init_weights_update_group",
        "pause",
        "update_weights_from_distributed",
        "continue_generation",
    ]
    update = dict(engines[0].calls)["update_weights_from_distributed"]
    assert update["weight_version"] == 3 and update["load_format"] == "flattened_bucket"
    # One broadcast: the bucket's bytes (4 fp32 ones).
    assert published == [3] and len(sent) == 1
    assert torch.equal(sent[0].view(torch.float32), torch.ones(4))
