"""`streamrl bench engine`: the embedded engine against SGLang, on SGLang's own protocol.

The load: N requests sent at once through HTTP `/generate`, one prompt
per call (as the rollout worker sends them), each `--prompt-tokens` random token
ids asking for `--max-new-tokens` tokens at temperature 1 with `ignore_eos` and
`return_logprob`. The model is a random `--shape` saved by
`streamrl.models.save_random_model` (SmolLM2's tokenizer), or `--model DIR`.

Engines, one after the other on the same device (each started, waited for on
`/health`, measured at every count of `--requests`, stopped); `auto`
runs embedded, sglang, in-process, and records an engine it leaves out, with why,
under `skipped`:

- `embedded`: `streamrl engine serve` (its flags: `--max-batch-size` the largest
  count, `--max-seq-len` prompt + new tokens + 64, then `--embedded-args`);
- `in-process`: the same `EngineOptions` as an `EngineCore` in this process, all N
  requests in one `await generate(...)`: the rate the HTTP path is compared with;
- `sglang`: `python -m sglang.launch_server` with `--sglang-args` (auto: only
  when `import sglang` can find the package).

Per (engine, count): `--warmup-rounds` unmeasured rounds of the same load (every
length and batch size the measured rounds pass through: CUDA graphs, kernels and
caches are ready), then `--repeats` measured rounds, fresh prompts each (no prefix
cache can help). A count's tokens/s is the median of its rounds, reported with their
min, max and spread, and `steady`: the first measured round within 5% of the last
(a warm-up that fell short shows as a first round slower than the rest). Per round: tokens/s = completion tokens of all N responses / wall time
from the first send to the last answer; time to first token from
`--ttft-probes` of the N requests (spread over the send order) that stream
(server-sent events; TTFT = client time from send to the first event holding
an output token; the rest do not stream, so the load stays the non-streaming
one; in-process, the same requests' first-token callbacks on this process's event
loop); GPU busy share over the window (`streamrl.bench.gpu_monitor`, absent on
CPU); for the embedded engine its own busy clock and counters (`/get_load`:
`engine_busy_share`, plotted in place of GPU busy when no GPU is seen, and the
round's generated tokens, decode steps, prefills and busy milliseconds per decode
step). The HTTP engines' requests go from this process, or with
`--client-processes N` from N client processes that deal them out
(`streamrl.bench.load.ClientProcesses`), for every HTTP engine alike. One
progress line per phase goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from streamrl.bench.engine_results import (
    plot_engine,
    ratios,
    round_line,
    summarise,
    summary_lines,
)
from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.bench.load import (
    ClientProcesses,
    http_session,
    measure_http,
    measure_in_process,
    prompts_for,
)
from streamrl.bench.results import write_result

ENGINES = ("embedded", "sglang", "in-process")
"""`auto`'s order: in-process last, as its device memory is this process's own."""
SEQ_LEN_MARGIN = 64
"""KV room per sequence beyond prompt + new tokens (the embedded engine's --max-seq-len)."""


def progress(message: str) -> None:
    print(f"[bench engine {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def engine_command(args: argparse.Namespace) -> int:
    counts = [int(part) for part in args.requests.split(",") if part.strip()]
    if not counts or min(counts) <= 0:
        print(
            f"error: --requests must list positive counts, got {args.requests!r}", file=sys.stderr
        )
        return 2
    if args.client_processes < 1:
        print(f"error: --client-processes must be 1 or more, got {args.client_processes}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        engines, skipped = _engines(args.engines)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, why in skipped.items():
        progress(f"[{name}] skipped: {why}")
    work_dir = Path(args.work_dir).resolve()
    model = args.model or str(_random_model(args.shape, work_dir))
    args.vocab_size = _vocab_size(model)
    result: dict[str, Any] = {"model": model, "engines": {}, "skipped": skipped}
    with GpuMonitor() as gpus:
        for name in engines:
            progress(f"[{name}] start")
            try:
                result["engines"][name] = _bench_one(name, model, counts, args, work_dir, gpus)
            except Exception as exc:  # one engine failing leaves the others' figures
                progress(f"[{name}] failed: {type(exc).__name__}: {exc}")
                result["engines"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            if args.json:
                _write(args, counts, result)
    result["ratios"] = ratios(result["engines"], counts)
    for line in summary_lines(result, counts):
        print(line)
    if args.json:
        _write(args, counts, result)
    failed = [name for name, row in result["engines"].items() if "error" in row]
    return 1 if failed else 0


def _engines(spec: str) -> tuple[list[str], dict[str, str]]:
    """The engines to run, and those `auto` leaves out with why."""
    from streamrl.fleet.sglang import sglang_available

    no_sglang = f"`import sglang` finds no package in {sys.executable}"
    if spec == "auto":
        if sglang_available():
            return list(ENGINES), {}
        return [name for name in ENGINES if name != "sglang"], {"sglang": no_sglang}
    names = [part.strip() for part in spec.split(",") if part.strip()]
    unknown = [name for name in names if name not in ENGINES]
    if unknown or not names:
        raise ValueError(f"--engines: unknown {unknown}; use auto or some of {list(ENGINES)}")
    if "sglang" in names and not sglang_available():
        raise ValueError(f"--engines names sglang, but {no_sglang}")
    return names, {}


def _random_model(shape: str, work_dir: Path) -> Path:
    """`work_dir/model-SHAPE`, written once (seed 0) and reused by later runs."""
    from streamrl.models import save_random_model

    out = work_dir / f"model-{shape}"
    done = out / ".complete"
    if not done.exists():
        progress(f"writing random {shape} weights to {out}")
        save_random_model(shape, out, seed=0)
        done.touch()
    return out


def _vocab_size(model: str) -> int:
    from streamrl.models import model_config

    return int(model_config(model).vocab_size)


def embedded_options(model: str, counts: list[int], args: argparse.Namespace):
    """The `EngineOptions` both embedded variants run with: the bench's defaults, then
    `--embedded-args` (any `streamrl engine serve` flag) on top."""
    from streamrl.engine.options import EngineOptions

    parser = argparse.ArgumentParser(prog="--embedded-args", add_help=False)
    EngineOptions.add_arguments(parser)
    argv = ["--model", model, "--device", args.device, "--dtype", args.dtype]
    argv += ["--max-batch-size", str(max(counts))]
    argv += ["--max-seq-len", str(args.prompt_tokens + args.max_new_tokens + SEQ_LEN_MARGIN)]
    argv += shlex.split(args.embedded_args)
    return EngineOptions.from_namespace(parser.parse_args(argv))


def _bench_one(name, model, counts, args, work_dir: Path, gpus: GpuMonitor) -> dict[str, Any]:
    started = time.monotonic()
    if name == "in-process":
        return asyncio.run(_in_process(model, counts, args, gpus, started))
    with _server(name, model, counts, args, work_dir) as (url, argv):
        row = {"start_s": round(time.monotonic() - started, 1), "url": url, "argv": argv}
        progress(f"[{name}] ready after {row['start_s']} s")
        row.update(asyncio.run(_over_http(name, url, counts, args, gpus)))
    return row


@contextmanager
def _server(name, model, counts, args, work_dir: Path) -> Iterator[tuple[str, list[str]]]:
    from streamrl.process import free_port, spawn, streamrl_argv, wait_http_ready

    port = free_port()
    if name == "embedded":
        options = embedded_options(model, counts, args)
        argv = streamrl_argv("engine", "serve", *options.to_argv(), "--port", str(port))
    else:
        argv = sglang_argv(model, port, max(counts), args)
    log_path = work_dir / f"{name}.log"
    log_path.unlink(missing_ok=True)
    progress(f"[{name}] {shlex.join(argv)} (log {log_path})")
    process = spawn(f"bench-{name}", argv, log_path=log_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, timeout_s=args.start_timeout_s, process=process)
        yield url, argv
    finally:
        process.stop(timeout_s=30)


def sglang_argv(model: str, port: int, max_requests: int, args: argparse.Namespace) -> list[str]:
    """`python -m sglang.launch_server` for the bench: ServerArgs flag names, then
    `--sglang-args` (later flags win in SGLang's argparse)."""
    dtype = args.dtype if args.dtype != "auto" else "bfloat16"
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--random-seed", "0"]
    argv += ["--max-running-requests", str(max_requests)]
    return argv + shlex.split(args.sglang_args)


async def _over_http(name, url, counts, args, gpus: GpuMonitor) -> dict[str, Any]:
    async def one_round(prompts: list[list[int]], probes: int) -> dict[str, Any]:
        before = await _load(url)
        t0 = time.monotonic()
        if clients is not None:
            measured = await clients.measure(
                url, prompts, max_new_tokens=args.max_new_tokens, num_probes=probes
            )
        else:
            measured = await measure_http(
                url, prompts, max_new_tokens=args.max_new_tokens, num_probes=probes,
                session=session,
            )  # fmt: skip
        measured["gpu_busy"] = gpus.busy(t0, time.monotonic())
        after = await _load(url)
        if before is not None and after is not None:
            measured.update(_engine_counters(before, after, measured["wall_s"]))
        return measured

    # One client session (or set of client processes) for the warm-up and every round, as a
    # rollout worker keeps its own.
    async with http_session() as session:
        with _clients(args.client_processes) as clients, _frozen():
            rows = {str(count): await _rounds(name, count, one_round, args) for count in counts}
    return {"counts": rows, "client_processes": args.client_processes}


def _engine_counters(before: dict, after: dict, wall_s: float) -> dict[str, Any]:
    """The embedded engine's own account of a round (`/get_load` before and after it): its
    busy share of the wall time, the tokens it generated, and its decode steps and prefills
    (with the mean busy time per decode step, when it counts them). The busy clock adds a
    step when it ends, and the step that answers a round's last request ends just after the
    answer: it counts in the next round, so a share may pass 1 by about one step's time."""
    counters = {
        "engine_busy_share": (after["busy_s"] - before["busy_s"]) / wall_s,
        "engine_generated_tokens": after["generated_tokens"] - before["generated_tokens"],
    }
    for key in ("decode_steps", "prefills"):
        if key in before and key in after:
            counters[f"engine_{key}"] = after[key] - before[key]
    if counters.get("engine_decode_steps"):
        counters["engine_busy_ms_per_step"] = (
            1e3 * (after["busy_s"] - before["busy_s"]) / counters["engine_decode_steps"]
        )
    return counters


def _core_counters(core) -> dict[str, Any]:
    """An in-process `EngineCore`'s counters, as `/get_load` reports the served engine's."""
    stats = core.scheduler.stats
    return {
        "busy_s": core.busy_s,
        "generated_tokens": stats["generated_tokens"],
        "decode_steps": stats["decode_steps"],
        "prefills": stats["prefills"],
    }


@contextlib.contextmanager
def _clients(count: int):
    """`ClientProcesses` for `--client-processes` above 1; None (this process sends) for 1."""
    if count <= 1:
        yield None
        return
    with ClientProcesses(count) as clients:
        yield clients


@contextlib.contextmanager
def _frozen():
    """This process's objects out of the garbage collector's reach while it measures, as
    `streamrl engine serve` does once loaded: each round's answers make enough objects to
    start full collections, and each walked torch's and transformers' (~100 ms on the CI
    machine) while requests waited to be sent or read, for the HTTP engines alone."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _rounds(name: str, count: int, one_round, args: argparse.Namespace) -> dict[str, Any]:
    """`--warmup-rounds` rounds of `count` requests (every length and batch size the measured
    rounds go through, so CUDA graphs, kernels and caches are ready), then `--repeats`
    measured rounds, summarised (`summarise`: median, spread, and whether the first measured
    round is within `STEADY_TOLERANCE` of the last)."""
    for index in range(args.warmup_rounds):
        measured = await one_round(_warmup_prompts(count, index, args), 0)
        progress(f"[{name}] {count} requests, warm-up {index + 1}: {round_line(measured)}")
    rounds = []
    for repeat in range(args.repeats):
        measured = await one_round(_round_prompts(count, repeat, args), args.ttft_probes)
        rounds.append(measured)
        progress(f"[{name}] {count} requests, round {repeat + 1}: {round_line(measured)}")
    summary = summarise(rounds)
    if not summary["steady"]:
        progress(
            f"[{name}] {count} requests: not steady: the first round ran at "
            f"{summary['first_over_last']:.2f}x the last (more --warmup-rounds?)"
        )
    return summary


async def _load(url: str) -> dict | None:
    """The embedded engine's busy clock and token counter; None for servers without them."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{url}/get_load")
    if response.status_code != 200:
        return None
    body = response.json()
    load = body[0] if isinstance(body, list) and body else body
    if not isinstance(load, dict) or "busy_s" not in load or "generated_tokens" not in load:
        return None
    return load


async def _in_process(model, counts, args, gpus: GpuMonitor, started: float) -> dict[str, Any]:
    from streamrl.engine.core import EngineCore

    options = embedded_options(model, counts, args)
    core = await asyncio.to_thread(EngineCore, options)
    row: dict[str, Any] = {"options": options.to_argv(), "counts": {}}
    with _frozen():  # after loading: no full collection walks the model either
        core.start()
        row["start_s"] = round(time.monotonic() - started, 1)
        progress(f"[in-process] ready after {row['start_s']} s")

        async def one_round(prompts: list[list[int]], probes: int, engine=core) -> dict[str, Any]:
            before = _core_counters(engine)
            t0 = time.monotonic()
            measured = await measure_in_process(
                engine, prompts, max_new_tokens=args.max_new_tokens, num_probes=probes
            )
            measured["gpu_busy"] = gpus.busy(t0, time.monotonic())
            measured.update(_engine_counters(before, _core_counters(engine), measured["wall_s"]))
            return measured

        try:
            for count in counts:
                row["counts"][str(count)] = await _rounds("in-process", count, one_round, args)
        finally:
            core.shutdown()
            del core, one_round  # the engine's device memory goes back before the next engine
    _free_device_memory()
    return row


def _warmup_prompts(count: int, index: int, args: argparse.Namespace) -> list[list[int]]:
    """Warm-up `index`'s prompts: of the measured rounds' shape, never measured."""
    return prompts_for(
        count, args.prompt_tokens, seed=1000 * count + 500 + index, vocab_size=args.vocab_size
    )


def _round_prompts(count: int, repeat: int, args: argparse.Namespace) -> list[list[int]]:
    """Round `repeat`'s `count` prompts: fresh ones every round, the same for every engine."""
    return prompts_for(
        count, args.prompt_tokens, seed=1000 * count + repeat + 2, vocab_size=args.vocab_size
    )


def _free_device_memory() -> None:
    """Give the in-process engine's cached device memory back (a server started after it
    sizes its KV cache from what is free)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write(args: argparse.Namespace, counts: list[int], result: dict[str, Any]) -> None:
    import torch  # noqa: F401 - machine_info reports the GPUs torch sees

    config = {
        key: getattr(args, key)
        for key in (
            "shape", "model", "engines", "device", "dtype", "prompt_tokens", "max_new_tokens",
            "ttft_probes", "client_processes", "repeats", "warmup_rounds", "embedded_args",
            "sglang_args",
        )
    }  # fmt: skip
    config["requests"] = counts
    write_result(
        args.json, bench="engine", config=config, result=result, plot=plot_engine, num_panels=3
    )
