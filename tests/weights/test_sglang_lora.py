"""The client side of LoRA on SGLang (`streamrl.publish.adapter_files`): what the publisher writes
and calls, what `/generate` names, the versions it reports, and the launch flags.

SGLang cannot run here (no CPU build). The server is a fake speaking the subset of
SGLang's HTTP API these calls use (field names from SGLang 0.5.x's http_server.py and
io_struct.py): a unit test of the client against it, not evidence that SGLang accepts
the calls (docs/lora.md says what was verified where).
"""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch
from aiohttp import web

from streamrl.config import config_from_dict
from streamrl.fleet.client import EngineClient, adapter_name
from streamrl.fleet.sglang import sglang_lora_args
from streamrl.publish.adapter_files import AdapterFileTransport
from streamrl.publish.publisher import WeightPublisher
from streamrl.weights import adapters

RANK = 4
TARGETS = ("q_proj", "v_proj")


class FakeSGLang:
    """Records every call; keeps the loaded adapters and the weight version as SGLang does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.loaded: dict[str, str] = {}
        self.weight_version = "0"

    def app(self) -> web.Application:
        app = web.Application()
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/load_lora_adapter",
            "/unload_lora_adapter",
            "/update_weight_version",
            "/generate",
        ):
            app.router.add_post(path, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = request.path.removeprefix("/")
        self.calls.append((name, body))
        if name == "load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return web.json_response({"success": False, "error_message": "exists"}, status=400)
            self.loaded[body["lora_name"]] = body["lora_path"]
            return web.json_response({"success": True, "loaded_adapters": self.loaded})
        if name == "unload_lora_adapter":
            if self.loaded.pop(body["lora_name"], None) is None:
                return web.json_response({"success": False, "error_message": "none"}, status=400)
            return web.json_response({"success": True, "loaded_adapters": self.loaded})
        if name == "update_weight_version":
            self.weight_version = body["new_version"]
            return web.json_response({"success": True, "new_version": body["new_version"]})
        if name == "generate":
            return web.json_response(self._generated(body))
        return web.json_response({"status": "ok"})

    def _generated(self, body: dict) -> dict | list[dict]:
        prompts, lora = body["input_ids"], body.get("lora_path")
        if prompts and isinstance(prompts[0], list):  # a batch: one lora_path per prompt
            names = lora if isinstance(lora, list) else [lora] * len(prompts)
            return [self._one(p, name) for p, name in zip(prompts, names, strict=True)]
        return self._one(prompts, lora)

    def _one(self, prompt: list[int], lora: str | None) -> dict:
        if lora is not None and lora not in self.loaded:
            raise web.HTTPBadRequest(text=f"adapter {lora} not loaded")
        return {
            "text": "ab",
            "output_ids": [5, 6],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": 2},
                "prompt_tokens": len(prompt),
                "completion_tokens": 2,
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                "weight_version": self.weight_version,
            },
        }


@contextlib.asynccontextmanager
async def fake_sglang(port: int):
    server = FakeSGLang()
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _wire(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    module = "model.layers.0.self_attn.q_proj"
    return [
        (module + adapters.LORA_A, torch.randn(RANK, 8, generator=generator)),
        (module + adapters.LORA_B, torch.randn(8, RANK, generator=generator)),
    ]


async def _publish(engines, transport, versions) -> None:
    """Each version of `versions` through a publisher (pause mode `abort`), one at a time;
    version v's adapters are `_wire(v)`."""
    now = {}

    async def on_published(version: int) -> None:
        pass

    publisher = WeightPublisher(
        weights=lambda: iter(_wire(now["version"])),
        members=lambda: engines,
        on_published=on_published,
        transport=transport,
        pause_mode="abort",
    )
    async with anyio.create_task_group() as tasks:
        await tasks.start(publisher.run)
        for version in versions:
            now["version"] = version
            with anyio.fail_after(30):
                await publisher.publish(version)
                await publisher.wait_idle()
        tasks.cancel_scope.cancel()
    assert all(record.ok for record in publisher.records)


@pytest.mark.anyio
async def test_each_version_is_loaded_under_its_name_and_the_one_before_last_unloaded(
    tmp_path, free_port
):
    files = AdapterFileTransport(directory=tmp_path, rank=RANK, target_modules=TARGETS)
    async with fake_sglang(free_port()) as (server, url), EngineClient(url) as client:
        await _publish([client], files, versions=(1, 2, 3))
    names = [name for name, _ in server.calls]
    assert names[:4] == [
        "pause_generation",
        "load_lora_adapter",
        "update_weight_version",
        "continue_generation",
    ]
    assert server.calls[0][1] == {"mode": "abort"}
    loads = [body for name, body in server.calls if name == "load_lora_adapter"]
    assert [body["lora_name"] for body in loads] == ["streamrl-v1", "streamrl-v2", "streamrl-v3"]
    assert [body["lora_path"] for body in loads] == [str(tmp_path / f"v{v}") for v in (1, 2, 3)]
    unloads = [body["lora_name"] for name, body in server.calls if name == "unload_lora_adapter"]
    assert unloads == ["streamrl-v1"]
    assert set(server.loaded) == {"streamrl-v2", "streamrl-v3"} and server.weight_version == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]


