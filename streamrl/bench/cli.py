"""Argument parsers of `streamrl bench ...` (argparse only: no heavy imports).

streamrl bench staleness CONFIG --eta 0,1,2,4,8 --steps N [--corrections ...] [--json PATH]
streamrl bench sync-vs-async CONFIG [--eta K] --steps N [--json PATH]
streamrl bench weight-sync --shape qwen2-0.5b --engines 1..N [--json PATH]
streamrl bench collective [--backend nccl] [--json PATH]
streamrl bench transport [--json PATH]
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


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    staleness = commands.add_parser(
        "staleness", help="effective training throughput and learning against max staleness"
    )
    _add_run_args(staleness, default_steps=20)
    staleness.add_argument("--eta", default="0,1,2,4,8", help="comma-separated max_staleness")
    staleness.add_argument(
        "--corrections",
        default="decoupled_ppo",
        help="comma-separated off-policy corrections to compare (decoupled_ppo, tis, none)",
    )
    staleness.set_defaults(entry="streamrl.bench.staleness:staleness_command")

    merge = commands.add_parser("merge", help="one staleness result from several parts")
    merge.add_argument("inputs", nargs="+", help="staleness JSON files (a later one wins)")
    merge.add_argument("--json", required=True, help="the merged result (and a PNG beside it)")
    merge.set_defaults(entry="streamrl.bench.staleness:merge_command")

    sync_async = commands.add_parser(
        "sync-vs-async", help="sync against async, each stage alone, pipeline efficiency"
    )
    _add_run_args(sync_async, default_steps=20)
    sync_async.add_argument(
        "--eta",
        type=int,
        default=-1,
        help="async max_staleness (default: the config's, at least 1)",
    )
    sync_async.add_argument(
        "--skip-stages",
        action="store_true",
        help="only the two runs (no generation-alone / training-alone)",
    )
    sync_async.set_defaults(entry="streamrl.bench.sync_async:sync_async_command")

    weight_sync = commands.add_parser(
        "weight-sync", help="publish latency, learner stall, engine pause and GB/s per engine count"
    )
    weight_sync.add_argument(
        "--shape",
        default="qwen2-0.5b",
        help="random model shape (streamrl.engine.models.RANDOM_SHAPES)",
    )
    weight_sync.add_argument("--engines", default="1..2", help="engine counts: '1..N' or '1,2,4'")
    weight_sync.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    weight_sync.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    weight_sync.add_argument("--learner-gpu", type=int, default=0)
    weight_sync.add_argument(
        "--engine-gpus", default="", help="comma-separated GPUs for engines (default: 1, 2, ...)"
    )
    weight_sync.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl", "ipc"],
        help="ipc: engines on the learner's device, weights by reference (no group)",
    )
    weight_sync.add_argument("--bucket-mb", type=int, default=512)
    weight_sync.add_argument(
        "--per-tensor",
        action="store_true",
        help="one broadcast per tensor instead of one per flattened bucket",
    )
    weight_sync.add_argument(
        "--pause-mode", default="in_place", choices=["in_place", "abort", "retract"]
    )
    weight_sync.add_argument("--repeats", type=int, default=5, help="timed publishes per count")
    weight_sync.add_argument(
        "--load-requests",
        type=int,
        default=0,
        help="requests kept generating on each engine during publishes",
    )
    weight_sync.add_argument(
        "--peak",
        action="store_true",
        help="also measure the link's peak (bench collective) in the run",
    )
    weight_sync.add_argument(
        "--peak-from", default="", help="take the link's peak from a `bench collective` JSON"
    )
    weight_sync.add_argument("--work-dir", default="runs/bench/weight-sync")
    weight_sync.add_argument("--json", default="", help="write the result (and a PNG) here")
    weight_sync.set_defaults(entry="streamrl.bench.weight_sync:weight_sync_command")

    collective = commands.add_parser(
        "collective", help="peak broadcast / all-gather bandwidth between two processes"
    )
    collective.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    collective.add_argument("--sizes-mb", default="", help="message sizes (default by backend)")
    collective.add_argument("--gpus", default="0,1", help="the two GPUs (NCCL)")
    collective.add_argument("--iterations", type=int, default=5)
    collective.add_argument("--json", default="", help="write the result (and a PNG) here")
    collective.set_defaults(entry="streamrl.bench.collective:collective_command")

    worker = commands.add_parser("collective-worker", help="(internal) one rank of `collective`")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--port", type=int, required=True)
    worker.add_argument("--backend", required=True)
    worker.add_argument("--sizes-mb", required=True)
    worker.add_argument("--iterations", type=int, default=5)
    worker.add_argument("--out", default="")
    worker.set_defaults(entry="streamrl.bench.collective:worker_command")

    run_one = commands.add_parser("run-one", help="(internal) one run of a bench, in its process")
    run_one.add_argument("config")
    run_one.add_argument("--record", default="", help="append the trained batches here")
    run_one.set_defaults(entry="streamrl.bench.runs:run_one_command")

    replay = commands.add_parser("replay", help="(internal) training alone on recorded batches")
    replay.add_argument("config")
    replay.add_argument("--groups", required=True)
    replay.add_argument("--model", required=True)
    replay.add_argument("--out", required=True)
    replay.set_defaults(entry="streamrl.bench.stages:replay_command")

    transport = commands.add_parser("transport", help="Groups/s and MB/s between two processes")
    transport.add_argument("--json", default="", help="write the result here")
    transport.add_argument("--seconds", type=float, default=10.0)
    transport.add_argument("--samples-per-group", type=int, default=8)
    transport.add_argument("--response-tokens", type=int, default=1024)
    transport.add_argument("--prompt-tokens", type=int, default=256)
    transport.set_defaults(entry="streamrl.bench.transport:transport_command")

    sender = commands.add_parser(
        "transport-sender", help="(internal) the sending side of `transport`"
    )
    from streamrl.bench.transport_args import add_sender_arguments

    add_sender_arguments(sender)
    sender.set_defaults(entry="streamrl.bench.transport:sender_command")
