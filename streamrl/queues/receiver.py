"""The rollout stream on ZeroMQ, the trainer's end: `StreamReceiver`.

`StreamReceiver` binds a ROUTER socket; each `StreamSender` (`streamrl.queues.sender`, the
rollout's end) connects a DEALER whose identity is its sender id. The protocol and its
guarantees are in `streamrl.queues.protocol`:

- lossless: a sender keeps every group until the receiver acks it and resends
  unacked groups when it reconnects or hears nothing for `resend_after_s`;
- bounded: a sender starts a group only with a credit the receiver granted (the
  receiver asks its `CreditSource`, the run's `Admission`, how many);
- exactly once: the receiver remembers every group id it accepted and acks,
  but does not store, a duplicate;
- robust: an undecodable frame is logged and counted; the receiver goes on;
- final: a sender's `Fatal` reaches `on_fatal` and is answered with `Stop`, so the
  sender knows it arrived before its process exits.

Both ends run inside an anyio task group on the asyncio backend (pyzmq's
asyncio sockets); `run()` reports readiness through `task_status`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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
    ToReceiver,
    ToSender,
)
from streamrl.types import Group, make_decoder, make_encoder

log = logging.getLogger(__name__)


class CreditSource(Protocol):
    """Decides how many new groups may start (see `streamrl.queues.admission.Admission`)."""

    version: int

    def available(self) -> int: ...
    def granted(self, num_groups: int) -> None: ...
    def returned(self) -> None: ...
    def revoked(self, num_groups: int) -> None: ...
    def discarded(self, num_groups: int = 1) -> None: ...


class UnlimitedCredits:
    """A CreditSource bounded only by a window of groups in flight (transport tests, benches)."""

    def __init__(self, window: int = 1024) -> None:
        self.window = window
        self.version = 0
        self.in_flight = 0

    def available(self) -> int:
        return self.window - self.in_flight

    def granted(self, num_groups: int) -> None:
        self.in_flight += num_groups

    def returned(self) -> None:
        self.in_flight -= 1

    def revoked(self, num_groups: int) -> None:
        self.in_flight -= num_groups

    def discarded(self, num_groups: int = 1) -> None:
        pass


@dataclass
class _Session:
    identity: bytes
    session: str
    want: int
    outstanding: int = 0
    announced_version: int = -1

    def room(self) -> int | None:
        return None if self.want == 0 else max(0, self.want - self.outstanding)


@dataclass
class ReceiverStats:
    num_groups: int = 0
    num_duplicates: int = 0
    num_bad_frames: int = 0
    num_reports: int = 0
    num_sessions: int = 0
    num_fatal: int = 0


class StreamReceiver:
    """Buffer side of the stream. `on_group` is called once per new group id."""

    def __init__(
        self,
        address: str,
        *,
        credits: CreditSource,
        on_group: Callable[[Group], None],
        on_report: Callable[[Report], None] | None = None,
        on_fatal: Callable[[Fatal], None] | None = None,
    ) -> None:
        self.address = address
        self.credits = credits
        self.on_group = on_group
        self.on_report = on_report
        self.on_fatal = on_fatal
        self.stats = ReceiverStats()
        self.bound_address = ""
        self._sessions: dict[bytes, _Session] = {}
        self._seen: set[str] = set()
        self._encoder = make_encoder()
        self._decoder = make_decoder(ToReceiver)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._stopped = False

    def bind(self) -> str:
        """Bind now (port 0 picks a free one); returns the address senders connect to."""
        if not self.bound_address:
            if self.address.endswith(":0"):
                port = self._socket.bind_to_random_port(self.address.rsplit(":", 1)[0])
                self.bound_address = f"{self.address.rsplit(':', 1)[0]}:{port}"
            else:
                self._socket.bind(self.address)
                self.bound_address = self.address
        return self.bound_address

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self.bind()
        task_status.started(self.bound_address)
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                await self._handle(frames)
        finally:
            self._socket.close(0)
            self._context.term()

    def has_seen(self, group_id: str) -> bool:
        return group_id in self._seen

    async def grant(self) -> None:
        """Hand out whatever the credit source allows, fairly across sessions."""
        if self._stopped:
            return
        available = self.credits.available()
        sessions = sorted(self._sessions.values(), key=lambda s: s.outstanding)
        while available > 0 and sessions:
            progressed = False
            for session in sessions:
                room = session.room()
                if available <= 0:
                    break
                if room == 0:
                    continue
                # Spread credits: at most an even share per pass for unlimited senders.
                share = max(1, available // len(sessions))
                num = min(available, share if room is None else min(room, share))
                session.outstanding += num
                available -= num
                self.credits.granted(num)
                await self._send_credit(session, num)
                progressed = True
            if not progressed:
                break
        for session in self._sessions.values():
            if session.announced_version < self.credits.version:
                await self._send_credit(session, 0)

    async def _send_credit(self, session: _Session, num_groups: int) -> None:
        session.announced_version = self.credits.version
        await self._send(session.identity, Credit(num_groups, self.credits.version))

    async def request_in_flight(self, step: int) -> int:
        """Ask every sender for its groups in flight (`CollectInFlight`); returns how many were
        asked."""
        for session in self._sessions.values():
            await self._send(session.identity, CollectInFlight(step))
        return len(self._sessions)

    async def stop(self, reason: str = "") -> None:
        """Tell every sender to stop starting groups; groups already sent are still received."""
        self._stopped = True
        for session in self._sessions.values():
            await self._send(session.identity, Stop(reason))

    async def _handle(self, frames: list) -> None:
        if len(frames) != 2:
            self._bad_frame(f"{len(frames)} frames")
            return
        identity, payload = frames[0].bytes, frames[1].buffer
        try:
            message = self._decoder.decode(payload)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            self._bad_frame(str(exc))
            return
        if isinstance(message, Group):
            await self._on_group(identity, message)
        elif isinstance(message, Hello):
            await self._on_hello(identity, message)
        elif isinstance(message, Report):
            self.stats.num_reports += 1
            if self.on_report is not None:
                self.on_report(message)
        elif isinstance(message, Fatal):
            self.stats.num_fatal += 1
            sender = identity.decode(errors="replace")
            log.info("rollout stream: %s reports an error a restart would repeat", sender)
            if self.on_fatal is not None:
                self.on_fatal(message)
            await self._send(identity, Stop("fatal"))

    async def _on_hello(self, identity: bytes, hello: Hello) -> None:
        old = self._sessions.get(identity)
        if old is not None and old.session == hello.session:
            return
        if old is not None and old.outstanding:
            log.warning(
                "sender %s restarted: revoking %d credits", hello.sender_id, old.outstanding
            )
            self.credits.revoked(old.outstanding)
        self.stats.num_sessions += 1
        self._sessions[identity] = _Session(identity, hello.session, hello.want)
        if self._stopped:
            await self._send(identity, Stop("receiver stopped"))
        else:
            await self.grant()

    async def _on_group(self, identity: bytes, group: Group) -> None:
        session = self._sessions.get(identity)
        used_credit = session is not None and session.outstanding > 0
        if used_credit:
            session.outstanding -= 1
            self.credits.returned()
        if group.group_id in self._seen:
            # A resend after a restart: the credit it used comes back, the group does not count.
            self.stats.num_duplicates += 1
            if used_credit:
                self.credits.discarded()
        else:
            self._seen.add(group.group_id)
            self.stats.num_groups += 1
            self.on_group(group)
        await self._send(identity, Ack([group.group_id]))
        await self.grant()

    def _bad_frame(self, why: str) -> None:
        self.stats.num_bad_frames += 1
        log.warning("rollout stream: dropped an undecodable frame (%s)", why[:200])

    async def _send(self, identity: bytes, message: ToSender) -> None:
        await self._socket.send_multipart([identity, self._encoder.encode(message)])
