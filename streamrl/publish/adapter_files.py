"""LoRA adapters to SGLang engines as files (`learner.lora` with `engine.backend = "sglang"`).

SGLang (0.5.x) serves adapters beside its base weights: started with `--enable-lora`
(`--max-lora-rank`, `--lora-target-modules`, and `--lora-paths NAME=DIR` for adapters to
load at once), it takes `POST /load_lora_adapter {lora_name, lora_path}` and
`POST /unload_lora_adapter {lora_name}`, and a `/generate` body's `lora_path` names the
adapter a request runs with. So a LoRA run's publisher does not broadcast tensors to
SGLang engines; `AdapterFileTransport` brings them each version's adapters as files:

    prepare  write the staged adapters in peft's format to <directory>/v<version>/
    (the publisher pauses every engine)
    send     every engine: /load_lora_adapter streamrl-v<version>
                           ─► /update_weight_version <version>
    (the publisher continues every engine)
    settle   every engine: /unload_lora_adapter streamrl-v<version - 2>
             (and its directory is deleted)

The previous version's adapter stays loaded one more version: a rollout request sent
before the rollout process heard of the new version still finds its adapter. Requests
name the adapter of the newest version the rollout process has heard of (`adapter_name`
of the stream's credit version; version 0 is the base model, no adapter), and the client
tags every token of such a response with that version: the adapter named is exactly the
weights that produced it (`EngineClient.generate`).

The adapter files are written with lora_alpha = rank (scaling 1) and lora_B already
scaled, as the wire carries it: the same product, without a rescaling round trip. The
directory must be readable by every engine (on another machine: shared storage).

Checked against SGLang's HTTP server source and docs only; no SGLang ran here (docs/lora.md).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import torch

from streamrl.fleet.client import EngineClient, EngineError, adapter_name
from streamrl.fleet.engine_set import each_engine
from streamrl.publish.transport import Staged, WeightTransport
from streamrl.weights import adapters

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2
"""Adapters loaded per engine: the newest and the one before (see the module docstring)."""


@dataclass
class AdapterFileTransport(WeightTransport):
    """Brings each version's adapters to SGLang engines as a peft directory (see the
    module docstring); `rank` and `target_modules` describe the adapters of the run."""

    directory: Path
    rank: int
    target_modules: tuple[str, ...]
    base_model: str = ""
    loaded: dict[str, list[int]] = field(default_factory=dict)
    """Engine URL -> versions whose adapters were loaded there, oldest first."""
    pushed: set[int] = field(default_factory=set)
    """Versions loaded before (loading one again is a resync)."""
    _path: Path | None = None
    """The directory of the update in progress."""

    def write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """Wire tensors (lora_B scaled) as the peft directory of `version`."""
        spec = adapters.AdapterSpec(
            rank=self.rank,
            alpha=float(self.rank),  # scaling 1: lora_B arrives scaled
            dropout=0.0,
            target_modules=self.target_modules,
            base_model=self.base_model,
        )
        peft = {adapters.PEFT_PREFIX + name: tensor for name, tensor in tensors}
        return adapters.write_peft_adapter(self.directory / f"v{version}", peft, spec)

    async def prepare(self, engines: list[EngineClient], staged: Staged) -> None:
        """The staged adapters written as `staged.version`'s peft directory."""
        if adapter_name(staged.version) is None:
            raise ValueError("version 0 is the base model: it has no adapter")
        tensors = [
            pair
            for bucket in staged.buckets
            for pair in zip(bucket.names, bucket.layout.unpack(bucket.flat), strict=True)
        ]
        self._path = await anyio.to_thread.run_sync(self.write, staged.version, tensors)

    async def send(self, engines: list[EngineClient], staged: Staged, *, flush_cache: bool) -> None:
        """Every engine loads the directory as the version's adapter and tags the version."""
        name, path = adapter_name(staged.version), self._path
        await each_engine(
            engines,
            lambda engine: self._load(engine, name, path, staged.version),
            what="load_lora_adapter",
        )

    async def settle(self, engines: list[EngineClient], staged: Staged) -> None:
        """Unload (and delete) what is older than `KEEP_VERSIONS` versions."""
        self.pushed.add(staged.version)
        await each_engine(engines, self._unload_old, what="unload_lora_adapter")
        self._delete_unused()

    async def _load(self, engine: EngineClient, name: str, path: Path, version: int) -> None:
        if version in self.pushed:  # a resync (an engine restarted): the others hold it
            with contextlib.suppress(EngineError):  # the restarted engine does not
                await engine.unload_lora_adapter(name)
            versions = self.loaded.get(engine.url, [])
            if version in versions:
                versions.remove(version)
        result = await engine.load_lora_adapter(name, str(path))
        if not result.get("success", False):
            raise RuntimeError(f"{engine.url}: loading {name}: {result.get('error_message')}")
        await engine.update_weight_version(version)
        self.loaded.setdefault(engine.url, []).append(version)

    async def _unload_old(self, engine: EngineClient) -> None:
        versions = self.loaded.get(engine.url, [])
        while len(versions) > KEEP_VERSIONS:
            old = versions.pop(0)
            try:
                await engine.unload_lora_adapter(adapter_name(old))
            except EngineError as exc:  # a restarted engine never had it
                log.info("%s: %s was not loaded (%s)", engine.url, adapter_name(old), exc.status)

    def _delete_unused(self) -> None:
        """Directories of versions no engine holds any more."""
        kept = {v for versions in self.loaded.values() for v in versions}
        newest = max(kept, default=0)
        for path in self.directory.glob("v*"):
            version = int(path.name[1:]) if path.name[1:].isdigit() else None
            if version is not None and version not in kept and version < newest:
                shutil.rmtree(path, ignore_errors=True)
