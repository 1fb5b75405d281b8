"""Argument parsers of `streamrl bench ...` (argparse only: no heavy imports).

streamrl bench staleness CONFIG --eta 0,1,2,4,auto --steps N [--corrections ...] [--seeds 0,1,2]
                          [--json PATH]
streamrl bench sync-vs-async CONFIG [--eta K] --steps N [--json PATH]
streamrl bench weight-sync --shape qwen2-0.5b --engines 1..N [--lora-rank 0,16] [--json PATH]
streamrl bench collective [--backend nccl] [--json PATH]
streamrl bench transport [--json PATH]
streamrl bench checkpoint CONFIG --every K --steps N [--json PATH]
streamrl bench engine [--shape qwen2-0.5b] [--requests 64,256,512] [--engines auto] [--json PATH]
"""

from __future__ import annotations

import argparse


def _add_run_args(parser: argparse.ArgumentParser, *, default_steps: int) -> None:
    parser.add_argument("config", help="run configuration (TOML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value in every run (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=default_steps, help="training steps per run")
    parser.add_argument("--work-dir", default="runs/bench", help="run directories go here")
    parser.add_argument("--json", default="", help="write the result (and a PNG beside it) here")
    parser.add_argument("--run-timeout-s", type=float, default=1800.0, help="limit per run")
    parser.add_argument(
        "--run-log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )


def _staleness(commands) -> None:
    parser = commands.add_parser(
        "staleness", help="effective training throughput and learning against max staleness"
    )
    _add_run_args(parser, default_steps=20)
    parser.add_argument(
        "--eta",
        default="0,1,2,4,8",
        help="comma-separated max_staleness values; `auto` for the learner's own bound",
    )
    parser.add_argument(
        "--corrections",
        default="decoupled_ppo",
        help="comma-separated off-policy corrections to compare (decoupled_ppo, tis, none)",
    )
    parser.add_argument(
        "--seeds",
        default="",
        help="comma-separated train.seed values, a run of each setting per seed (default: "
        "the config's seed, once)",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="a variant's name, for runs that differ by --set: it joins the correction's "
        "(decoupled_ppo+TAG), so `bench merge` keeps it apart from the plain setting",
    )
    parser.set_defaults(entry="streamrl.bench.staleness:staleness_command")


def _checkpoint(commands) -> None:
    parser = commands.add_parser(
        "checkpoint", help="what checkpoints of the whole async state cost a running run"
    )
    _add_run_args(parser, default_steps=12)
    parser.add_argument("--every", type=int, default=3, help="a checkpoint every K steps")
    parser.set_defaults(entry="streamrl.bench.checkpoint:checkpoint_command")


def _merge(commands) -> None:
    parser = commands.add_parser("merge", help="one staleness result from several parts")
    parser.add_argument(
        "inputs", nargs="+", help="staleness JSON files (a run of the same name: the later wins)"
    )
    parser.add_argument("--json", required=True, help="the merged result (and a PNG beside it)")
    parser.add_argument(
        "--pool",
        action="store_true",
        help="keep every run, also one whose name (setting and seed) an earlier file has: "
        "parts that repeat seeds pool into more runs per setting (named NAME@FILE)",
    )
    parser.add_argument(
        "--eta", default="", help="keep only these etas, comma-separated (e.g. 0,4); all if empty"
    )
    parser.set_defaults(entry="streamrl.bench.staleness:merge_command")


def _sync_async(commands) -> None:
    parser = commands.add_parser(
        "sync-vs-async", help="sync against async, each stage alone, pipeline efficiency"
    )
    _add_run_args(parser, default_steps=20)
    parser.add_argument(
        "--eta",
        type=int,
        default=-1,
        help="async max_staleness (default: the config's, at least 1)",
    )
    parser.add_argument(
        "--skip-stages",
        action="store_true",
        help="only the two runs (no generation-alone / training-alone)",
    )
    parser.set_defaults(entry="streamrl.bench.sync_async:sync_async_command")


def _weight_sync(commands) -> None:
    parser = commands.add_parser(
        "weight-sync", help="publish latency, learner stall, engine pause and GB/s per engine count"
    )
    parser.add_argument(
        "--shape",
        default="qwen2-0.5b",
        help="random model shape (streamrl.models.RANDOM_SHAPES)",
    )
    parser.add_argument("--engines", default="1..2", help="engine counts: '1..N' or '1,2,4'")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--learner-gpu", type=int, default=0)
    parser.add_argument(
        "--engine-gpus", default="", help="comma-separated GPUs for engines (default: 1, 2, ...)"
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl", "ipc"],
        help="ipc: engines on the learner's device, weights by reference (no group)",
    )
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument(
        "--per-tensor",
        action="store_true",
        help="one broadcast per tensor instead of one per flattened bucket",
    )
    parser.add_argument(
        "--pause-mode",
        default="in_place",
        choices=["in_place", "abort", "retract", "retract_abort"],
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed publishes per count")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engines on a GPU decode with CUDA graphs and compiled kernels, as in a run "
        "(--no-cuda-graphs: eager, a faster start; the eager step holds the GIL longer)",
    )
    parser.add_argument(
        "--load-requests",
        type=int,
        default=0,
        help="requests kept generating on each engine during publishes",
    )
    parser.add_argument(
        "--peak",
        action="store_true",
        help="also measure the link's peak (bench collective) in the run",
    )
    parser.add_argument(
        "--peak-from", default="", help="take the link's peak from a `bench collective` JSON"
    )
    parser.add_argument(
        "--lora-rank",
        default="0",
        help="comma-separated LoRA ranks: publish rank-r adapters (engines merge them) instead "
        "of the full weights; 0 is the full push, e.g. '0,16' measures both",
    )
    parser.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        help="comma-separated linears that get adapters (with --lora-rank)",
    )
    parser.add_argument("--work-dir", default="runs/bench/weight-sync")
    parser.add_argument("--json", default="", help="write the result (and a PNG) here")
    parser.set_defaults(entry="streamrl.bench.weight_sync:weight_sync_command")


def _pause(commands) -> None:
    parser = commands.add_parser(
        "pause", help="what each pause mode costs a running engine per weight update"
    )
    parser.add_argument("--url", required=True, help="the engine (SGLang or embedded)")
    parser.add_argument("--model", default="", help="(recorded) the served model's directory")
    parser.add_argument(
        "--modes",
        default="in_place,abort",
        help="comma-separated pause modes: in_place, abort, retract, retract_abort (retract, then "
        "abort every request: streamrl.bench.pause)",
    )
    parser.add_argument("--requests", type=int, default=64, help="requests decoding at once")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=5, help="weight updates per mode")
    parser.add_argument("--interval-s", type=float, default=0.5, help="time between updates")
    parser.add_argument("--json", default="", help="write the result (and a PNG) here")
    parser.set_defaults(entry="streamrl.bench.pause:pause_command")


