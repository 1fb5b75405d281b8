"""`streamrl engine serve`: SGLang's native HTTP protocol in front of `EngineCore`.

The subset and its field names follow SGLang 0.5.x (see docs/engine.md); the
choices where SGLang leaves room:

- `meta_info.weight_versions` is always present: spans `{version, start, end}`
  over output tokens, `end` exclusive, covering every output token in order
  (empty when there are no output tokens). `meta_info.weight_version` is the
  version of the last output token (the engine's version when there is none).
- `n` > 1 expands every prompt into n samples, prompt-major (all samples of
  prompt 0, then prompt 1, ...); the response is then a list. Sample j gets rid
  `"{rid}-{j}"` and, with `sampling_seed` s, seed s + j (so samples differ).
- `/abort_request {rid}` aborts that rid and its n-expansion samples (`rid-j`).
- While paused, new `/generate` calls wait in the server until
  `/continue_generation` (an abort ends the wait with an empty abort result).
- Weight-group calls run in a worker thread: the event loop keeps serving and
  the core keeps generating while the trainer's broadcast arrives; only the
  in-place copy (`EngineCore.update_weights`) happens at a step boundary.
- Unknown `sampling_params` keys are a 400 (as SGLang 0.5.23); unknown
  top-level keys are ignored (sglang-router adds `model`, `return_bytes`, ...).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
HEALTH_GENERATE_TIMEOUT_S = 20.0

NonNegativeInt = Annotated[int, Meta(ge=0)]


class SamplingBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`sampling_params` of `/generate`, SGLang 0.5.x names and defaults; null = default.

    Unknown keys are refused (SGLang 0.5.23 answers 400 too)."""

    max_new_tokens: NonNegativeInt | None = 128
    temperature: Annotated[float, Meta(ge=0)] | None = 1.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = 1.0
    top_k: int | None = -1  # -1 = whole vocabulary, else >= 1
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = 0.0
    min_new_tokens: NonNegativeInt | None = 0
    n: Annotated[int, Meta(ge=1)] | None = 1  # samples per prompt
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    sampling_seed: int | None = None
    # Accepted and ignored (one warning per key when not neutral).
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict | None = None
    stream_interval: int | None = None
    custom_params: Any = None
    # Known to SGLang but changing what is sampled: refused unless null.
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None


