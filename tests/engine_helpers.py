"""Shared helpers for tests that start `streamrl engine serve` processes."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from streamrl.process import ChildProcess, free_port, spawn, streamrl_argv, wait_http_ready

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


def engine_load(url: str) -> dict:
    """The embedded engine's request counts (`/get_load`)."""
    return httpx.get(f"{url}/get_load", timeout=10).json()[0]


def teacher_forced_logprobs(
    model_dir: str,
    prompt: Sequence[int],
    output_ids: Sequence[int],
    state_dict: dict | None = None,
) -> list[float]:
    """log p(output_ids[i] | prompt + output_ids[:i]) under the fp32 CPU HF model."""
    import torch

    from streamrl.models import load_model

    model, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    positions = torch.arange(start, start + len(output_ids))
    return logprobs[positions, torch.tensor(list(output_ids))].tolist()
