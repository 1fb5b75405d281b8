"""Whether a paused SGLang engine answers the fleet's health probe (issue 27's colocated run).

Starts one SGLang server with the command and environment the fleet gives it
(`streamrl.fleet.sglang.sglang_argv_factory`, the config's engine section, colocated so that
`--enable-memory-saver` is on), waits for `/health`, then pauses it as the colocated handoff
does (`/pause_generation` with `abort`, `/release_memory_occupation`) and asks `/health`
and `/health_generate`, each with a 5 s limit; then resumes it and asks again. Prints one
JSON line per probe and exits 1 when the paused engine's `/health` did not answer 200.

    python3 bench/gpu/paused_health.py CONFIG --model DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx

from streamrl.config import load_config
from streamrl.fleet.client import EngineClient
from streamrl.fleet.sglang import sglang_argv_factory
from streamrl.process import free_port

PROBE_S = 5.0


async def probe(url: str, endpoint: str) -> dict:
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=PROBE_S) as http:
            status = (await http.get(f"{url}{endpoint}")).status_code
    except httpx.TimeoutException:
        status = None
    return {"endpoint": endpoint, "status": status, "seconds": time.perf_counter() - started}


async def run(url: str, process: subprocess.Popen, startup_s: float) -> list[dict]:
    deadline = time.monotonic() + startup_s
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"SGLang exited with {process.returncode} before serving")
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"SGLang did not answer /health within {startup_s} s")
            await anyio.sleep(1.0)
    results = []
    async with EngineClient(url) as engine:
        for phase in ("serving", "paused", "resumed"):
            if phase == "paused":
                await engine.pause("abort")
                await engine.release_memory_occupation()
            if phase == "resumed":
                await engine.resume_memory_occupation()
                await engine.continue_generation()
            for endpoint in ("/health", "/health_generate"):
                results.append({"phase": phase, **await probe(url, endpoint)})
                print(json.dumps(results[-1]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, default=Path("/tmp/paused_health_sglang.log"))
    parser.add_argument("--startup-s", type=float, default=300.0)
    args = parser.parse_args()
    overrides = [
        f'model.path="{args.model}"', 'train.mode="sync"', "cluster.colocate=true"
    ]  # fmt: skip
    cfg = load_config(args.config, overrides)
    port = free_port()
    argv, env = sglang_argv_factory(cfg, args.model, 0)(0, "127.0.0.1", port)
    print("env:", json.dumps(env), flush=True)
    with args.log.open("w") as log:
        process = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            results = anyio.run(run, f"http://127.0.0.1:{port}", process, args.startup_s)
        finally:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "probes": results}, indent=1))
    paused = next(r for r in results if r["phase"] == "paused" and r["endpoint"] == "/health")
    return 0 if paused["status"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