_SAMPLING_DEFAULTS = dict(
    zip(SamplingBody.__struct_fields__, SamplingBody.__struct_defaults__, strict=True)
)
_IGNORED_PARAMS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
_IGNORED_PARAMS += ("stream_interval", "custom_params")
_UNSUPPORTED_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
_TEXT_FLAGS = ("n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class BadRequest(Exception):
    """A client error: answered with 400 and `{"error": {"message": ...}}`."""


def _json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def _error(message: str, status: int = 400) -> web.Response:
    return _json_response({"error": {"message": message}}, status)


def _weight_result(success: bool, message: str) -> web.Response:
    return _json_response({"success": success, "message": message}, 200 if success else 400)


async def _read_json(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body


def version_spans(versions: list[str]) -> list[dict]:
    """Per-token versions -> `[{version, start, end}]`, `end` exclusive, in token order."""
    spans: list[dict] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


@dataclass
class _GenerateCall:
    """One parsed `/generate` body: per-sample prompts, rids and sampling params."""

    prompts: list[list[int]]
    rids: list[str]
    params: list[Any]  # core SamplingParams, one per sample
    is_single: bool
    return_logprob: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool


@dataclass
class _Flight:
    """A request the server holds: waiting at the pause gate or inside the core."""

    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    is_in_core: bool = False


class EngineServer:
    """The aiohttp application around one `EngineCore` (built by `load`)."""

    def __init__(self, core_kwargs: dict, server_args: dict) -> None:
        self._core_kwargs = core_kwargs
        self._server_args = server_args
        self.core = None
        self.is_ready = False
        self.is_closing = False
        self._gate = asyncio.Event()  # set while not paused
        self._gate.set()
        self._flights: dict[str, _Flight] = {}
        self._weight_lock = asyncio.Lock()
        self._groups: dict[str, tuple[Any, str]] = {}  # group_name -> (group, backend)
        self._joining: set[str] = set()
        self._warned_keys: set[str] = set()
        self.num_finished_reqs = 0  # samples answered by /generate since start
        self.is_receiving_weights = False  # inside update_weights_from_distributed's receive
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------
    async def load(self) -> None:
        """Build and start the core in a worker thread; /health turns 200 after."""
        from streamrl.engine.core import EngineCore

        kwargs = dict(self._core_kwargs)
        self.core = await asyncio.to_thread(lambda: EngineCore(kwargs.pop("model_path"), **kwargs))
        self.core.start()
        self.is_ready = True

    async def close(self) -> None:
        """Refuse new work; calls held by a pause and requests in the core end as aborts."""
        self.is_closing = True
        for flight in self._flights.values():
            flight.aborted.set()
        self._gate.set()
        if self.core is not None:
            # Aborts everything queued or running (partial outputs), then stops the thread.
            await asyncio.to_thread(self.core.shutdown)

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._errors])
        get = [
            ("/health", self.health),
            ("/health_generate", self.health_generate),
            ("/model_info", self.model_info),
            ("/get_model_info", self.model_info),
            ("/server_info", self.server_info),
            ("/get_server_info", self.server_info),
            ("/get_load", self.get_load),
        ]
        post = [
            ("/generate", self.generate),
            ("/flush_cache", self.flush_cache),
            ("/abort_request", self.abort_request),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
            ("/init_weights_update_group", self.init_weights_update_group),
            ("/update_weights_from_distributed", self.update_weights_from_distributed),
            ("/update_weights_from_disk", self.update_weights_from_disk),
            ("/update_weights_from_tensor", self.update_weights_from_tensor),
            ("/destroy_weights_update_group", self.destroy_weights_update_group),
        ]
        for path, handler in get:
            app.router.add_get(path, handler)
        for path, handler in post:
            app.router.add_post(path, handler)
        # SGLang answers both verbs on these.
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_post("/health_generate", self.health_generate)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        if not self.is_ready and request.path not in ("/health", "/health_generate"):
            return _error("the engine is still loading", 503)
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return _error(f"{type(exc).__name__}: {exc}", 500)

    # ---- health and info -------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.is_ready or self.is_closing:
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """A one-token generation; while paused it reports healthy without generating, and
        while busy a decode step completing is the proof of health (as SGLang does: a full
        batch would make the probe wait for a free slot, not for a hung engine)."""
        if not self.is_ready or self.is_closing:
            return web.Response(status=503)
        if self.core.is_paused:
            return web.Response(status=200)
        if self.core.num_running > 0:
            return web.Response(status=200 if await self._makes_progress() else 503)
        from streamrl.engine.core import Request, SamplingParams

        tokenizer = self.core.tokenizer
        token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
        probe = Request(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=[token],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(self.core.generate([probe]), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _makes_progress(self) -> bool:
        """True once the core completes a decode step within the health timeout. The counter
        lives in the engine thread, so this samples it (every 50 ms) rather than awaiting it."""
        loop = asyncio.get_running_loop()
        start = self.core.stats["decode_steps"]
        deadline = loop.time() + HEALTH_GENERATE_TIMEOUT_S
        while loop.time() < deadline:
            await asyncio.sleep(0.05)
            if self.core.stats["decode_steps"] != start or self.core.num_running == 0:
                return True
        return False

    def _model_info(self) -> dict:
        info = dict(self.core.model_info)
        info.setdefault("model_path", self._core_kwargs["model_path"])
        info.setdefault("tokenizer_path", self._core_kwargs["model_path"])
        info.setdefault("is_generation", True)
        info["weight_version"] = self.core.weight_version
        # update_weights_from_disk changes the path the weights came from.
        info["model_path"] = self._server_args.get("model_path", info["model_path"])
        return info

    async def model_info(self, request: web.Request) -> web.Response:
        return _json_response(self._model_info())

    def _load(self) -> dict:
        num_gated = sum(not flight.is_in_core for flight in self._flights.values())
        return {
            "dp_rank": 0,
            "num_reqs": self.core.num_running + self.core.num_waiting + num_gated,
            "num_running_reqs": self.core.num_running,
            "num_waiting_reqs": self.core.num_waiting,
            "num_paused_reqs": num_gated,
            "num_finished_reqs": self.num_finished_reqs,
            "is_receiving_weights": self.is_receiving_weights,
            "is_paused": self.core.is_paused,
            "weight_version": self.core.weight_version,
            # streamrl additions (not in SGLang): the engine's busy clock for benchmarks.
            "busy_s": self.core.busy_s,
            "uptime_s": self.core.uptime_s,
            "generated_tokens": self.core.scheduler.stats["generated_tokens"],
        }

    async def server_info(self, request: web.Request) -> web.Response:
        import streamrl

        info = dict(self._server_args)
        info.update(
            {
                "tp_size": 1,
                "dp_size": 1,
                "device": str(self.core.device),
                "weight_version": self.core.weight_version,
                "version": f"streamrl-{getattr(streamrl, '__version__', '0')}",
                "internal_states": [self._load()],
            }
        )
        return _json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        return _json_response([self._load()])

    # ---- generation ------------------------------------------------------
    def _sampling_params(self, raw: Any, num_prompts: int) -> tuple[list[dict], dict]:
        """Validate `sampling_params` (a dict, or one per prompt) -> per-prompt core kwargs and
        the flags that must agree across a batch (n and the text options)."""
        raws = raw if isinstance(raw, list) else [raw] * num_prompts
        if len(raws) != num_prompts:
            raise BadRequest(f"{len(raws)} sampling_params for {num_prompts} prompts")
        parsed = [self._one_sampling_params(item or {}) for item in raws]
        flags = [{key: values.pop(key) for key in _TEXT_FLAGS} for values in parsed]
        if any(f != flags[0] for f in flags):
            raise BadRequest("n and the text options must agree across a batch")
        for values in parsed:
            for key in (*_IGNORED_PARAMS, *_UNSUPPORTED_PARAMS):
                values.pop(key)
            values["seed"] = values.pop("sampling_seed")
            values["stop"] = (
                (values["stop"],)
                if isinstance(values["stop"], str)
                else tuple(values["stop"] or ())
            )
            values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
        return parsed, flags[0]

    def _one_sampling_params(self, raw: Any) -> dict:
        try:
            body = msgspec.convert(raw, SamplingBody)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"sampling_params: {exc}") from None
        values = {
            key: _SAMPLING_DEFAULTS[key] if value is None else value
            for key, value in msgspec.structs.asdict(body).items()
        }
        if values["top_k"] == 0 or values["top_k"] < -1:
            raise BadRequest("sampling_params.top_k must be -1 (whole vocabulary) or >= 1")
        for key in _UNSUPPORTED_PARAMS:
            if values[key] is not None:
                raise BadRequest(f"sampling_params.{key} is not supported by the embedded engine")
        for key in _IGNORED_PARAMS:
            if values[key] != _SAMPLING_DEFAULTS[key] and key not in self._warned_keys:
                self._warned_keys.add(key)
                logger.warning("sampling param %s=%r is accepted but ignored", key, values[key])
        return values

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise BadRequest("input_ids must be a non-empty list")
            is_single = not isinstance(ids[0], list)
            prompts = [ids] if is_single else ids
        elif body.get("text") is not None:
            text = body["text"]
            is_single = isinstance(text, str)
            texts = [text] if is_single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings")
            prompts = [self.core.tokenizer.encode(t) for t in texts]
        else:
            raise BadRequest("either text or input_ids must be given")
        for prompt in prompts:
            if not isinstance(prompt, list) or not prompt:
                raise BadRequest("every prompt must be a non-empty list of token ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("input_ids must hold integers")
        return prompts, is_single

    def _parse_generate(self, body: dict) -> _GenerateCall:
        from streamrl.engine.core import SamplingParams

        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine")
        prompts, is_single = self._prompts(body)
        per_prompt, flags = self._sampling_params(body.get("sampling_params"), len(prompts))
        rid = body.get("rid")
        if rid is None:
            base_rids = [uuid.uuid4().hex for _ in prompts]
        elif isinstance(rid, str) and is_single:
            base_rids = [rid]
        elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
            base_rids = rid
        else:
            raise BadRequest("rid must be a string (one prompt) or a list of strings (a batch)")
        if len(base_rids) != len(prompts):
            raise BadRequest(f"{len(base_rids)} rids for {len(prompts)} prompts")
        num_samples = flags["n"]
        call = _GenerateCall(
            prompts=[],
            rids=[],
            params=[],
            is_single=is_single and num_samples == 1,
            return_logprob=bool(body.get("return_logprob", False)),
            skip_special_tokens=flags["skip_special_tokens"],
            spaces_between_special_tokens=flags["spaces_between_special_tokens"],
            no_stop_trim=flags["no_stop_trim"],
        )
        for prompt, base_rid, kwargs in zip(prompts, base_rids, per_prompt, strict=True):
            for j in range(num_samples):
                sample = dict(kwargs)
                if num_samples > 1 and sample["seed"] is not None:
                    sample["seed"] += j
                call.prompts.append(prompt)
                call.rids.append(base_rid if num_samples == 1 else f"{base_rid}-{j}")
                try:
                    call.params.append(SamplingParams(**sample))
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None
        duplicates = [r for r in call.rids if r in self._flights]
        if duplicates or len(set(call.rids)) != len(call.rids):
            raise BadRequest(f"duplicate request id(s) in flight: {duplicates or call.rids}")
        return call

    async def generate(self, request: web.Request) -> web.Response:
        from streamrl.engine.core import Request

        start = time.perf_counter()
        if self.is_closing:
            return _error("the engine is shutting down", 503)
        call = self._parse_generate(await _read_json(request))
        flights = {rid: _Flight() for rid in call.rids}
        self._flights.update(flights)
        try:
            await self._wait_for_gate(flights)
            to_run = [
                Request(rid=rid, input_ids=prompt, params=params)
                for rid, prompt, params in zip(call.rids, call.prompts, call.params, strict=True)
                if not flights[rid].aborted.is_set()
            ]
            for request_ in to_run:
                flights[request_.rid].is_in_core = True
            try:
                ran = await self.core.generate(to_run) if to_run else []
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        finally:
            for rid in call.rids:
                self._flights.pop(rid, None)
        by_rid = {output.rid: output for output in ran}
        outputs = [
            by_rid.get(rid) or _aborted_before_start(rid, len(prompt))
            for rid, prompt in zip(call.rids, call.prompts, strict=True)
        ]
        self.num_finished_reqs += len(outputs)
        latency_s = time.perf_counter() - start
        results = [self._result(call, output, latency_s) for output in outputs]
        return _json_response(results[0] if call.is_single else results)

    async def _wait_for_gate(self, flights: dict[str, _Flight]) -> None:
        """Wait while paused, or until every request of the call is aborted."""
        while not self._gate.is_set() and not all(f.aborted.is_set() for f in flights.values()):
            waits = [asyncio.ensure_future(self._gate.wait())]
            waits += [asyncio.ensure_future(f.aborted.wait()) for f in flights.values()]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    def _result(self, call: _GenerateCall, output: Any, latency_s: float) -> dict:
        output_ids = list(output.output_ids)
        finish = dict(output.finish_reason)
        matched = finish.get("matched")
        text_ids = output_ids
        if finish.get("type") == "stop" and isinstance(matched, int) and not call.no_stop_trim:
            text_ids = output_ids[:-1]
        text = self.core.tokenizer.decode(
            text_ids,
            skip_special_tokens=call.skip_special_tokens,
            spaces_between_special_tokens=call.spaces_between_special_tokens,
        )
        if isinstance(matched, str) and matched and not call.no_stop_trim:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        versions = list(output.versions)
        meta = {
            "id": output.rid,
            "finish_reason": finish,
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": output.cached_tokens,
            "weight_version": versions[-1] if versions else self.core.weight_version,
            "weight_versions": version_spans(versions),
            "e2e_latency": latency_s,
        }
        if call.return_logprob:
            meta["output_token_logprobs"] = [
                [float(lp), int(t), None] for lp, t in zip(output.logprobs, output_ids, strict=True)
            ]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    # ---- control ---------------------------------------------------------
    def _abort(self, rid: str | None) -> None:
        """Abort one rid (and its `rid-j` samples) or, with None, everything."""
        for flight_rid, flight in list(self._flights.items()):
            if rid is None or flight_rid == rid or flight_rid.startswith(f"{rid}-"):
                flight.aborted.set()
                if rid is not None and flight.is_in_core:
                    self.core.abort(flight_rid)
        if rid is None:
            self.core.abort(None)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        if body.get("abort_all"):
            self._abort(None)
        elif body.get("rid"):
            self._abort(str(body["rid"]))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.core.flush_cache():
            return web.Response(status=200, text="Cache flushed.")
        return web.Response(status=400, text="Cache not flushed: requests are running.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _read_json(request)).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self._gate.clear()
        await self.core.pause(mode)
        return _json_response({"message": f"Generation paused ({mode}).", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.core.resume()
        self._gate.set()
        return _json_response({"message": "Generation continued.", "status": "ok"})

    # ---- weights ---------------------------------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from streamrl.engine.weight_sync import DEFAULT_GROUP_NAME, join_in_daemon_thread

        body = await _read_json(request)
        missing = [k for k in ("master_address", "master_port", "world_size") if k not in body]
        if missing:
            return _weight_result(False, f"missing fields: {', '.join(missing)}")
        group_name = body.get("group_name") or DEFAULT_GROUP_NAME
        backend = body.get("backend") or "nccl"
        async with self._weight_lock:
            if group_name in self._groups or group_name in self._joining:
                return _weight_result(False, f"weight-update group {group_name!r} already exists")
            self._joining.add(group_name)
        # Joined outside the lock: a join whose trainer gave up (a member died before it
        # joined) blocks until the rendezvous times out, and must not hold up the next group.
        try:
            group = await join_in_daemon_thread(
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank=int(body.get("rank_offset", 1)),
                world_size=int(body["world_size"]),
                group_name=group_name,
                backend=backend,
            )
        except Exception as exc:
            logger.exception("init_weights_update_group failed")
            return _weight_result(False, f"failed to join {group_name!r}: {exc}")
        finally:
            self._joining.discard(group_name)
        async with self._weight_lock:
            self._groups[group_name] = (group, backend)
        return _weight_result(True, f"joined weight-update group {group_name!r}")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        from streamrl.engine.weight_sync import (
            DEFAULT_GROUP_NAME,
            FLATTENED_BUCKET,
            receive_tensors,
        )

        body = await _read_json(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if (
            not isinstance(names, list)
            or not isinstance(dtypes, list)
            or not isinstance(shapes, list)
        ):
            return _weight_result(False, "names, dtypes and shapes must be lists")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", FLATTENED_BUCKET):
            return _weight_result(False, f"load_format {load_format!r} is not supported")
        group_name = body.get("group_name") or DEFAULT_GROUP_NAME
        async with self._weight_lock:
            if group_name not in self._groups:
                return _weight_result(False, f"no weight-update group {group_name!r}")
            group, backend = self._groups[group_name]
            if body.get("abort_all_requests"):
                self._abort(None)
            device = self.core.device if backend == "nccl" else "cpu"
            self.is_receiving_weights = True
            try:
                tensors = await asyncio.to_thread(
                    receive_tensors, group, names, dtypes, shapes, device, load_format
                )
            except Exception as exc:
                logger.exception("receiving weights failed")
                return _weight_result(False, f"receiving weights failed: {exc}")
            finally:
                self.is_receiving_weights = False
            return await self._apply(tensors, body, f"{len(tensors)} tensors over {group_name!r}")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        model_path = body.get("model_path")
        if not model_path:
            return _weight_result(False, "model_path is required")
        async with self._weight_lock:
            if body.get("abort_all_requests"):
                self._abort(None)
            try:
                tensors = await asyncio.to_thread(_load_safetensors, Path(model_path))
            except Exception as exc:
                return _weight_result(False, f"loading {model_path} failed: {exc}")
            result = await self._apply(tensors, body, f"{len(tensors)} tensors from {model_path}")
            if result.status == 200:
                self._server_args["model_path"] = str(model_path)
            return result

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Tensors handed over by reference (CUDA IPC or shared memory; see
        `streamrl.engine.tensor_ipc`): entry 0 of `serialized_named_tensors` (one GPU)."""
        from streamrl.engine.tensor_ipc import deserialize_named_tensors

        body = await _read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            return _weight_result(False, "serialized_named_tensors must be a non-empty list")
        if body.get("load_format") not in (None, "auto"):
            return _weight_result(False, f"load_format {body['load_format']!r} is not supported")
        async with self._weight_lock:
            if body.get("abort_all_requests"):
                self._abort(None)
            try:
                tensors = await asyncio.to_thread(deserialize_named_tensors, entries[0])
            except Exception as exc:
                logger.exception("update_weights_from_tensor: bad payload")
                return _weight_result(False, f"could not load serialized_named_tensors: {exc}")
            try:
                return await self._apply(tensors, body, f"{len(tensors)} tensors by reference")
            finally:
                del tensors  # release the sender's memory once copied

    async def _apply(self, tensors: list, body: dict, what: str) -> web.Response:
        version = body.get("weight_version")
        version = self.core.weight_version if version is None else str(version)
        try:
            await self.core.update_weights(tensors, version)
        except Exception as exc:
            logger.exception("update_weights failed")
            return _weight_result(False, f"loading weights failed: {exc}")
        if body.get("flush_cache", True) and not self.core.flush_cache():
            logger.info("cache not flushed after the update: requests are running")
        logger.info("weights updated (%s); weight_version=%s", what, version)
        return _weight_result(True, f"updated {what}; weight_version={version}")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from streamrl.engine.weight_sync import DEFAULT_GROUP_NAME, destroy_weight_update_group

        group_name = (await _read_json(request)).get("group_name") or DEFAULT_GROUP_NAME
        async with self._weight_lock:
            entry = self._groups.pop(group_name, None)
            if entry is None:
                return _weight_result(False, f"no weight-update group {group_name!r}")
            await asyncio.to_thread(destroy_weight_update_group, entry[0])
        return _weight_result(True, f"destroyed weight-update group {group_name!r}")


def _aborted_before_start(rid: str, num_prompt_tokens: int) -> Any:
    from streamrl.engine.core import Output

    return Output(
        rid=rid,
        output_ids=[],
        logprobs=[],
        versions=[],
        finish_reason={"type": "abort", "message": "aborted before it started"},
        prompt_tokens=num_prompt_tokens,
        cached_tokens=0,
    )


def _load_safetensors(model_dir: Path) -> list:
    """Every tensor of every `*.safetensors` file under `model_dir`, by its HF name."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else [model_dir]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    tensors = []
    for path in files:
        tensors.extend(load_file(str(path)).items())
    return tensors


class _DropHttp2Probe(logging.Filter):
    """sglang-router first probes workers with an HTTP/2 preface; aiohttp logs a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


def serve_command(args) -> int:
    """Entry point of `streamrl engine serve`: serve until SIGTERM/SIGINT, then exit 0."""
    return asyncio.run(_serve(args))


async def _serve(args) -> int:
    core_kwargs = {
        "model_path": args.model,
        "tokenizer_path": args.tokenizer,
        "device": args.device,
        "dtype": args.dtype,
        "max_batch_size": args.max_batch_size,
        "max_seq_len": args.max_seq_len,
        "runner": args.runner,
        "cuda_graphs": args.cuda_graphs,
        "seed": args.seed,
        "weight_version": args.weight_version,
        "num_threads": args.num_threads,
        "compile_elementwise": {"auto": None, "on": True, "off": False}[args.compile],
    }
    server_args = {
        key: value
        for key, value in vars(args).items()
        if isinstance(value, str | int | float | bool) and key not in ("entry",)
    }
    server_args["model_path"] = args.model
    server_args["tokenizer_path"] = args.tokenizer or args.model
    server = EngineServer(core_kwargs, server_args)
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    exit_code = 0
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        logger.error("loading the engine failed", exc_info=load.exception())
        exit_code = 1
    elif load.done():
        logger.info("engine ready at http://%s:%d (model %s)", args.host, args.port, args.model)
        await stopping
    else:
        load.cancel()
    logger.info("shutting down")
    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the shutdown
        loop.remove_signal_handler(signum)
        signal.signal(signum, signal.SIG_IGN)
    await server.close()
    await runner.cleanup()
    return exit_code
