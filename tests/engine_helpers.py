"""Shared helpers for tests that start `streamrl engine serve` processes."""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from streamrl.process import (
    ChildProcess,
    ProcessDied,
    free_port,
    spawn,
    streamrl_argv,
    wait_http_ready,
)

ENGINE_START_TIMEOUT_S = 120.0


@dataclass
class EngineProcess:
    url: str
    process: ChildProcess
    model_dir: str


@contextlib.contextmanager
def running_engines(
    model_dir: str, log_dir: Path, count: int = 1, extra_args: Sequence[str] = ()
) -> Iterator[list[EngineProcess]]:
    """Start `count` engines on free ports (in parallel), yield them once all answer /health,
    and stop them afterwards, checking that each exits cleanly (code 0)."""
    engines = []
    try:
        for _ in range(count):
            port = free_port()
            argv = streamrl_argv(
                "engine", "serve", "--model", model_dir, "--port", str(port),
                "--num-threads", "1", *extra_args,
            )  # fmt: skip

            process = spawn(f"engine-{port}", argv, log_path=log_dir / f"engine-{port}.log")
            engines.append(EngineProcess(f"http://127.0.0.1:{port}", process, model_dir))
        for engine in engines:
            wait_http_ready(engine.url, timeout_s=ENGINE_START_TIMEOUT_S, process=engine.process)
        yield engines
    finally:
        for engine in engines:  # all at once: they shut down in parallel
            engine.process.signal(signal.SIGTERM)
        codes = {engine.url: engine.process.stop(timeout_s=30) for engine in engines}
    unclean = {url: code for url, code in codes.items() if code != 0}
    assert not unclean, f"engines did not exit cleanly: {unclean}"


class SharedEngine:
    """One embedded engine that many tests use in turn (the `tiny_engine` fixture), put back
    after each test as it started: generation running, no request in flight, the served
    checkpoint and weight version it started with. An engine that cannot be put back (dead,
    or a request that will not end) is replaced by a new one on the same port, and the test
    that left it so gets an error."""

    def __init__(self, model_dir: str, log_dir: Path, extra_args: Sequence[str] = ()) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_starts = 0
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.process = self._start()
        self.weight_version = self._model_info()["weight_version"]

    def _start(self) -> ChildProcess:
        self.num_starts += 1
        argv = streamrl_argv(
            "engine", "serve", "--model", self.model_dir, "--port", str(self.port),
            "--num-threads", "1", *self.extra_args,
        )  # fmt: skip
        log_path = self.log_dir / f"engine-{self.port}-{self.num_starts}.log"
        process = spawn(f"engine-{self.port}", argv, log_path=log_path)
        wait_http_ready(self.url, timeout_s=ENGINE_START_TIMEOUT_S, process=process)
        return process

    def _model_info(self) -> dict:
        return self.http.get("/get_model_info").json()

    def _load(self) -> dict:
        return self.http.get("/get_load").json()[0]

    def _post(self, path: str, body: dict) -> httpx.Response:
        response = self.http.post(path, json=body)
        response.raise_for_status()
        return response

    def _put_back(self) -> None:
        self._post("/continue_generation", {})
        self._post("/abort_request", {"rid": "", "abort_all": True})
        wait_until(
            lambda: (load := self._load())["num_reqs"] == 0 and not load["is_receiving_weights"],
            what="the shared engine idle",
        )
        released = self._load()["memory_released"]
        if released:  # a memory handoff left half done: resumed weights need loading
            self._post("/resume_memory_occupation", {"tags": released})
        info = self._model_info()
        if released or (info["model_path"], info["weight_version"]) != (
            self.model_dir,
            self.weight_version,
        ):
            body = {"model_path": self.model_dir, "weight_version": self.weight_version}
            assert self._post("/update_weights_from_disk", body).json()["success"] is True
        load, info = self._load(), self._model_info()
        assert not load["is_paused"] and load["num_reqs"] == 0, load
        assert info["model_path"] == self.model_dir, info
        assert info["weight_version"] == self.weight_version, info

    def put_back(self) -> None:
        """Leave the engine as it started, or start a new one and raise."""
        try:
            if not self.process.is_alive():
                raise ProcessDied(f"the shared engine exited with {self.process.poll()}")
            self._put_back()
        except (AssertionError, httpx.HTTPError, ProcessDied, TimeoutError) as error:
            self.process.kill()
            self.process = self._start()
            raise RuntimeError(
                f"the test left the shared engine broken ({error!r}); it was replaced"
            ) from error

    def stop(self) -> None:
        """Stop the engine, checking that it exits cleanly (code 0)."""
        # One SIGTERM only: a second one that lands after the engine's event loop has closed
        # would end it with -15.
        code = self.process.stop(timeout_s=30)
        self.http.close()
        assert code == 0, f"the shared engine exited with {code}; see {self.process.log_path}"


def wait_until(predicate, *, what: str, timeout_s: float = 30.0) -> None:
    """Poll `predicate()` with a growing interval until it is true (a readiness wait)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not true after {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


async def joined_update_group(engines, group_name: str):
    """This process as rank 0 of a gloo weight-update group `group_name` that every engine of
    the EngineSet `engines` joins (one rank each); returns the process group."""
    import anyio

    from streamrl.weights.group import init_weight_update_group

    port = free_port()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            lambda: engines.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, group_name=group_name, backend="gloo"
            )
        )
        return await anyio.to_thread.run_sync(
            lambda: init_weight_update_group(
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=1 + len(engines.engines),
                group_name=group_name,
                backend="gloo",
                timeout_s=60,
            )
        )


@functools.cache
def polling_client() -> httpx.Client:
    """One HTTP client for the tests' polling loops, kept for the session: building a client
    (its TLS context) costs ~35 ms of CPU, more than the request it would send."""
    return httpx.Client(timeout=10)


def engine_load(url: str) -> dict:
    """The embedded engine's request counts (`/get_load`)."""
    return polling_client().get(f"{url}/get_load").json()[0]


def teacher_forced_logprobs(
    model_dir: str,
    prompt: Sequence[int],
    output_ids: Sequence[int],
    state_dict: dict | None = None,
) -> list[float]:
    """log p(output_ids[i] | prompt + output_ids[:i]) under the fp32 CPU HF model."""
    import torch

    from streamrl.models import load_causal_lm

    model = load_causal_lm(model_dir, device="cpu", dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    positions = torch.arange(start, start + len(output_ids))
    return logprobs[positions, torch.tensor(list(output_ids))].tolist()
