"""One async client for SGLang servers, sglang-router and the embedded engine.

`EngineClient` speaks to one URL (an engine, or a router for `/generate`).
`EngineSet` holds every engine of a run: generation goes through the router
(or round-robin over engines without one); control calls (pause, continue,
abort, weight updates) go to every engine directly and concurrently, because
the router answers 404 to them; `session(key)` pins a multi-turn episode to
one engine (rendezvous hashing, skipping engines marked down).

Token versions. `GenerateResult.versions` holds one integer per output token,
parsed from the engine's version strings ("default" -> 0, digits -> int). When
the response carries `meta_info.weight_versions` spans (the embedded engine
always sends them) they are expanded and `versions_exact` is True. Without
spans every token gets `meta_info.weight_version`, the version when the
request *finished*, and `versions_exact` is False: for a request that
straddled an update that overstates the freshness of its early tokens, so
staleness computed from such results is a lower bound.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import httpx
import msgspec

DEFAULT_GROUP_NAME = "weight_update_group"
T = TypeVar("T")


class EngineError(RuntimeError):
    """An engine call failed: HTTP 4xx/5xx (`status`), or no answer at all (`status` None)."""

    def __init__(self, url: str, endpoint: str, status: int | None, body: str) -> None:
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.body = body
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}{endpoint}: {what}: {body[:2000]}")


class EngineSetError(EngineError):
    """Some engines of an `EngineSet` failed a call sent to all; `errors` maps URL -> error."""

    def __init__(self, endpoint: str, errors: dict[str, EngineError], num_engines: int) -> None:
        self.errors = errors
        summary = "; ".join(str(error) for error in errors.values())
        super().__init__(
            ",".join(errors), endpoint, None, f"{len(errors)} of {num_engines} engines: {summary}"
        )


class FinishReason(msgspec.Struct, frozen=True, kw_only=True):
    """Why generation ended: `type` is stop | length | abort; `matched` is the stop token id
    or string, `length` the token budget, `message` the abort reason."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """One sample. `logprobs` and `versions` have one entry per output token
    (`logprobs` is empty without `return_logprob`)."""

    rid: str
    text: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    versions_exact: bool
    weight_version: int
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    meta: dict[str, Any]

    @property
    def is_aborted(self) -> bool:
        return self.finish_reason.type == "abort"


def parse_version(version: str | int | None) -> int:
    """An engine's weight_version string as an integer: "default" (or None) -> 0, "12" -> 12."""
    if version is None or version == "default":
        return 0
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    if isinstance(version, str) and version.isdigit():
        return int(version)
    raise ValueError(f"weight_version {version!r} is neither 'default' nor an integer")


def parse_result(payload: dict) -> GenerateResult:
    """One `/generate` response object -> `GenerateResult`."""
    meta = payload.get("meta_info", {})
    output_ids = list(payload.get("output_ids") or [])
    num_tokens = len(output_ids)
    final_version = parse_version(meta.get("weight_version"))
    spans = meta.get("weight_versions")
    if spans:
        versions = [0] * num_tokens
        covered = 0
        for span in spans:
            start, end = int(span["start"]), int(span["end"])
            versions[start:end] = [parse_version(span["version"])] * (end - start)
            covered += end - start
        if covered != num_tokens:
            raise ValueError(f"weight_versions spans cover {covered} of {num_tokens} tokens")
        exact = True
    else:
        versions = [final_version] * num_tokens
        exact = num_tokens == 0
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    finish = meta.get("finish_reason") or {"type": "unknown"}
    if isinstance(finish, str):  # some servers send a bare string
        finish = {"type": finish}
    return GenerateResult(
        rid=str(meta.get("id", "")),
        text=payload.get("text", ""),
        output_ids=output_ids,
        logprobs=logprobs,
        versions=versions,
        versions_exact=exact,
        weight_version=final_version,
        finish_reason=FinishReason(
            type=str(finish.get("type")),
            matched=finish.get("matched"),
            length=finish.get("length"),
            message=finish.get("message"),
        ),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        meta=meta,
    )


class EngineClient:
    """Async client of one SGLang-protocol server. Use as `async with`, or call `aclose()`."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
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
    ) -> GenerateResult:
        """Generate one sample for one prompt (`sampling_params["n"]` must be 1)."""
        if (sampling_params or {}).get("n", 1) not in (1, None):
            raise ValueError("generate() makes one sample; use generate_many() for n > 1")
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        payload = await self._json("POST", "/generate", body)
        if isinstance(payload, list):
            payload = payload[0]
        return parse_result(payload)

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict | None = None,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateResult]:
        """One batched call; with `n` > 1 the results are prompt-major (n per prompt).

        sglang-router 0.3.2 refuses a list `rid` (422): pass `rids` only to engines."""
        body: dict[str, Any] = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            body["rid"] = list(rids)
        payload = await self._json("POST", "/generate", body)
        payloads = payload if isinstance(payload, list) else [payload]
        return [parse_result(item) for item in payloads]

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
        """Pause generation: `abort` | `retract` | `in_place` (keeps the KV cache)."""
        return await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._json("POST", "/continue_generation", {})

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
        timeout_s: float = 600.0,
    ) -> dict:
        """Blocks until the engine has received every broadcast and loaded the tensors.

        `dtypes` may be torch dtypes or names ("bfloat16", "torch.bfloat16");
        `load_format = "flattened_bucket"`: the tensors come as one flat broadcast."""
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
        return await self._json(
            "POST", "/update_weights_from_distributed", body, timeout_s=timeout_s
        )

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | int | None = None
    ) -> dict:
        body = {
            "model_path": model_path,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        return await self._json("POST", "/update_weights_from_disk", body)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float = 600.0,
    ) -> dict:
        """Weights by reference, for an engine on the caller's own device: one entry per engine
        GPU, each from `streamrl.engine.tensor_ipc.serialize_named_tensors`."""
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": None,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        return await self._json("POST", "/update_weights_from_tensor", body, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        return await self._json("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def load(self) -> dict:
        """The embedded engine's `/get_load` entry (running, waiting, paused requests)."""
        return (await self._json("GET", "/get_load"))[0]


