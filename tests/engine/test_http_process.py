"""The engine split in two processes (`--http-process on`) as processes: how it stops, and
what its HTTP process does when the model's process dies. (Its HTTP behaviour is the
one-process engine's: test_engine_server.py and test_engine_memory.py run on both.)"""

from __future__ import annotations

import contextlib
import os
import signal

import anyio
import httpx
import numpy as np
import pytest
from engine_helpers import engine_load, running_engines, wait_until

from streamrl.engine.bridge import ToFront, _finished, _output
from streamrl.engine.core import Output
from streamrl.fleet.client import EngineClient, EngineError

pytestmark = pytest.mark.anyio

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_sigterm_stops_both_processes_with_exit_code_0(tiny_model_dir, tmp_path):
    with running_engines(tiny_model_dir, tmp_path, extra_args=["--http-process", "on"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=60) as client:
            info = await client.server_info()
            result = await client.generate(PROMPT, {"max_new_tokens": 3})
        model_pid = info["engine_process"]["pid"]
        assert info["http_process"] == "on" and model_pid != engine.process.pid
        assert _is_running(model_pid) and len(result.output_ids) == 3
    # running_engines sent SIGTERM to the HTTP process and checked its exit code (0).
    wait_until(lambda: not _is_running(model_pid), what="the model's process gone", timeout_s=10)


async def test_when_the_models_process_dies_its_requests_fail_and_the_server_exits_1(
    tiny_model_dir, tmp_path
):
    split = running_engines(tiny_model_dir, tmp_path, extra_args=["--http-process", "on"])
    with pytest.raises(AssertionError, match=r"did not exit cleanly.*: 1\}"), split as (engine,):
        async with EngineClient(engine.url, timeout_s=60) as client:
            model_pid = (await client.server_info())["engine_process"]["pid"]
            failures = []

            async def generate() -> None:
                try:
                    await client.generate(PROMPT, LONG)
                except EngineError as error:
                    failures.append(error)

            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await anyio.to_thread.run_sync(
                    lambda: wait_until(
                        lambda: engine_load(engine.url)["num_running_reqs"] == 1,
                        what="request running",
                    )
                )
                os.kill(model_pid, signal.SIGKILL)
        (failure,) = failures
        assert failure.status == 503 and "exited with code -9" in failure.body
        # The server does not go on as a live engine without its model: it exits, 1.
        wait_until(lambda: not engine.process.is_alive(), what="the server exited")


def test_a_finished_frame_carries_the_whole_output_routed_experts_included():
    import msgspec

    routed = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    output = Output(
        rid="r",
        output_ids=[5, 6],
        logprobs=[-0.5, -1.25],
        versions=["1", "2"],
        finish_reason={"type": "length", "length": 2},
        prompt_tokens=1,
        cached_tokens=1,
        routed_experts=routed,
    )
    raw = msgspec.msgpack.encode(_finished(output, "2"))
    frame = msgspec.msgpack.Decoder(ToFront).decode(raw)
    assert frame.weight_version == "2"
    back = _output(frame)
    assert np.array_equal(back.routed_experts, routed)
    back.routed_experts = output.routed_experts = None
    assert back == output


async def test_requests_of_one_loop_turn_leave_as_one_submit_and_an_abort_after_them(tmp_path):
    """The HTTP process's end of the bridge against a stand-in engine end (two sockets)."""
    import asyncio

    import msgspec
    import zmq
    import zmq.asyncio

    from streamrl.engine.bridge import Abort, Finished, RemoteCore, Submit, ToEngine, addresses
    from streamrl.engine.core import Request, SamplingParams

    requests_at, outputs_at = addresses(str(tmp_path))
    remote = RemoteCore(requests_at, outputs_at)
    remote.attach({"vocab_size": 10, "max_seq_len": 8}, tokenizer=None)
    context = zmq.asyncio.Context()
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(outputs_at)
    decode = msgspec.msgpack.Decoder(ToEngine).decode
    try:

        def call(rid: str):
            request = Request(rid, [1, 2], SamplingParams(max_new_tokens=1))
            return asyncio.ensure_future(remote.generate([request]))

        calls = [call(f"r{index}") for index in range(3)]
        await asyncio.sleep(0)  # the calls queue their requests in this turn of the loop
        remote.abort("r1")
        await asyncio.sleep(0.05)
        # The engine's end connects only now: the frames waited for it, in their order.
        inbox.connect(requests_at)
        receive = [asyncio.wait_for(inbox.recv(), 10) for _ in range(2)]
        first, second = decode(await receive[0]), decode(await receive[1])
        assert isinstance(first, Submit) and [w.rid for w in first.requests] == ["r0", "r1", "r2"]
        assert second == Abort("r1")
        for rid in ("r0", "r1", "r2"):
            finished = Finished(rid, [3], [-0.5], ["v"], {"type": "length"}, 2, 0, "v")
            await outbox.send(msgspec.msgpack.encode(finished))
        outputs = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [o.rid for (o,) in outputs] == ["r0", "r1", "r2"]
        assert all(o.output_ids == [3] for (o,) in outputs)
    finally:
        inbox.close()
        outbox.close()
        context.term()
        await remote.close()


# -- several HTTP processes (--http-processes) ----------------------------------------------

TWO_FRONTS = ["--http-processes", "2"]


@contextlib.asynccontextmanager
async def _clients_at(url: str, *indices: int):
    """One client per index, whose one kept-alive connection the kernel gave that HTTP
    process; closed at the end."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for index in indices:
            for _ in range(200):
                client = httpx.AsyncClient(
                    base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)
                )
                stack.push_async_callback(client.aclose)
                info = (await client.get("/server_info")).json()
                if info["front_process"]["index"] == index:
                    clients.append(client)
                    break
            else:
                raise AssertionError(f"no connection reached HTTP process {index} in 200 tries")
        yield clients


async def _load(client: httpx.AsyncClient) -> dict:
    return (await client.get("/get_load")).json()[0]


async def _until(check, what: str, timeout_s: float = 30.0) -> None:
    """Poll the coroutine function `check` until it returns true (a readiness wait)."""
    with anyio.fail_after(timeout_s):
        delay = 0.01
        while not await check():
            await anyio.sleep(delay)
            delay = min(2 * delay, 0.2)


async def test_http_processes_share_the_port_and_stop_together(tiny_model_dir, tmp_path):
    with running_engines(tiny_model_dir, tmp_path, extra_args=TWO_FRONTS) as (engine,):
        async with _clients_at(engine.url, 0, 1) as (first, second):
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
            answers = [(await client.post("/generate", json=body)).json()
                       for client in (first, second)]  # fmt: skip
            info = (await second.get("/server_info")).json()
            load = await _load(first)
        sibling_pid = info["front_process"]["pid"]
        assert sibling_pid != engine.process.pid and _is_running(sibling_pid)
        assert [len(answer["output_ids"]) for answer in answers] == [3, 3]
        assert load["num_finished_reqs"] == 2  # the engine's count, over both
    # running_engines sent SIGTERM to the first HTTP process and checked its exit code (0).
    wait_until(lambda: not _is_running(sibling_pid), what="the other HTTP process gone")
    wait_until(lambda: not _is_running(info["engine_process"]["pid"]), what="the model gone")


async def test_pause_abort_and_continue_at_one_http_process_act_on_the_others_calls(
    tiny_model_dir, tmp_path
):
    """Asked of HTTP process 0, they act on the calls that HTTP process 1 holds: at its
    pause gate (an abort by rid ends one, a continue runs another) or in the engine."""
    with running_engines(tiny_model_dir, tmp_path, extra_args=TWO_FRONTS) as (engine,):
        async with _clients_at(engine.url, 0, 1, 1) as (control, caller, watcher):
            results = {}

            async def generate(rid: str, params: dict) -> None:
                body = {"input_ids": PROMPT, "sampling_params": params, "rid": rid}
                results[rid] = (await caller.post("/generate", json=body)).json()

            async def held() -> bool:
                return (await _load(watcher))["num_paused_reqs"] == 1

            async def running() -> bool:
                return (await _load(watcher))["num_running_reqs"] == 1

            await control.post("/pause_generation", json={"mode": "abort"})
            async with anyio.create_task_group() as group:
                group.start_soon(generate, "first", {"max_new_tokens": 4})
                await _until(held, "a call held at the other process's gate")
                await control.post("/abort_request", json={"rid": "first"})
            async with anyio.create_task_group() as group:
                group.start_soon(generate, "second", {"max_new_tokens": 4})
                await _until(held, "a call held at the other process's gate")
                assert "second" not in results
                await control.post("/continue_generation", json={})
            async with anyio.create_task_group() as group:
                group.start_soon(generate, "third", LONG)
                await _until(running, "a call running in the engine")
                await control.post("/abort_request", json={"rid": "third"})
    first, second, third = (results[rid] for rid in ("first", "second", "third"))
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and first["output_ids"] == []
    assert second["meta_info"]["finish_reason"]["type"] == "length"
    assert len(second["output_ids"]) == 4
    assert third["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(third["output_ids"]) < LONG["max_new_tokens"]


async def test_when_another_http_process_dies_the_server_exits_1(tiny_model_dir, tmp_path):
    split = running_engines(tiny_model_dir, tmp_path, extra_args=TWO_FRONTS)
    with pytest.raises(AssertionError, match=r"did not exit cleanly.*: 1\}"), split as (engine,):
        async with _clients_at(engine.url, 1) as (second,):
            info = (await second.get("/server_info")).json()
        os.kill(info["front_process"]["pid"], signal.SIGKILL)
        wait_until(lambda: not engine.process.is_alive(), what="the server exited")
    wait_until(lambda: not _is_running(info["engine_process"]["pid"]), what="the model gone")
