"""The rollout stream between real processes over real ZeroMQ sockets."""

from __future__ import annotations

import subprocess

import anyio
import msgspec
import pytest
import zmq

from streamrl.bench.transport import make_group
from streamrl.process import spawn, streamrl_argv
from streamrl.queues.protocol import Fatal
from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits
from streamrl.queues.sender import StreamSender
from streamrl.types import Group, make_decoder, make_encoder

pytestmark = pytest.mark.anyio

SMALL = ["--samples-per-group", "2", "--response-tokens", "16", "--prompt-tokens", "4"]


def test_a_group_survives_the_codec_with_arrays_and_metadata_intact():
    group = make_group(7, samples_per_group=3, response_tokens=5, prompt_tokens=2)
    group.samples[0].metadata = {"turns": 2, "tool": "calc"}
    decoded = make_decoder(Group).decode(make_encoder().encode(group))
    assert decoded.group_id == "g7" and len(decoded.samples) == 3
    for before, after in zip(group.samples, decoded.samples, strict=True):
        assert (before.response_ids == after.response_ids).all()
        assert (before.logprobs == after.logprobs).all()
        assert after.logprobs.dtype.name == "float32" and after.versions.dtype.name == "int32"
        assert after.metadata == before.metadata


class Collector:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.changed = anyio.Event()

    def __call__(self, group: Group) -> None:
        self.ids.append(group.group_id)
        self.changed.set()
        self.changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        with anyio.fail_after(60):
            while len(self.ids) < count:
                await self.changed.wait()


async def _read_line_with(process: subprocess.Popen, prefix: str) -> str:
    """Read the child's stdout until a line starts with `prefix`."""

    def read() -> str:
        for line in process.stdout:
            if line.startswith(prefix):
                return line
        raise AssertionError(f"child exited before printing {prefix!r}")

    with anyio.fail_after(60):
        return await anyio.to_thread.run_sync(read)


async def test_a_sender_killed_mid_stream_and_restarted_loses_no_group_and_duplicates_none():
    count = 200
    collector = Collector()
    receiver = StreamReceiver("tcp://127.0.0.1:0", credits=UnlimitedCredits(16), on_group=collector)
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        argv = streamrl_argv(
            "bench",
            "transport-sender",
            "--address",
            address,
            "--count",
            str(count),
            "--sender-id",
            "worker-0",
            "--verbose",
            *SMALL,
        )
        first = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            await _read_line_with(first, "sent 60")
        finally:
            first.kill()
            first.wait()
        received_before_restart = len(collector.ids)
        assert 0 < received_before_restart < count

        second = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            await _read_line_with(second, "done")
        finally:
            second.kill()
            second.wait()
        await collector.wait_for(count)
        tg.cancel_scope.cancel()

    assert sorted(collector.ids) == sorted(f"g{i}" for i in range(count))
    assert len(set(collector.ids)) == len(collector.ids) == count
    assert receiver.stats.num_duplicates > 0  # the restart did resend, and those were ignored
    assert receiver.stats.num_sessions == 2


async def test_garbage_frames_are_counted_and_the_receiver_keeps_serving():
    collector = Collector()
    receiver = StreamReceiver("tcp://127.0.0.1:0", credits=UnlimitedCredits(8), on_group=collector)
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        context = zmq.Context()
        raw = context.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        raw.send(b"\xc1\xff not msgpack at all")
        raw.send(msgspec.msgpack.encode({"type": "group", "group_id": 5}))  # wrong schema
        raw.send_multipart([b"two", b"frames"])
        child = spawn(
            "sender",
            streamrl_argv(
                "bench", "transport-sender", "--address", address, "--count", "5", *SMALL
            ),
        )
        try:
            await collector.wait_for(5)
        finally:
            child.stop()
            raw.close()
            context.term()
        tg.cancel_scope.cancel()
    assert receiver.stats.num_bad_frames == 3
    assert sorted(collector.ids) == [f"g{i}" for i in range(5)]


async def test_a_sender_starts_only_as_many_groups_as_it_was_granted():
    class FixedCredits(UnlimitedCredits):
        def available(self) -> int:
            return 3 - self.in_flight - self.returned_total

        returned_total = 0

        def returned(self) -> None:
            super().returned()
            self.returned_total += 1

    collector = Collector()
    credits = FixedCredits()
    receiver = StreamReceiver("tcp://127.0.0.1:0", credits=credits, on_group=collector)
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="w")
        await tg.start(sender.run)
        started = 0
        for index in range(3):
            assert await sender.acquire()
            started += 1
            await sender.send(make_group(index, samples_per_group=1, response_tokens=4))
        await collector.wait_for(3)
        with anyio.move_on_after(0.5) as scope:  # a bounded check that no 4th credit arrives
            await sender.acquire()
        assert scope.cancelled_caught
        await receiver.stop("done")
        assert await sender.acquire() is False
        tg.cancel_scope.cancel()
    assert started == 3 and collector.ids == ["g0", "g1", "g2"]


async def test_a_fatal_arrives_after_the_groups_sent_before_it_and_is_answered_with_stop():
    collector = Collector()
    fatal_seen: list[tuple[list[str], Fatal]] = []
    receiver = StreamReceiver(
        "tcp://127.0.0.1:0",
        credits=UnlimitedCredits(8),
        on_group=collector,
        on_fatal=lambda fatal: fatal_seen.append((list(collector.ids), fatal)),
    )
    async with anyio.create_task_group() as tg:
        address = await tg.start(receiver.run)
        sender = StreamSender(address, sender_id="w")
        await tg.start(sender.run)
        for index in range(3):
            assert await sender.acquire()
            await sender.send(make_group(index, samples_per_group=1, response_tokens=4))
        fatal = Fatal(reason="every sample failed", error="RuntimeError: bug")
        assert await sender.send_fatal(fatal, timeout_s=30)
        tg.cancel_scope.cancel()
    assert fatal_seen == [(["g0", "g1", "g2"], fatal)]
    assert receiver.stats.num_fatal == 1


async def test_a_fatal_nobody_answers_gives_up_after_its_timeout(free_port):
    async with anyio.create_task_group() as tg:
        sender = StreamSender(f"tcp://127.0.0.1:{free_port()}", sender_id="w")
        await tg.start(sender.run)
        with anyio.fail_after(10):
            assert not await sender.send_fatal(Fatal(reason="bad data"), timeout_s=0.2)
        tg.cancel_scope.cancel()
