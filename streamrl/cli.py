"""`streamrl` command line. Parsers are built here without heavy imports, so
`streamrl --help` is instant; each command's module is imported when it runs.

    streamrl run CONFIG [--set a.b=c ...] [--resume]
    streamrl check CONFIG [--set ...]
    streamrl engine serve --model PATH --port N
    streamrl bench {transport,staleness,sync-vs-async,weight-sync} ...
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run configuration (TOML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.batch_size=16 (repeatable)",
    )


def _engine_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF directory, `smollm2`, or random:<shape>")
    parser.add_argument(
        "--tokenizer", default="", help="tokenizer directory (default: the model's)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--runner", default="auto", choices=["auto", "compact", "hf"])
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile the small elementwise kernels (auto: on with CUDA graphs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for random models and sampling")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="train: engines, rollout and learner, fully async")
    _add_config_args(run)
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    run.set_defaults(entry="streamrl.launch.local:run_command")

    check = commands.add_parser("check", help="validate a config and print it resolved")
    _add_config_args(check)
    check.set_defaults(entry="streamrl.cli:check_command")

    engine = commands.add_parser("engine", help="the embedded inference engine")
    engine_commands = engine.add_subparsers(dest="engine_command", required=True)
    serve = engine_commands.add_parser("serve", help="serve SGLang's HTTP protocol")
    _engine_serve_args(serve)
    serve.set_defaults(entry="streamrl.engine.server:serve_command")

    plot = commands.add_parser("plot", help="a run's reward curve as a PNG")
    plot.add_argument("run_dir", help="the run's train.output_dir")
    plot.add_argument("--out", default="", help="PNG path (default RUN_DIR/reward.png)")
    plot.add_argument("--title", default="")
    plot.set_defaults(entry="streamrl.plot:plot_command")

    bench = commands.add_parser("bench", help="benchmarks that write JSON and a plot")
    from streamrl.bench.cli import add_bench_commands  # light: argparse only

    add_bench_commands(bench)

    internal = commands.add_parser("_component", help="(internal) one component of `streamrl run`")
    internal.add_argument("role", choices=["rollout", "learner"])
    internal.add_argument("--run-dir", required=True)
    internal.add_argument("--rank", type=int, default=0)
    internal.set_defaults(entry="streamrl.launch.component:component_command")
    return parser


def check_command(args: argparse.Namespace) -> int:
    from streamrl.config import ConfigError, dump_toml, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dump_toml(cfg), end="")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.log_level != "debug":  # one line per HTTP call drowns the progress lines
        logging.getLogger("httpx").setLevel(logging.WARNING)
    module_name, _, function_name = args.entry.partition(":")
    entry = getattr(importlib.import_module(module_name), function_name)
    sys.exit(entry(args) or 0)