def test_the_written_adapter_is_peft_format_whose_product_is_the_wires(tmp_path):
    files = AdapterFileTransport(directory=tmp_path, rank=RANK, target_modules=TARGETS)
    wire = _wire(7)
    spec, tensors = adapters.read_peft_adapter(files.write(7, wire))
    assert (spec.rank, spec.alpha, spec.target_modules) == (RANK, float(RANK), TARGETS)
    (name_a, a), (name_b, b) = wire
    assert torch.equal(tensors[adapters.PEFT_PREFIX + name_a], a)
    assert torch.equal(tensors[adapters.PEFT_PREFIX + name_b] * spec.scaling, b)


@pytest.mark.anyio
async def test_a_routed_generate_names_the_adapter_and_its_tokens_carry_that_version(free_port):
    heard = {"version": 0}
    async with fake_sglang(free_port()) as (server, url), EngineClient(url) as client:
        client.adapter_version = lambda: heard["version"]
        base = await client.generate([1, 2, 3], {"max_new_tokens": 2})
        server.loaded["streamrl-v2"] = "/x"
        server.weight_version = "3"  # the server moved on; this request named v2's adapter
        heard["version"] = 2
        routed = await client.generate([1, 2, 3], {"max_new_tokens": 2})
        many = await client.generate_many([[1, 2], [3]], {"max_new_tokens": 2})
    bodies = [body for name, body in server.calls if name == "generate"]
    assert "lora_path" not in bodies[0] and base.versions == [0, 0]
    assert bodies[1]["lora_path"] == "streamrl-v2"
    assert routed.versions == [2, 2] and routed.versions_exact and routed.weight_version == 2
    assert bodies[2]["lora_path"] == ["streamrl-v2", "streamrl-v2"]
    assert all(result.versions == [2, 2] for result in many)


@pytest.mark.anyio
async def test_the_publisher_sends_sglang_adapters_as_files_and_reports_the_version(
    tmp_path, free_port
):
    published = []

    async def on_published(version: int) -> None:
        published.append(version)

    async with fake_sglang(free_port()) as (server, url), EngineClient(url) as client:
        publisher = WeightPublisher(
            weights=lambda: iter(_wire(1)),
            members=lambda: [client],
            on_published=on_published,
            transport=AdapterFileTransport(directory=tmp_path, rank=RANK, target_modules=TARGETS),
            pause_mode="abort",
        )
        async with anyio.create_task_group() as tasks:
            await tasks.start(publisher.run)
            with anyio.fail_after(30):
                await publisher.publish(1)
                await publisher.wait_idle()
            tasks.cancel_scope.cancel()
    assert published == [1] and publisher.records[-1].ok
    assert "streamrl-v1" in server.loaded and server.weight_version == "1"
    assert not any("weights" in name for name, _ in server.calls)  # no update group
    _, tensors = adapters.read_peft_adapter(tmp_path / "v1")
    (name_a, a), _ = _wire(1)
    assert torch.equal(tensors[adapters.PEFT_PREFIX + name_a], a)


def test_sglang_engines_of_a_lora_run_start_with_lora_on_and_a_resumed_adapter(tmp_path):
    from streamrl.fleet.sglang import sglang_argv_factory

    cfg = config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": str(tmp_path)},
            "engine": {"backend": "sglang"},
            "learner": {"lora": {"rank": 16, "target_modules": ["q_proj", "down_proj"]}},
        }
    )
    fresh, _ = sglang_argv_factory(cfg, str(tmp_path), 0)(0, "127.0.0.1", 30000)
    assert fresh[fresh.index("--enable-lora") :][:6] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "down_proj",
    ]  # fmt: skip
    assert "--lora-paths" not in fresh
    resumed, _ = sglang_argv_factory(cfg, str(tmp_path), 5, lora_adapter="/ckpt")(0, "h", 1)
    assert resumed[resumed.index("--lora-paths") + 1] == "streamrl-v5=/ckpt"
    assert adapter_name(0) is None and sglang_lora_args(4, ["q_proj"])[-1] == "q_proj"
