"""Two embedded engines behind the real sglang-router (Rust binary from PyPI)."""

from __future__ import annotations

import anyio
import httpx
import pytest
from engine_helpers import (
    engine_load,
    joined_update_group,
    running_engines,
    teacher_forced_logprobs,
)

from streamrl.fleet.client import EngineClient, EngineError
from streamrl.fleet.engine_set import EngineSet
from streamrl.fleet.router import Router, RouterError
from streamrl.weights.group import (
    broadcast_tensors,
    destroy_weight_update_group,
)

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    with running_engines(tiny_model_dir, logs, count=2) as engines:
        router = Router.start(
            [engine.url for engine in engines], log_path=logs / "router.log", policy="round_robin"
        )
        try:
            yield engines, router
        finally:
            router.stop()


def _finished(engines) -> list[int]:
    return [engine_load(engine.url)["num_finished_reqs"] for engine in engines]


def test_the_router_registers_both_engines_and_does_not_route_control_calls(cluster):
    engines, router = cluster
    assert sorted(router.worker_urls()) == sorted(engine.url for engine in engines)
    for path in (
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
    ):
        assert httpx.post(f"{router.url}{path}", json={}, timeout=10).status_code == 404, path


@pytest.mark.anyio
async def test_a_two_engines_behind_a_router_generate_through_it_and_update_weights_directly(
    cluster,
):
    engines, router = cluster
    urls = [engine.url for engine in engines]
    async with EngineSet(urls, router_url=router.url, timeout_s=120) as engine_set:
        before = _finished(engines)
        results = [await engine_set.generate(PROMPT, PARAMS) for _ in range(4)]
        assert all(len(r.output_ids) == 6 and r.weight_version == 0 for r in results)
        after = _finished(engines)
        assert [b - a for a, b in zip(before, after, strict=True)] == [2, 2]  # round robin

        group = await joined_update_group(engine_set, "wg")
        try:
            from streamrl.models import build_random_model

            model = build_random_model("qwen3-tiny", seed=11)
            weights = {name: p.detach() for name, p in model.named_parameters()}
            await engine_set.pause("in_place")
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(
                    lambda: engine_set.update_weights_from_distributed(
                        list(weights),
                        [t.dtype for t in weights.values()],
                        [t.shape for t in weights.values()],
                        weight_version=7,
                        group_name="wg",
                    )
                )
                await anyio.to_thread.run_sync(broadcast_tensors, group, list(weights.values()))
            await engine_set.continue_generation()
        finally:
            await engine_set.destroy_weights_update_group("wg")
            destroy_weight_update_group(group)

        assert [await e.weight_version() for e in engine_set.engines] == [7, 7]
        results = [await engine_set.generate(PROMPT, PARAMS) for _ in range(2)]
        assert all(r.versions == [7] * 6 for r in results)
        for result in results:
            expected = teacher_forced_logprobs(
                engines[0].model_dir, PROMPT, result.output_ids, weights
            )
            assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) <= 1e-4


def test_d_the_router_drops_unknown_keys_and_the_engine_ignores_the_keys_it_adds(cluster):
    engines, router = cluster
    body = {
        "input_ids": PROMPT,
        "not_a_field": 1,
        "sampling_params": {**PARAMS, "not_a_sampling_param": 2},
        "return_logprob": True,
    }
    through_router = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert through_router.status_code == 200, through_router.text
    assert through_router.json()["meta_info"]["completion_tokens"] == 6
    direct = httpx.post(f"{engines[0].url}/generate", json=body, timeout=60)
    assert direct.status_code == 400 and "not_a_sampling_param" in direct.text
    # A 400 from a worker comes back through the router as a 400.
    bad = {"input_ids": PROMPT, "sampling_params": {"temperature": -1.0}}
    assert httpx.post(f"{router.url}/generate", json=bad, timeout=60).status_code == 400


def test_workers_can_be_removed_and_added_while_the_router_runs(cluster):
    engines, router = cluster
    router.remove_worker(engines[1].url)
    try:
        assert router.worker_urls() == [engines[0].url]
        before = _finished(engines)
        for _ in range(3):
            response = httpx.post(
                f"{router.url}/generate",
                json={"input_ids": PROMPT, "sampling_params": PARAMS},
                timeout=60,
            )
            assert response.status_code == 200
        after = _finished(engines)
        assert [b - a for a, b in zip(before, after, strict=True)] == [3, 0]
        with pytest.raises(RouterError):
            router.remove_worker(engines[1].url)
    finally:
        router.add_worker(engines[1].url)
    assert sorted(router.worker_urls()) == sorted(e.url for e in engines)


@pytest.mark.anyio
async def test_engine_errors_name_the_url_the_endpoint_and_the_status(cluster, free_port):
    _, router = cluster
    async with EngineClient(router.url) as through_router:
        with pytest.raises(EngineError) as error:
            await through_router.pause("in_place")
        assert error.value.status == 404 and error.value.endpoint == "/pause_generation"
        assert error.value.url == router.url and router.url in str(error.value)
    async with EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as nobody:
        with pytest.raises(EngineError) as error:
            await nobody.health()
        assert error.value.status is None and not await nobody.is_healthy()


@pytest.mark.anyio
async def test_sessions_stick_to_one_engine_and_only_a_down_engines_sessions_move():
    urls = [f"http://127.0.0.1:{port}" for port in (1, 2, 3)]
    async with EngineSet(urls) as engine_set:
        keys = [f"episode-{i}" for i in range(60)]
        chosen = {key: engine_set.session(key).url for key in keys}
        assert chosen == {key: engine_set.session(key).url for key in keys}
        assert set(chosen.values()) == set(urls)
        engine_set.mark_down(urls[0])
        moved = {key: engine_set.session(key).url for key in keys}
        assert all(moved[k] == chosen[k] for k in keys if chosen[k] != urls[0])
        assert urls[0] not in moved.values()
        # Without a router, generation goes round-robin over the engines that are up.
        assert [engine_set.generator().url for _ in range(4)] == [
            urls[1],
            urls[2],
            urls[1],
            urls[2],
        ]
        engine_set.mark_up(urls[0])
        assert {key: engine_set.session(key).url for key in keys} == chosen


def test_a_router_whose_picked_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """Another process binds the port picked for the router before the router does: the
    router exits with sglang-router's "Address already in use", and `Router.start` picks
    again and starts it (no workers: it serves at once). A port the caller gave is not
    replaced: the same exit is raised."""
    import socket

    from streamrl.fleet import router as router_module
    from streamrl.process import ProcessDied, free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    monkeypatch.setattr(
        router_module, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host)
    )
    log_path = tmp_path / "router.log"
    try:
        router = Router.start([], log_path=log_path, timeout_s=60)
        try:
            assert router.url != f"http://127.0.0.1:{taken_port}"
            assert router.workers() == []
        finally:
            router.stop()
        assert router_module.PORT_TAKEN in log_path.read_text()  # the first start
        with pytest.raises(ProcessDied, match=router_module.PORT_TAKEN):
            Router.start([], log_path=tmp_path / "given.log", port=taken_port, timeout_s=60)
    finally:
        taken.close()
