"""`EngineClient`: an async client of one SGLang-protocol server (an SGLang engine, the
embedded engine, or sglang-router for `/generate`).

Every call maps to one endpoint of SGLang's native HTTP API (docs/engine.md lists the
subset); a failed call raises `EngineError` with the HTTP status (None when no answer
came). `streamrl.fleet.engine_set.EngineSet` holds every engine of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from streamrl.fleet.limits import RequestLimits
from streamrl.fleet.results import GenerateResult, parse_result, parse_version
from streamrl.weights.layout import engine_gpu_count

DEFAULT_GROUP_NAME = "weight_update_group"
ADAPTER_PREFIX = "streamrl-v"
"""An engine that serves LoRA adapters by name (SGLang) holds version v's as `streamrl-v<v>`."""


def adapter_name(version: int) -> str | None:
    """The served name of the adapter that carries `version`; None for version 0, the base."""
    return f"{ADAPTER_PREFIX}{version}" if version > 0 else None


class EngineError(RuntimeError):
    """An engine call failed: HTTP 4xx/5xx (`status`), or no answer at all (`status` None)."""

    def __init__(self, url: str, endpoint: str, status: int | None, body: str) -> None:
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.body = body
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}{endpoint}: {what}: {body[:2000]}")


class EngineClient:
    """Async client of one SGLang-protocol server. Use as `async with`, or call `aclose()`."""

    def __init__(
        self, url: str, *, timeout_s: float = 600.0, limits: RequestLimits | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.limits = limits
        """Checked before every `/generate` (`streamrl.fleet.limits`); None checks nothing."""
        self.adapter_version: Callable[[], int] | None = None
        """LoRA on SGLang (`streamrl.publish.adapter_files`): the version whose adapter every
        `/generate` names (`lora_path`), which then tags all its tokens; None names none."""
        self._accepts_digest: bool | None = None
        self.paused = False
        """Whether this client paused the engine (`pause`) and has not let it go on since
        (`continue_generation`). SGLang's `/health_generate` waits at the pause's gate, so
        the fleet's health check then asks `/health` instead (`streamrl.fleet.supervisor`),
        which SGLang answers without generating when started with
        `streamrl.fleet.sglang.LIVENESS_ENV`."""
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    async def _request(
        self,
        method: str,
        endpoint: str,
        body: dict | None = None,
        *,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s, connect=10.0) if timeout_s is not None else None
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if body is not None:
            kwargs["content"] = msgspec.json.encode(body)
            kwargs["headers"] = {"content-type": "application/json"}
        try:
            response = await self._http.request(method, endpoint, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineError(self.url, endpoint, None, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise EngineError(self.url, endpoint, response.status_code, response.text)
        return response

    async def _json(self, method: str, endpoint: str, body: dict | None = None, **kwargs) -> Any:
        response = await self._request(method, endpoint, body, **kwargs)
        if not response.content:
            return None
        try:
            return msgspec.json.decode(response.content)
        except msgspec.DecodeError:
            return response.text

    # ---- generation ------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """Generate one sample for one prompt (`sampling_params["n"]` must be 1).

        Raises `RequestRejected` (nothing sent) when the request breaks `limits`."""
        if (sampling_params or {}).get("n", 1) not in (1, None):
            raise ValueError("generate() makes one sample; use generate_many() for n > 1")
        if self.limits is not None:
            self.limits.check([input_ids], sampling_params or {})
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
        version, name = self._adapter()
        if name is not None:
            body["lora_path"] = name
        payload = await self._json("POST", "/generate", body)
        if isinstance(payload, list):
            payload = payload[0]
        return _tagged(parse_result(payload), version)

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict | None = None,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> list[GenerateResult]:
        """One batched call; with `n` > 1 the results are prompt-major (n per prompt).

        sglang-router 0.3.2 refuses a list `rid` (422): pass `rids` only to engines."""
        if self.limits is not None:
            self.limits.check(prompts, sampling_params or {})
        body: dict[str, Any] = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            body["rid"] = list(rids)
        if return_routed_experts:
            body["return_routed_experts"] = True
        version, name = self._adapter()
        if name is not None:
            body["lora_path"] = [name] * len(prompts)
        payload = await self._json("POST", "/generate", body)
        payloads = payload if isinstance(payload, list) else [payload]
        return [_tagged(parse_result(item), version) for item in payloads]

    def _adapter(self) -> tuple[int | None, str | None]:
        """(version, adapter name) a `/generate` runs with (None, None without a route)."""
        if self.adapter_version is None:
            return None, None
        version = self.adapter_version()
        return version, adapter_name(version)

    # ---- health and info -------------------------------------------------
    async def health(self) -> None:
        """Raise `EngineError` unless GET /health answers 200."""
        await self._request("GET", "/health", timeout_s=10.0)

    async def is_healthy(self) -> bool:
        try:
            await self.health()
        except EngineError:
            return False
        return True

    async def health_generate(self, timeout_s: float = 30.0) -> None:
        """Raise `EngineError` unless a one-token generation succeeds within `timeout_s`."""
        await self._request("GET", "/health_generate", timeout_s=timeout_s)

    async def _info(self, name: str) -> dict:
        try:
            return await self._json("GET", f"/{name}")
        except EngineError as exc:
            if exc.status != 404:
                raise
            return await self._json("GET", f"/get_{name}")

    async def model_info(self) -> dict:
        return await self._info("model_info")

    async def server_info(self) -> dict:
        return await self._info("server_info")

    async def accepts_digest(self) -> bool:
        """Whether this is an embedded engine, which checks a `weights_digest` before loading
        and takes staged updates (SGLang has neither: they are not sent there). Asked once,
        then remembered."""
        if self._accepts_digest is None:
            version = str((await self.server_info()).get("version", ""))
            self._accepts_digest = version.startswith("streamrl")
        return self._accepts_digest

    async def weight_version(self) -> int:
        return parse_version((await self.model_info()).get("weight_version"))

    # ---- control ---------------------------------------------------------
    async def flush_cache(self) -> bool:
        """True when flushed; False when the engine refused (400: requests running)."""
        try:
            await self._request("POST", "/flush_cache")
        except EngineError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request (by rid) or, with `abort_all`, every request."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> dict:
        """Pause generation: `abort` | `retract` | `in_place` (keeps the KV cache), or
        `retract_abort`: `retract`, then `/abort_request` for all, which answers every
        request taken back to the queue with its partial output at once (SGLang's `abort`
        pause instead polls once a second until they have left: docs/sglang.md)."""
        self.paused = True  # before the call: SGLang's abort pause takes a second or more
        if mode == "retract_abort":
            answer = await self._json("POST", "/pause_generation", {"mode": "retract"})
            await self.abort(abort_all=True)
            return answer
        return await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        answer = await self._json("POST", "/continue_generation", {})
        self.paused = False
        return answer

    # ---- memory handoff (colocated training) ------------------------------
    async def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float = 600.0
    ) -> dict | None:
        """SGLang's `/release_memory_occupation`: free `tags` (`weights`, `kv_cache`,
        `cuda_graph`; None: all). Only while no request runs (pause with mode `abort` first).
        Released weights are lost: push weights after the resume. SGLang needs
        `--enable-memory-saver`; it answers an empty body, the embedded engine
        `released_bytes`."""
        body = {"tags": None if tags is None else list(tags)}
        return await self._json("POST", "/release_memory_occupation", body, timeout_s=timeout_s)

    async def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float = 600.0
    ) -> dict | None:
        """SGLang's `/resume_memory_occupation`: take `tags` back (None: all)."""
        body = {"tags": None if tags is None else list(tags)}
        return await self._json("POST", "/resume_memory_occupation", body, timeout_s=timeout_s)

    # ---- weights ---------------------------------------------------------
    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> dict:
        """Blocks until every rank (the trainer as rank 0 too) has joined."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._json("POST", "/init_weights_update_group", body, timeout_s=timeout_s)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        weights_digest: str | None = None,
        timeout_s: float = 600.0,
    ) -> dict:
        """Blocks until the engine has received every broadcast and loaded the tensors.

        `dtypes` may be torch dtypes or names ("bfloat16", "torch.bfloat16");
        `load_format = "flattened_bucket"`: the tensors come as one flat broadcast;
        `weights_digest` (embedded engines only, `accepts_digest`): the engine checks the
        bytes it received against it and loads nothing on a mismatch."""
        body = {
            "names": list(names),
            "dtypes": [str(dtype).removeprefix("torch.") for dtype in dtypes],
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weights_digest is not None:
            body["weights_digest"] = weights_digest
        return await self._json(
            "POST", "/update_weights_from_distributed", body, timeout_s=timeout_s
        )

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | int | None = None,
        flush_cache: bool | None = None,
    ) -> dict:
        """Load a checkpoint directory. `flush_cache` None leaves the server's default
        (SGLang: flush, which it asserts succeeds: never while requests are held)."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        if flush_cache is not None:
            body["flush_cache"] = flush_cache
        return await self._json("POST", "/update_weights_from_disk", body)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weights_digest: str | None = None,
        stage: str | None = None,
        flattened: tuple[list[str], list[str], list[list[int]]] | None = None,
        timeout_s: float = 600.0,
    ) -> dict:
        """Weights by reference, for an engine on the caller's own device: one entry per engine
        GPU, each from `streamrl.weights.ipc.serialize_named_tensors` (`weights_digest` as
        for `update_weights_from_distributed`). Embedded engines only: with `stage`, checked
        and kept for `load_staged_weights` instead of loaded; with `flattened` (names, dtypes,
        shapes), each entry holds one uint8 tensor of the tensors' bytes back to back."""
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": None if flattened is None else "flattened_bucket",
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        if weights_digest is not None:
            body["weights_digest"] = weights_digest
        if stage is not None:
            body["stage"] = stage
        if flattened is not None:
            body["names"], body["dtypes"], body["shapes"] = flattened
        return await self._json("POST", "/update_weights_from_tensor", body, timeout_s=timeout_s)

    async def load_staged_weights(
        self,
        stage: str,
        *,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        timeout_s: float = 600.0,
    ) -> dict:
        """An embedded engine's `/load_staged_weights`: load every call staged as `stage` at one
        step boundary; the answer's `engine_pause_s` is how long generation stood still."""
        body = {
            "stage": stage,
            "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        return await self._json("POST", "/load_staged_weights", body, timeout_s=timeout_s)

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> dict:
        """SGLang's `/load_lora_adapter`: the peft adapter directory `path` under `name`
        (`{success, error_message, loaded_adapters}`; HTTP 400 when it fails)."""
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return await self._json("POST", "/load_lora_adapter", body)

    async def unload_lora_adapter(self, name: str) -> dict:
        """SGLang's `/unload_lora_adapter`: forget the adapter `name`."""
        return await self._json("POST", "/unload_lora_adapter", {"lora_name": name})

    async def update_weight_version(self, version: str | int) -> dict:
        """SGLang's `/update_weight_version`: tag the weights as `version` (weights unchanged)."""
        body = {"new_version": str(version), "abort_all_requests": False}
        return await self._json("POST", "/update_weight_version", body)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        return await self._json("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def load(self) -> dict:
        """The embedded engine's `/get_load` entry (running, waiting, paused requests)."""
        return (await self._json("GET", "/get_load"))[0]


def _tagged(result: GenerateResult, version: int | None) -> GenerateResult:
    """A response generated by the adapter of `version`: every token is of that version."""
    if version is None:
        return result
    return msgspec.structs.replace(
        result,
        versions=[version] * len(result.output_ids),
        versions_exact=True,
        weight_version=version,
    )


async def engine_gpu_counts(engines: Sequence[EngineClient]) -> list[int]:
    """Each engine's rank count (`engine_gpu_count` of its `/server_info`), in order."""
    return [engine_gpu_count(await engine.server_info()) for engine in engines]