def _affinity(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class EngineSet:
    """All engines of a run; `router_url` (optional) serves `/generate`."""

    def __init__(
        self, engine_urls: Sequence[str], *, router_url: str | None = None, timeout_s: float = 600.0
    ) -> None:
        if not engine_urls:
            raise ValueError("an EngineSet needs at least one engine URL")
        self.engines = [EngineClient(url, timeout_s=timeout_s) for url in engine_urls]
        self.router = EngineClient(router_url, timeout_s=timeout_s) if router_url else None
        self._down: set[str] = set()
        self._round_robin = itertools.count()

    async def __aenter__(self) -> EngineSet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in [*self.engines, *([self.router] if self.router else [])]:
            await client.aclose()

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def mark_down(self, url: str) -> None:
        """Skip this engine for sessions and round-robin until `mark_up`."""
        self._down.add(url.rstrip("/"))

    def mark_up(self, url: str) -> None:
        """Use this engine again."""
        self._down.discard(url.rstrip("/"))

    def _up(self) -> list[EngineClient]:
        up = [engine for engine in self.engines if engine.url not in self._down]
        if not up:
            raise EngineError(",".join(self.urls), "", None, "every engine is marked down")
        return up

    def session(self, key: str) -> EngineClient:
        """The engine for `key`: the same one on every call while it is up (its KV prefix
        stays warm across turns); only keys of an engine marked down move."""
        return max(self._up(), key=lambda engine: _affinity(key, engine.url))

    def generator(self) -> EngineClient:
        """Where a stateless `/generate` goes: the router, else the next engine (round-robin)."""
        if self.router is not None:
            return self.router
        up = self._up()
        return up[next(self._round_robin) % len(up)]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """One sample through `generator()` (router or round-robin)."""
        return await self.generator().generate(
            input_ids, sampling_params, rid=rid, return_logprob=return_logprob
        )

    async def each(
        self, call: Callable[[EngineClient], Awaitable[T]], *, what: str = "call"
    ) -> list[T]:
        """Run `call` on every engine concurrently; results in engine order.

        Raises `EngineSetError` naming every engine that failed (after all finished)."""
        results: list[Any] = [None] * len(self.engines)
        errors: dict[str, EngineError] = {}

        async def one(index: int, engine: EngineClient) -> None:
            try:
                results[index] = await call(engine)
            except EngineError as exc:
                errors[engine.url] = exc

        async with anyio.create_task_group() as group:
            for index, engine in enumerate(self.engines):
                group.start_soon(one, index, engine)
        if errors:
            raise EngineSetError(what, errors, len(self.engines))
        return results

    async def pause(self, mode: str = "abort") -> None:
        await self.each(lambda engine: engine.pause(mode), what="pause")

    async def continue_generation(self) -> None:
        await self.each(lambda engine: engine.continue_generation(), what="continue_generation")

    async def abort_all(self) -> None:
        await self.each(lambda engine: engine.abort(abort_all=True), what="abort_all")

    async def flush_cache(self) -> list[bool]:
        return await self.each(lambda engine: engine.flush_cache(), what="flush_cache")

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """Each engine joins with one rank per GPU, from 1 + the GPUs of the engines before
        it (`streamrl.engine.layout`, GPU counts from each `/server_info`); the trainer must
        join as rank 0 concurrently (`weight_sync.init_weight_update_group`)."""
        from streamrl.engine.layout import engine_gpu_counts, weight_group_layout

        layout = weight_group_layout(await engine_gpu_counts(self.engines))
        await self.each(
            lambda engine: engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=layout.rank_offsets[self.engines.index(engine)],
                world_size=layout.world_size,
                group_name=group_name,
                backend=backend,
            ),
            what="init_weights_update_group",
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        weight_version: str | int | None,
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Every engine receives the same broadcasts; the trainer broadcasts concurrently."""
        await self.each(
            lambda engine: engine.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=group_name,
                weight_version=weight_version,
                flush_cache=flush_cache,
                abort_all_requests=abort_all_requests,
                load_format=load_format,
            ),
            what="update_weights_from_distributed",
        )

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        await self.each(
            lambda engine: engine.destroy_weights_update_group(group_name),
            what="destroy_weights_update_group",
        )
