"""The embedded engine's weight endpoints: SGLang's weight-update protocol.

    /init_weights_update_group        join a named group (the trainer is rank 0)
    /update_weights_from_distributed  receive one call's tensors over it, then load them
    /update_weights_from_tensor       tensors handed over by reference (CUDA IPC, or shared
                                      memory on the CPU: `streamrl.weights.ipc`)
    /update_weights_from_disk         a safetensors directory
    /destroy_weights_update_group
    /load_staged_weights              streamrl's own: load what `stage` calls left staged

With `weights_digest` in an update's body (streamrl's publisher sends it to embedded
engines; SGLang has no such field) the received tensors are digested first
(`streamrl.weights.digest`) and, on a mismatch, nothing is loaded: HTTP 400 with
`digest_mismatch: true`, and the publisher sends the bucket again.

Staged updates (streamrl's publisher, by reference only): an `/update_weights_from_tensor`
whose body names a `stage` maps the tensors, checks their digest and every name and shape,
and keeps the planned copy without loading anything, while the engine generates on. The
buckets of one update share its `stage`; staging a new one drops an older one. Then
`/load_staged_weights` with that `stage` copies all of them in at one step boundary and
answers `engine_pause_s`, the time generation stood still: the copy alone, with no
`pause_generation` around it, and `engine_wait_s`, the wait for that step boundary. A
staged call answers `timings`: the seconds it waited for the weight lock, mapped the
tensors, laid the bucket out, digested it and planned the copy; and `kept`: whether the
bucket was one kept from the last update (below), laid out and planned then.

Once loaded, a staged update's buckets stay mapped (`_KeptBuckets`), with their layout and
planned copy. The publisher stages every version in the same buffers, so the next update's
handles name memory that is mapped already: torch finds the mapping open instead of opening
it again, and a bucket laid out as before reuses its views and plan. They are let go when a
staged call maps any other bucket, when weights arrive by another route, and when the engine
stops; until then an engine that outlives its learner keeps the learner's last buffers mapped.

Group calls run in worker threads: the event loop keeps serving and the core
keeps generating while the trainer's broadcast arrives; only the in-place copy
(`EngineCore.update_weights`) happens at a step boundary. A join runs outside
the weight lock, in a daemon thread: a join whose trainer gave up blocks until
its rendezvous times out and must not hold up the next group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from streamrl.engine.core import EngineCore
from streamrl.engine.protocol import json_response, read_json
from streamrl.weights.digest import digest
from streamrl.weights.group import (
    DEFAULT_GROUP_NAME,
    FLATTENED_BUCKET,
    FlatLayout,
    destroy_weight_update_group,
    join_in_daemon_thread,
    receive_tensors,
    torch_dtype,
)
from streamrl.weights.ipc import deserialize_named_tensors

logger = logging.getLogger(__name__)


def _weight_result(success: bool, message: str) -> web.Response:
    return json_response({"success": success, "message": message}, 200 if success else 400)


class WeightEndpoints:
    """The weight routes of one engine server; `abort_all` ends every request (for the
    `abort_all_requests` flag), `on_loaded_from_disk(path)` records a new model path."""

    def __init__(
        self,
        core: Callable[[], EngineCore],
        *,
        abort_all: Callable[[], None],
        on_loaded_from_disk: Callable[[str], None],
    ) -> None:
        self._core = core
        self._abort_all = abort_all
        self._on_loaded_from_disk = on_loaded_from_disk
        self._lock = asyncio.Lock()
        self._groups: dict[str, tuple[Any, str]] = {}  # group_name -> (group, backend)
        self._joining: set[str] = set()
        self.is_receiving = False
        """Inside update_weights_from_distributed's receive (reported by /get_load)."""
        self._side_stream = None  # created on first use, on the engine's GPU
        self._stage: str | None = None
        self._staged: list[_StagedBucket] = []
        self._kept = _KeptBuckets()

    @property
    def core(self) -> EngineCore:
        return self._core()

    def routes(self) -> list[tuple[str, Callable]]:
        """(path, handler) of every POST route."""
        return [
            ("/init_weights_update_group", self.init_weights_update_group),
            ("/update_weights_from_distributed", self.update_weights_from_distributed),
            ("/update_weights_from_disk", self.update_weights_from_disk),
            ("/update_weights_from_tensor", self.update_weights_from_tensor),
            ("/destroy_weights_update_group", self.destroy_weights_update_group),
            ("/load_staged_weights", self.load_staged_weights),
        ]

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        missing = [k for k in ("master_address", "master_port", "world_size") if k not in body]
        if missing:
            return _weight_result(False, f"missing fields: {', '.join(missing)}")
        group_name = body.get("group_name") or DEFAULT_GROUP_NAME
        backend = body.get("backend") or "nccl"
        async with self._lock:
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
        async with self._lock:
            self._groups[group_name] = (group, backend)
        return _weight_result(True, f"joined weight-update group {group_name!r}")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
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
        async with self._lock:
            if group_name not in self._groups:
                return _weight_result(False, f"no weight-update group {group_name!r}")
            group, backend = self._groups[group_name]
            if body.get("abort_all_requests"):
                self._abort_all()
            device = self.core.device if backend == "nccl" else "cpu"
            self._kept.clear()
            self.is_receiving = True
            try:
                tensors = await asyncio.to_thread(
                    receive_tensors, group, names, dtypes, shapes, device, load_format
                )
            except Exception as exc:
                logger.exception("receiving weights failed")
                return _weight_result(False, f"receiving weights failed: {exc}")
            finally:
                self.is_receiving = False
            return await self._apply(tensors, body, f"{len(tensors)} tensors over {group_name!r}")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model_path = body.get("model_path")
        if not model_path:
            return _weight_result(False, "model_path is required")
        async with self._lock:
            if body.get("abort_all_requests"):
                self._abort_all()
            self._kept.clear()
            try:
                tensors = await asyncio.to_thread(_load_safetensors, Path(model_path))
            except Exception as exc:
                return _weight_result(False, f"loading {model_path} failed: {exc}")
            result = await self._apply(tensors, body, f"{len(tensors)} tensors from {model_path}")
            if result.status == 200:
                self._on_loaded_from_disk(str(model_path))
            return result

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Tensors handed over by reference (CUDA IPC or shared memory; see
        `streamrl.weights.ipc`): entry 0 of `serialized_named_tensors` (one GPU). With
        `load_format = "flattened_bucket"` (streamrl's publisher), entry 0 holds one uint8
        tensor, the bucket's bytes, which `names`, `dtypes` and `shapes` lay out as
        `update_weights_from_distributed`'s do: one handle to map, not one per tensor. With
        a `stage`, checked and kept for `/load_staged_weights` instead of loaded."""
        body = await read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            return _weight_result(False, "serialized_named_tensors must be a non-empty list")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", FLATTENED_BUCKET):
            return _weight_result(False, f"load_format {load_format!r} is not supported")
        stage = body.get("stage")
        timings = _Timings()
        async with self._lock:
            timings.lap("lock_s")
            if body.get("abort_all_requests"):
                self._abort_all()
            if stage is None:
                self._kept.clear()  # weights by another route: the next staging maps afresh
            kept = None
            try:
                tensors = await asyncio.to_thread(self._on_side_stream, _mapped, entries[0])
                timings.lap("map_s")
                if load_format == FLATTENED_BUCKET:
                    key = _bucket_key(tensors, body)
                    if stage is not None and key is not None:
                        kept = self._kept.find(key)
                    if kept is None:
                        kept = _StagedBucket(_unflatten(tensors, body), key=key)
                    tensors = kept.tensors
                timings.lap("unflatten_s")
            except Exception as exc:
                logger.exception("update_weights_from_tensor: bad payload")
                return _weight_result(False, f"could not load serialized_named_tensors: {exc}")
            try:
                if stage is not None:
                    staged = kept if kept is not None else _StagedBucket(tensors)
                    return await self._keep_staged(str(stage), staged, body, timings)
                return await self._apply(tensors, body, f"{len(tensors)} tensors by reference")
            finally:
                del tensors, kept  # release the sender's memory once copied (or staged)

    async def _keep_staged(
        self, stage: str, staged: _StagedBucket, body: dict, timings: _Timings
    ) -> web.Response:
        """Check the tensors (digest, names, shapes) and keep their planned copy under `stage`
        (a kept bucket's plan is checked already); the answer's `timings` say where the
        call's time went (the publisher's `weights/staging/*` metrics)."""
        if not self._kept.holds(staged):
            self._kept.clear()  # another sender's or another layout's buffers: let them go
        refused = await self._digest_refusal(staged.tensors, body, f"stage {stage}")
        if refused is not None:
            return refused
        timings.lap("digest_s")
        kept = staged.plan is not None
        if not kept:
            try:
                staged.plan = self.core.runner.plan_weights(staged.tensors)
            except ValueError as exc:
                return _weight_result(False, f"loading weights failed: {exc}")
        timings.lap("plan_s")
        if stage != self._stage:
            self._stage, self._staged = stage, []
        self._staged.append(staged)
        message = f"staged {len(staged.tensors)} tensors by reference as {stage!r}"
        answer = {"success": True, "message": message, "timings": timings.laps, "kept": kept}
        return json_response(answer)

    async def load_staged_weights(self, request: web.Request) -> web.Response:
        """Load every call staged under `stage` at one step boundary (see the module docstring)."""
        body = await read_json(request)
        stage = body.get("stage")
        async with self._lock:
            if stage is None or str(stage) != self._stage:
                return _weight_result(False, f"nothing is staged as {stage!r}")
            staged, self._stage, self._staged = self._staged, None, []
            version = body.get("weight_version")
            version = self.core.weight_version if version is None else str(version)
            plan = [entry for bucket in staged for entry in bucket.plan]
            try:
                pause_s, wait_s = await self.core.load_planned(plan, version)
            except Exception as exc:
                logger.exception("load_staged_weights failed")
                return _weight_result(False, f"loading weights failed: {exc}")
            finally:
                del plan
            self._kept.keep(staged)
            del staged
            self._after_load(body)
            what = f"stage {stage}"
            logger.info(
                "weights updated (%s) in %.1f ms; weight_version=%s", what, pause_s * 1e3, version
            )
            return json_response(
                {
                    "success": True,
                    "message": f"updated {what}; weight_version={version}",
                    "engine_pause_s": pause_s,
                    "engine_wait_s": wait_s,
                }
            )

    async def _apply(self, tensors: list, body: dict, what: str) -> web.Response:
        version = body.get("weight_version")
        version = self.core.weight_version if version is None else str(version)
        refused = await self._digest_refusal(tensors, body, what)
        if refused is not None:
            return refused
        try:
            await self.core.update_weights(tensors, version)
        except Exception as exc:
            logger.exception("update_weights failed")
            return _weight_result(False, f"loading weights failed: {exc}")
        self._after_load(body)
        logger.info("weights updated (%s); weight_version=%s", what, version)
        return _weight_result(True, f"updated {what}; weight_version={version}")

    def _on_side_stream(self, function: Callable, *args):
        """`function(*args)` on a CUDA stream of the weight endpoints' own (in a worker thread):
        mapping the sender's buffers and digesting them neither queue behind nor wait for the
        decode steps the engine thread has queued on its stream."""
        device = self.core.device
        if device.type != "cuda":
            return function(*args)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._side_stream):
            return function(*args)

    async def _digest_refusal(self, tensors: list, body: dict, what: str) -> web.Response | None:
        """The 400 answer when the body's `weights_digest` (streamrl's publisher) does not
        match the received bytes; None when it matches or none was sent."""
        expected = body.get("weights_digest")
        if not expected:
            return None
        received = await asyncio.to_thread(
            self._on_side_stream, digest, [tensor for _, tensor in tensors]
        )
        if received == expected:
            return None
        logger.error("weights digest mismatch (%s): %s != %s", what, received, expected)
        return json_response(
            {
                "success": False,
                "message": f"weights digest mismatch: received {received}, "
                f"expected {expected}; nothing loaded",
                "digest_mismatch": True,
            },
            400,
        )

    def _after_load(self, body: dict) -> None:
        if body.get("flush_cache", True) and not self.core.flush_cache():
            logger.info("cache not flushed after the update: requests are running")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        group_name = (await read_json(request)).get("group_name") or DEFAULT_GROUP_NAME
        async with self._lock:
            entry = self._groups.pop(group_name, None)
            if entry is None:
                return _weight_result(False, f"no weight-update group {group_name!r}")
            await asyncio.to_thread(destroy_weight_update_group, entry[0])
        return _weight_result(True, f"destroyed weight-update group {group_name!r}")


@dataclass
class _StagedBucket:
    """One staged call's named tensors (mapped from the sender) and their planned copy."""

    tensors: list
    key: tuple | None = None
    """A flattened bucket's memory and layout (`_bucket_key`); None for other payloads."""
    plan: list | None = None


