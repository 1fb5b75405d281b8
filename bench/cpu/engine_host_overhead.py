"""What the embedded engine's host side costs when the device is fast: HTTP against in-process.

    python bench/cpu/engine_host_overhead.py --out bench/results/engine_host_overhead_cpu.json

Runs the real `EngineServer` (aiohttp, protocol, `EngineCore`, `Scheduler`) in a
child process and the real load of `streamrl bench engine` against it, but
with a *simulated device*: the runner's decode step takes `--step-ms` of wall
time in which it holds no CPU and no GIL (as a CUDA event wait does), and
prefill `--prefill-us-per-token` per prompt token; tokens are a fixed pattern,
logprobs -1. Every microsecond above the simulated device time is host work:
request parsing, per-request Python, scheduling between steps, detokenisation
and logprob serialisation. The same simulated runner in this process, all
requests in one `EngineCore.generate`, gives the in-process rate to compare with.

The defaults, 3.3 ms per decode step and 1.6 us per prefill token, are estimates
of the Qwen2-0.5B shape at batch 256 on an H200 (issue 21's in-process figure,
70,330 tok/s at 256 x 256 tokens, is 3.6 ms per step with prefill included;
bench/results/gpu/engine_check_h200.json, an older build, has 4.9 ms graph
steps and 3.7 us per prefill token): pass `--step-ms` to match a measurement.
The figures are of this machine's CPU host, not GPU measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


class SimulatedRunner:
    """The `Runner` protocol over a device that only takes time (see the module docstring)."""

    name = "simulated"
    shares_prefill = True

    def __init__(self, *, max_batch_size, max_seq_len, max_prefill_tokens, step_s, prefill_s):
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.step_s, self.prefill_s = step_s, prefill_s
        self.lanes = []
        self.device_free_at = 0.0

    def num_free_slots(self) -> int:
        return self.max_batch_size - len(self.lanes)

    def prefill(self, groups):
        seqs = [seq for group in groups for seq in group]
        for seq in seqs:
            seq.slot = len(self.lanes)
            self.lanes.append(seq)
        # Eager, after the decode step in flight (the scheduler collected it first).
        time.sleep(self.prefill_s * sum(group[0].num_tokens for group in groups))
        self.device_free_at = time.perf_counter()
        return [100 + seq.num_tokens % 7 for seq in seqs], [-1.0] * len(seqs)

    def launch_decode(self):
        from streamrl.engine.runner.base import Pending

        # One stream: a step starts when the one before it is done.
        done_at = max(time.perf_counter(), self.device_free_at) + self.step_s
        self.device_free_at = done_at
        return Pending(seqs=list(self.lanes), handle=done_at)

    def collect(self, pending):
        wait = pending.handle - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the device: no CPU, no GIL
        lanes = len(pending.seqs)
        return [100 + (i % 7) for i in range(lanes)], [-1.0] * lanes

    def release(self, seqs) -> None:
        leaving = {id(seq) for seq in seqs}
        self.lanes = [seq for seq in self.lanes if id(seq) not in leaving]
        for index, seq in enumerate(self.lanes):
            seq.slot = index
        for seq in seqs:
            seq.slot = None

    def reset(self) -> None:
        self.release(list(self.lanes))

    def plan_weights(self, tensors):
        return list(tensors)

    def load_weights(self, plan) -> None:
        pass


def install(step_ms: float, prefill_us: float) -> None:
    """Make `EngineCore` build a `SimulatedRunner` (config and tokenizer stay the model's)."""
    from streamrl import models
    from streamrl.engine import core

    def build_runner(model_path, *, max_batch_size, max_seq_len, max_prefill_tokens, **_):
        runner = SimulatedRunner(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            max_prefill_tokens=max_prefill_tokens, step_s=step_ms / 1e3, prefill_s=prefill_us / 1e6,
        )  # fmt: skip
        return runner, models.model_config(model_path)

    core.build_runner = build_runner


def serve(args) -> None:
    """The child: `streamrl engine serve` itself (its loop, GIL and flags), over the simulated
    runner."""
    from streamrl.engine.options import EngineOptions
    from streamrl.mains.engine import serve_command

    install(args.step_ms, args.prefill_us_per_token)
    parser = argparse.ArgumentParser()
    EngineOptions.add_arguments(parser)
    argv = ["--model", args.model, "--port", str(args.port), "--device", "cpu"]
    argv += ["--max-batch-size", str(max(args.counts))]
    argv += ["--max-seq-len", str(args.prompt_tokens + args.max_new_tokens + 64)]
    sys.exit(serve_command(parser.parse_args(argv)))


async def in_process(args) -> dict:
    from streamrl.bench.load import measure_in_process, prompts_for
    from streamrl.engine.core import EngineCore
    from streamrl.engine.options import EngineOptions

    install(args.step_ms, args.prefill_us_per_token)
    options = EngineOptions(
        model=args.model, max_batch_size=max(args.counts), device="cpu",
        max_seq_len=args.prompt_tokens + args.max_new_tokens + 64,
    )  # fmt: skip
    core = EngineCore(options)
    core.start()
    rows = {}
    try:
        await measure_in_process(core, prompts_for(8, args.prompt_tokens, seed=1), max_new_tokens=2)
        for count in args.counts:
            rounds = []
            for repeat in range(args.repeats):
                prompts = prompts_for(count, args.prompt_tokens, seed=10 * count + repeat)
                steps = core.stats["decode_steps"]
                figures = await measure_in_process(
                    core, prompts, max_new_tokens=args.max_new_tokens
                )
                figures["decode_steps"] = core.stats["decode_steps"] - steps
                rounds.append(figures)
            rows[str(count)] = rounds
    finally:
        core.shutdown()
    return rows


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process `pid`'s threads (Linux): `main` (the event
    loop) and `others` (the engine thread, and the loader thread, idle once loaded)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "main" if task.name == str(pid) else "others"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


