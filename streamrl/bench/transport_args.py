"""Arguments of the transport bench's sender process (argparse only)."""

from __future__ import annotations

import argparse


def add_sender_arguments(parser: argparse.ArgumentParser) -> None:
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