class _KeptBuckets:
    """The buckets of the last staged update that loaded, still mapped, by `_bucket_key`
    (see the module docstring). Only plain copies are kept: a plan that merges LoRA
    adapters changes what it reads on every load."""

    def __init__(self) -> None:
        self._buckets: dict[tuple, _StagedBucket] = {}

    def find(self, key: tuple) -> _StagedBucket | None:
        return self._buckets.get(key)

    def holds(self, bucket: _StagedBucket) -> bool:
        """Whether `bucket` is one kept here (or nothing is kept, so nothing is to let go)."""
        return not self._buckets or self._buckets.get(bucket.key) is bucket

    def keep(self, buckets: list[_StagedBucket]) -> None:
        plain = [b for b in buckets if b.key and all(isinstance(e, tuple) for e in b.plan or [])]
        self._buckets = {bucket.key: bucket for bucket in plain}

    def clear(self) -> None:
        self._buckets = {}


def _bucket_key(received: list, body: dict) -> tuple | None:
    """What makes a flattened bucket the same as one mapped before: the same memory (address
    and size of its one uint8 tensor) laid out under the same names, dtypes and shapes. None
    for a payload that is not one bucket with its layout (`_unflatten` says what is wrong)."""
    fields = [body.get(field) for field in ("names", "dtypes", "shapes")]
    if len(received) != 1 or not all(isinstance(field, list) for field in fields):
        return None
    names, dtypes, shapes = fields
    if not all(isinstance(shape, list) for shape in shapes):
        return None
    flat = received[0][1]
    layout = (tuple(map(str, names)), tuple(map(str, dtypes)), tuple(map(tuple, shapes)))
    return (str(flat.device), flat.data_ptr(), flat.numel(), *layout)