def _engine(commands) -> None:
    parser = commands.add_parser(
        "engine", help="decode tokens/s, time to first token, GPU busy: embedded vs SGLang"
    )
    parser.add_argument("--shape", default="qwen2-0.5b", help="random model shape (RANDOM_SHAPES)")
    parser.add_argument("--model", default="", help="a model directory instead of --shape")
    parser.add_argument(
        "--engines",
        default="auto",
        help="comma-separated of embedded, sglang, in-process (auto: all three, sglang only "
        "when importable, else recorded as skipped)",
    )
    parser.add_argument("--requests", default="64,256,512", help="request counts sent at once")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--ttft-probes", type=int, default=8, help="requests per round that stream (for TTFT)"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="processes that send the HTTP engines' requests between them (1: this one)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured rounds per count (median and spread)"
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="unmeasured rounds of the same load before each count's measured ones",
    )
    parser.add_argument(
        "--embedded-args", default="", help="extra `streamrl engine serve` flags (one string)"
    )
    parser.add_argument(
        "--sglang-args",
        default="--attention-backend triton --sampling-backend pytorch --grammar-backend none "
        "--cuda-graph-max-bs 256 --mem-fraction-static 0.8",
        help="extra `sglang.launch_server` flags (one string)",
    )
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--work-dir", default="runs/bench/engine", help="model and server logs")
    parser.add_argument("--json", default="", help="write the result (and a PNG) here")
    parser.set_defaults(entry="streamrl.bench.engine:engine_command")


def _collective(commands) -> None:
    parser = commands.add_parser(
        "collective", help="peak broadcast / all-gather bandwidth between two processes"
    )
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--sizes-mb", default="", help="message sizes (default by backend)")
    parser.add_argument("--gpus", default="0,1", help="the two GPUs (NCCL)")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--json", default="", help="write the result (and a PNG) here")
    parser.set_defaults(entry="streamrl.bench.collective:collective_command")


def _collective_worker(commands) -> None:
    parser = commands.add_parser("collective-worker", help="(internal) one rank of `collective`")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--sizes-mb", required=True)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.set_defaults(entry="streamrl.bench.collective:worker_command")


def _run_one(commands) -> None:
    parser = commands.add_parser("run-one", help="(internal) one run of a bench, in its process")
    parser.add_argument("config")
    parser.add_argument("--record", default="", help="append the trained batches here")
    parser.set_defaults(entry="streamrl.bench.runs:run_one_command")


def _replay(commands) -> None:
    parser = commands.add_parser("replay", help="(internal) training alone on recorded batches")
    parser.add_argument("config")
    parser.add_argument("--groups", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.set_defaults(entry="streamrl.bench.phases:replay_command")


def _transport(commands) -> None:
    parser = commands.add_parser("transport", help="Groups/s and MB/s between two processes")
    parser.add_argument("--json", default="", help="write the result here")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--samples-per-group", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.set_defaults(entry="streamrl.bench.transport:transport_command")


def _transport_sender(commands) -> None:
    parser = commands.add_parser(
        "transport-sender", help="(internal) the sending side of `transport`"
    )
    add_sender_arguments(parser)
    parser.set_defaults(entry="streamrl.bench.transport:sender_command")


def add_sender_arguments(parser: argparse.ArgumentParser) -> None:
    """The sending side of `transport` (a process of its own)."""
    parser.add_argument("--address", required=True)
    parser.add_argument("--count", type=int, default=0, help="groups to send; 0 = until killed")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--sender-id", default="bench-sender")
    parser.add_argument("--samples-per-group", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--resend-after-s", type=float, default=10.0)
    parser.add_argument("--reuse-payload", action="store_true", help="encode one template group")
    parser.add_argument("--verbose", action="store_true", help="print `sent i` per group")


COMMANDS = (
    _staleness,
    _merge,
    _sync_async,
    _weight_sync,
    _pause,
    _engine,
    _checkpoint,
    _collective,
    _collective_worker,
    _run_one,
    _replay,
    _transport,
    _transport_sender,
)
"""One parser per bench command, in `streamrl bench --help` order."""


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for add in COMMANDS:
        add(commands)
