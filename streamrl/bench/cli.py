"""Argument parsers of `streamrl bench ...` (argparse only: no heavy imports)."""

from __future__ import annotations

import argparse


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    transport = commands.add_parser("transport", help="Groups/s and MB/s between two processes")
    transport.add_argument("--json", default="", help="write the result here")
    transport.add_argument("--seconds", type=float, default=10.0)
    transport.add_argument("--samples-per-group", type=int, default=8)
    transport.add_argument("--response-tokens", type=int, default=1024)
    transport.add_argument("--prompt-tokens", type=int, default=256)
    transport.set_defaults(entry="streamrl.bench.transport:transport_command")

    sender = commands.add_parser("transport-sender", help="(internal) the sending side of `transport`")
    from streamrl.bench.transport_args import add_sender_arguments

    add_sender_arguments(sender)
    sender.set_defaults(entry="streamrl.bench.transport:sender_command")