class _Timings:
    """Seconds between consecutive `lap`s since the call was taken, under each lap's name."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


def _mapped(entry: str) -> list:
    """One `serialized_named_tensors` entry, mapped, with the sender's writes complete: torch
    orders the mapping after the sender's event on the current stream, which is waited
    for here, so another stream (the engine's copy) may read the tensors."""
    tensors = deserialize_named_tensors(entry)
    if any(tensor.is_cuda for _, tensor in tensors):
        torch.cuda.current_stream().synchronize()
    return tensors


def _unflatten(received: list, body: dict) -> list[tuple[str, torch.Tensor]]:
    """A flattened bucket's one uint8 tensor as its named tensors (views where aligned), laid
    out by the body's `names`, `dtypes` and `shapes`. ValueError on a mismatch."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not all(isinstance(field, list) for field in (names, dtypes, shapes)):
        raise ValueError("a flattened bucket needs names, dtypes and shapes lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes differ in length")
    if len(received) != 1 or received[0][1].dtype != torch.uint8:
        raise ValueError("a flattened bucket is one uint8 tensor")
    flat = received[0][1]
    layout = FlatLayout([(tuple(s), torch_dtype(d)) for d, s in zip(dtypes, shapes, strict=True)])
    if flat.numel() != layout.num_bytes:
        raise ValueError(f"the bucket holds {flat.numel()} bytes, its layout {layout.num_bytes}")
    return list(zip(names, layout.unpack(flat), strict=True))


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
