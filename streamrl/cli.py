"""`streamrl` command line. Parsers are built here without heavy imports, so
`streamrl --help` is instant; each command's module is imported when it runs.

    streamrl run CONFIG [--set a.b=c ...] [--resume]
    streamrl check CONFIG [--set ...] [--against RUN_DIR [--json PATH]]
    streamrl engine serve --model PATH --port N
    streamrl bench {transport,staleness,sync-vs-async,weight-sync,collective} ...
    streamrl export CHECKPOINT --out DIR [--base MODEL] [--no-merged]
    streamrl from-slime [--out CONFIG] [SCRIPT ...] [-- python train.py FLAGS...]
    streamrl plot RUN_DIR
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import sys

from streamrl import logs
from streamrl.config.sections import ConfigError


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="train: engines, rollout and learner, fully async")
    _add_config_args(run)
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    run.set_defaults(entry="streamrl.launch.run:run_command")

    check = commands.add_parser(
        "check",
        help="validate a config, its code, data and model paths; print it resolved (exit 2 on a problem)",
    )
    _add_config_args(check)
    check.add_argument(
        "--against",
        metavar="RUN_DIR",
        help="print each process's planned peak memory next to what the run in RUN_DIR "
        "measured (its summary.json), with the error of the plan",
    )
    check.add_argument("--json", metavar="PATH", help="with --against: write the rows as JSON")
    check.set_defaults(entry="streamrl.check:check_command")

    engine = commands.add_parser("engine", help="the embedded inference engine")
    engine_commands = engine.add_subparsers(dest="engine_command", required=True)
    serve = engine_commands.add_parser("serve", help="serve SGLang's HTTP protocol")
    from streamrl.engine.options import EngineOptions  # light: msgspec only

    EngineOptions.add_arguments(serve)
    serve.set_defaults(entry="streamrl.mains.engine:serve_command")

    export = commands.add_parser(
        "export", help="a LoRA checkpoint as a peft adapter and as merged Hugging Face weights"
    )
    export.add_argument("checkpoint", help="a checkpoint directory of a LoRA run")
    export.add_argument("--out", required=True, help="writes OUT/adapter and OUT/merged")
    export.add_argument("--base", default="", help="the base model (default: the adapter's)")
    export.add_argument(
        "--merged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also write the merged model",
    )
    export.set_defaults(entry="streamrl.export:export_command")

    slime = commands.add_parser(
        "from-slime",
        help="a slime command line as a config (every flag mapped or listed with the reason)",
    )
    slime.add_argument(
        "inputs",
        nargs="*",
        metavar="SCRIPT",
        help="shell scripts: the launch script, scripts/models/<name>.sh; then, after `--`, "
        "the command line itself (python train.py FLAGS...) when no script holds it",
    )
    slime.add_argument("--out", default="", help="write the config here (default: print it)")
    slime.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a key of the written config, e.g. --set model.path=/ckpt/Qwen3-4B",
    )
    slime.set_defaults(entry="streamrl.compat.slime.command_line:from_slime_command")

    plot = commands.add_parser("plot", help="a run's reward curve as a PNG")
    plot.add_argument("run_dir", help="the run's train.output_dir")
    plot.add_argument("--out", default="", help="PNG path (default RUN_DIR/reward.png)")
    plot.add_argument("--title", default="")
    plot.set_defaults(entry="streamrl.plot:plot_command")

    bench = commands.add_parser("bench", help="benchmarks that write JSON and a plot")
    from streamrl.bench.cli import add_bench_commands  # light: argparse only

    add_bench_commands(bench)

    rollout = commands.add_parser("_rollout", help="(internal) the rollout process of a run")
    rollout.add_argument("--run-dir", required=True)
    rollout.add_argument("--tokenizer", required=True, help="unless model.tokenizer is set")
    rollout.add_argument("--tokenizer-class", default="", help="AutoTokenizer's choice for it")
    rollout.set_defaults(entry="streamrl.mains.rollout:rollout_command")

    follower = commands.add_parser("_learner", help="(internal) a learner rank > 0 of a run")
    follower.add_argument("--run-dir", required=True)
    follower.set_defaults(entry="streamrl.mains.follower:follower_command")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    atexit.register(logs.report_pending)
    module_name, _, function_name = args.entry.partition(":")
    entry = getattr(importlib.import_module(module_name), function_name)
    try:
        code = entry(args) or 0
    except ConfigError as exc:  # a bad --set or config in any command: the message, no trace
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    finally:
        # Nothing a collection could free matters once the command is over, and the full
        # one that Python makes on its way out walks every object torch and transformers
        # made (about 2 s on a loaded 2-core machine, for each process of a run): frozen
        # objects are left to the exit. Refcounts still close what they own.
        gc.freeze()
    sys.exit(code)
