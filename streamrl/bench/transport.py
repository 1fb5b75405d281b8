"""`streamrl bench transport`: Groups moved between two processes over loopback ZeroMQ.

The receiver (this process) runs the real `StreamReceiver` with credits and
acks and decodes every frame into Groups; the sender is a child process
running the real `StreamSender`. Each group holds `samples_per_group` samples
of `response_tokens` tokens with logprobs, versions and a loss mask.

The child is also a test fixture: `python -m streamrl.bench.transport sender
--address ADDR --count N` sends groups `g0..g{N-1}` and prints `sent i` as it
goes, so a test can kill and restart it mid-stream.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio
import numpy as np

from streamrl.bench.results import write_result
from streamrl.process import spawn, streamrl_argv
from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits
from streamrl.queues.sender import StreamSender
from streamrl.types import Group, Sample


def make_group(
    index: int, *, samples_per_group: int = 8, response_tokens: int = 1024, prompt_tokens: int = 256
) -> Group:
    """A deterministic group `g{index}` of the given size."""
    rng = np.random.default_rng(index)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, 150_000, prompt_tokens),
            response_ids=rng.integers(0, 150_000, response_tokens),
            logprobs=-rng.random(response_tokens, dtype=np.float32),
            versions=np.full(response_tokens, 3),
            loss_mask=np.ones(response_tokens),
            reward=float(rng.random()),
        )
        for _ in range(samples_per_group)
    ]
    return Group(group_id=f"g{index}", prompt_seq=index, prompt_index=index, samples=samples)


async def _send(args: argparse.Namespace) -> None:
    template = make_group(
        0,
        samples_per_group=args.samples_per_group,
        response_tokens=args.response_tokens,
        prompt_tokens=args.prompt_tokens,
    )
    sender = StreamSender(
        args.address, sender_id=args.sender_id, resend_after_s=args.resend_after_s
    )
    async with anyio.create_task_group() as tg:
        await tg.start(sender.run)
        index = args.start
        while args.count <= 0 or index < args.count:
            if not await sender.acquire():
                break
            group = (
                template
                if args.reuse_payload
                else make_group(
                    index,
                    samples_per_group=args.samples_per_group,
                    response_tokens=args.response_tokens,
                    prompt_tokens=args.prompt_tokens,
                )
            )
            group.group_id, group.prompt_seq = f"g{index}", index
            await sender.send(group)
            if args.verbose:
                print(f"sent {index}", flush=True)
            index += 1
        await sender.flush()
        print(f"done {index}", flush=True)
        tg.cancel_scope.cancel()


async def _measure(args: argparse.Namespace) -> dict:
    num_groups = 0
    num_bytes_payload = 0
    first_at = last_at = 0.0

    def on_group(group: Group) -> None:
        nonlocal num_groups, first_at, last_at, num_bytes_payload
        now = time.perf_counter()
        if num_groups == 0:
            first_at = now
        last_at = now
        num_groups += 1
        num_bytes_payload += sum(
            s.prompt_ids.nbytes
            + s.response_ids.nbytes
            + s.logprobs.nbytes
            + s.versions.nbytes
            + s.loss_mask.nbytes
            for s in group.samples
        )

    receiver = StreamReceiver("tcp://127.0.0.1:0", credits=UnlimitedCredits(256), on_group=on_group)
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        child = spawn(
            "bench-sender",
            streamrl_argv(
                "bench",
                "transport-sender",
                "--address",
                address,
                "--count",
                "0",
                "--samples-per-group",
                str(args.samples_per_group),
                "--response-tokens",
                str(args.response_tokens),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--reuse-payload",
            ),
        )
        try:
            await anyio.sleep(args.seconds)
        finally:
            child.stop()
            tg.cancel_scope.cancel()
    elapsed = max(last_at - first_at, 1e-9)
    groups_per_s = (num_groups - 1) / elapsed
    return {
        "groups": num_groups,
        "seconds": elapsed,
        "groups_per_s": groups_per_s,
        "samples_per_s": groups_per_s * args.samples_per_group,
        "mb_per_s": num_bytes_payload / num_groups * groups_per_s / 1e6 if num_groups else 0.0,
        "bad_frames": receiver.stats.num_bad_frames,
        "duplicates": receiver.stats.num_duplicates,
    }


def transport_command(args: argparse.Namespace) -> int:
    result = anyio.run(_measure, args)
    print(
        f"transport: {result['samples_per_s']:,.0f} samples/s, {result['mb_per_s']:,.0f} MB/s "
        f"({result['groups']} groups of {args.samples_per_group} x {args.response_tokens} tokens "
        f"in {result['seconds']:.1f} s)"
    )
    if args.json:
        write_result(
            args.json,
            bench="transport",
            config={
                "samples_per_group": args.samples_per_group,
                "response_tokens": args.response_tokens,
                "prompt_tokens": args.prompt_tokens,
                "seconds": args.seconds,
            },
            result=result,
            plot=_plot,
        )
    return 0


def _plot(result: dict, ax) -> None:
    ax.bar(["samples/s"], [result["samples_per_s"]], color="tab:blue")
    ax.axhline(20_000, color="tab:red", linestyle="--", label="target 20,000")
    ax.set_ylabel("samples per second")
    ax.set_title(f"Group transport over loopback ZeroMQ ({result['mb_per_s']:.0f} MB/s)")
    ax.legend()


def sender_command(args: argparse.Namespace) -> int:
    anyio.run(_send, args)
    return 0


if __name__ == "__main__":
    from streamrl.bench.cli import add_sender_arguments

    parser = argparse.ArgumentParser()
    add_sender_arguments(parser)
    sys.exit(sender_command(parser.parse_args()))
