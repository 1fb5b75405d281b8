"""The rollout stream on ZeroMQ, the rollout's end: `StreamSender`.

It connects a DEALER (identity: its sender id) to the trainer's `StreamReceiver`
(`streamrl.queues.receiver`, where the stream's guarantees are listed): `acquire()` waits
for a credit before a group starts, `send()` keeps the group until the receiver acks it
and resends it after a reconnect or `resend_after_s` of silence, and the receiver's
requests (stop, a new version, `CollectInFlight`) arrive through `run()`.
"""

from __future__ import annotations

import logging
import time
import uuid

import anyio
import msgspec
import zmq
import zmq.asyncio

from streamrl.queues.protocol import (
    Ack,
    CollectInFlight,
    Credit,
    Fatal,
    Hello,
    Report,
    Stop,
    ToSender,
)
from streamrl.types import Group, make_decoder, make_encoder

log = logging.getLogger(__name__)


class StreamSender:
    """Rollout side of the stream: `await acquire()` before starting a group, `send()` it when done."""

    def __init__(
        self,
        address: str,
        *,
        sender_id: str,
        want: int = 0,
        resend_after_s: float = 10.0,
    ) -> None:
        self.address = address
        self.sender_id = sender_id
        self.want = want
        self.resend_after_s = resend_after_s
        self.session = uuid.uuid4().hex
        self.version = 0
        self.is_stopped = False
        self.in_flight_step = -1
        """The newest `CollectInFlight` request's step (-1: none yet)."""
        self._credits = 0
        self._num_stops = 0
        self._unacked: dict[str, tuple[float, bytes]] = {}
        self._changed = anyio.Event()
        self._encoder = make_encoder()
        self._decoder = make_decoder(ToSender)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, sender_id.encode())
        self._socket.setsockopt(zmq.LINGER, 0)

    @property
    def num_unacked(self) -> int:
        return len(self._unacked)

    @property
    def unacked_ids(self) -> list[str]:
        """Ids of the groups sent and not yet acknowledged (kept for a resend)."""
        return list(self._unacked)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self._socket.connect(self.address)
        await self._hello()
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._resend_loop)
                while True:
                    payload = await self._socket.recv(copy=False)
                    try:
                        message = self._decoder.decode(payload.buffer)
                    except (msgspec.DecodeError, ValueError) as exc:
                        log.warning("rollout stream: undecodable reply (%s)", exc)
                        continue
                    self._on_message(message)
        finally:
            self._socket.close(0)
            self._context.term()

    async def acquire(self) -> bool:
        """Wait for a credit to start one group. False once the receiver said stop."""
        while self._credits <= 0 and not self.is_stopped:
            changed = self._changed
            await changed.wait()
        if self.is_stopped:
            return False
        self._credits -= 1
        return True

    def release(self) -> None:
        """Give back an unused credit (the group was never started)."""
        self._credits += 1

    async def send(self, group: Group) -> None:
        payload = self._encoder.encode(group)
        self._unacked[group.group_id] = (time.monotonic(), payload)
        await self._socket.send(payload, copy=False)

    async def send_report(self, kind: str, payload: dict) -> None:
        await self._socket.send(self._encoder.encode(Report(kind, payload)))

    async def send_fatal(self, fatal: Fatal, *, timeout_s: float) -> bool:
        """Send `fatal` (after every group and report sent before it) and wait for the
        receiver's `Stop`; False when none came within `timeout_s`."""
        num_stops = self._num_stops  # the next Stop answers this frame
        await self._socket.send(self._encoder.encode(fatal))
        with anyio.move_on_after(timeout_s):
            while self._num_stops == num_stops:
                changed = self._changed
                await changed.wait()
        return self._num_stops > num_stops

    async def flush(self) -> None:
        """Wait until every sent group is acknowledged."""
        while self._unacked:
            changed = self._changed
            await changed.wait()

    async def next_in_flight_request(self, after: int) -> int:
        """Wait for a `CollectInFlight` request newer than step `after`; its step (-1 once
        stopped)."""
        while self.in_flight_step <= after and not self.is_stopped:
            changed = self._changed
            await changed.wait()
        return -1 if self.is_stopped else self.in_flight_step

    async def wait_version(self, version: int) -> None:
        """Wait until the receiver reports engines at `version` or later (or stops)."""
        while self.version < version and not self.is_stopped:
            changed = self._changed
            await changed.wait()

    async def _hello(self) -> None:
        await self._socket.send(
            self._encoder.encode(Hello(self.sender_id, self.session, self.want))
        )

    def _on_message(self, message: ToSender) -> None:
        if isinstance(message, Credit):
            self._credits += message.num_groups
            self.version = max(self.version, message.version)
        elif isinstance(message, Ack):
            for group_id in message.group_ids:
                self._unacked.pop(group_id, None)
        elif isinstance(message, Stop):
            self.is_stopped = True
            self._num_stops += 1
        elif isinstance(message, CollectInFlight):
            self.in_flight_step = max(self.in_flight_step, message.step)
        self._changed.set()
        self._changed = anyio.Event()

    async def _resend_loop(self) -> None:
        """Resend groups unacked for `resend_after_s` (the receiver restarted or a frame was lost)."""
        while True:
            await anyio.sleep(self.resend_after_s / 2)
            now = time.monotonic()
            stale = [
                gid for gid, (sent, _) in self._unacked.items() if now - sent > self.resend_after_s
            ]
            if stale:
                log.info("rollout stream: resending %d unacked groups", len(stale))
                await self._hello()
            for group_id in stale:
                if group_id in self._unacked:
                    _, payload = self._unacked[group_id]
                    self._unacked[group_id] = (now, payload)
                    await self._socket.send(payload, copy=False)