async def over_http(args, url: str, pid: int) -> dict:
    import httpx

    from streamrl.bench.load import measure_http, prompts_for

    async def steps() -> int:
        async with httpx.AsyncClient() as client:
            load = (await client.get(f"{url}/get_load")).json()[0]
        return load.get("decode_steps", -1)

    rows = {}
    await measure_http(
        url, prompts_for(8, args.prompt_tokens, seed=1), max_new_tokens=2, num_probes=0
    )
    for count in args.counts:
        rounds = []
        for repeat in range(args.repeats):
            prompts = prompts_for(count, args.prompt_tokens, seed=10 * count + repeat)
            before, cpu_before = await steps(), thread_cpu_s(pid)
            figures = await measure_http(
                url, prompts, max_new_tokens=args.max_new_tokens, num_probes=args.ttft_probes
            )
            figures["decode_steps"] = await steps() - before
            cpu = thread_cpu_s(pid)
            figures["server_cpu_s"] = {
                name: round(cpu[name] - cpu_before.get(name, 0.0), 3) for name in cpu
            }
            rounds.append(figures)
        rows[str(count)] = rounds
    return rows


def summary(rounds: list[dict]) -> dict:
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    median = ordered[(len(ordered) - 1) // 2]
    return {
        "tokens_per_s_median": round(median["tokens_per_s"]),
        "tokens_per_s_all": [round(r["tokens_per_s"]) for r in rounds],
        "ttft_ms_median": None
        if median.get("ttft_s_median") is None
        else round(median["ttft_s_median"] * 1e3, 1),
        "decode_steps": median["decode_steps"],
        "errors": sum(r["num_errors"] for r in rounds),
        **({"server_cpu_s_per_round": _mean_cpu(rounds)} if "server_cpu_s" in rounds[0] else {}),
    }


def _mean_cpu(rounds: list[dict]) -> dict[str, float]:
    """Mean CPU seconds per round of the server's threads that used any."""
    names = {name for r in rounds for name in r["server_cpu_s"]}
    means = {n: sum(r["server_cpu_s"].get(n, 0.0) for r in rounds) / len(rounds) for n in names}
    return {name: round(value, 3) for name, value in sorted(means.items()) if value > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="", help="tokenizer + config (default: random qwen2-0.5b)"
    )
    parser.add_argument("--requests", default="64,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=3.3)
    parser.add_argument("--prefill-us-per-token", type=float, default=1.6)
    parser.add_argument("--ttft-probes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--serve-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.counts = [int(c) for c in args.requests.split(",")]
    if not args.model:
        from streamrl.models import save_random_model

        args.model = str(Path("/tmp/streamrl-host-overhead-model"))
        if not (Path(args.model) / "config.json").exists():
            save_random_model("qwen2-tiny", args.model)  # config + SmolLM2 tokenizer only matter
    if args.serve_port:
        args.port = args.serve_port
        serve(args)
        return

    from streamrl.process import free_port, wait_http_ready

    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, *sys.argv[1:], "--serve-port", str(port), "--model", args.model],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, timeout_s=120)
        http_rows = asyncio.run(over_http(args, url, child.pid))
    finally:
        child.terminate()
        child.wait(30)
    process_rows = asyncio.run(in_process(args))
    result = {"config": {k: v for k, v in vars(args).items() if k != "serve_port"}, "counts": {}}
    for count in args.counts:
        http, local = summary(http_rows[str(count)]), summary(process_rows[str(count)])
        ideal = count / (args.step_ms / 1e3)
        result["counts"][str(count)] = {
            "http": http,
            "in_process": local,
            "device_bound_tokens_per_s": round(ideal),
            "http_over_in_process": round(
                http["tokens_per_s_median"] / local["tokens_per_s_median"], 3
            ),
        }
        print(
            f"{count} requests: HTTP {http['tokens_per_s_median']:,} tok/s "
            f"(TTFT {http['ttft_ms_median']} ms, {http['decode_steps']} steps), in-process "
            f"{local['tokens_per_s_median']:,} ({local['decode_steps']} steps), device bound "
            f"{round(ideal):,}; HTTP / in-process {result['counts'][str(count)]['http_over_in_process']:.2f}; "
            f"server CPU s per round {http.get('server_cpu_s_per_round')}",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
