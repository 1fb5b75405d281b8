"""Messages of the rollout stream (rollout workers -> buffer), msgpack on ZeroMQ.

    sender                                   receiver
      Hello(sender_id, session, want)  ──►    registers the session
                                       ◄──    Credit(n, version)   n more groups may start
      Group(...)                       ──►    de-duplicated by group_id, handed to the buffer
                                       ◄──    Ack(group_ids)       sender forgets them
      Report(kind, payload)            ──►    evaluation results, rollout counters
                                       ◄──    Stop()               no more groups are wanted
                                       ◄──    CollectInFlight(step)  report the groups in flight
      Report("in_flight", ...)         ──►    (their tokens so far: a checkpoint)
      Fatal(reason, error, ...)        ──►    the run stops: a restart cannot fix this
                                       ◄──    Stop("fatal")        (the sender may exit)

A credit is permission to *start* one group (admission control, AReaL's
staleness rule) and reserves the buffer slot it will occupy, so a sender never
has a finished group it may not send. Unacked groups are resent after a
reconnect; the receiver acks duplicates without storing them again. A `Fatal`
travels after the sender's last groups and report, so the trainer has counted them
when it stops the run.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamrl.types import Group


class Hello(msgspec.Struct, tag="hello"):
    sender_id: str
    """Stable name of the rollout worker."""
    session: str
    """Random per process start; a new session revokes the old one's credits."""
    want: int = 0
    """Groups the sender can have in flight; 0 means as many as admission allows."""


class Credit(msgspec.Struct, tag="credit"):
    num_groups: int
    version: int
    """Weight version the engines serve (the one admission used)."""


class Ack(msgspec.Struct, tag="ack"):
    group_ids: list[str]


class Report(msgspec.Struct, tag="report"):
    kind: str
    """`eval` (an evaluation result) or `rollout` (counters of the rollout worker)."""
    payload: dict[str, Any]


class Stop(msgspec.Struct, tag="stop"):
    reason: str = ""


class Fatal(msgspec.Struct, tag="fatal", kw_only=True):
    """The sender hit an error that a restart would hit again (every sample failing, a
    malformed data line): the trainer stops the run with it, and does not restart the
    sender's process. The receiver answers `Stop("fatal")` once it has taken it."""

    reason: str
    """What happened, in one line."""
    error: str = ""
    """The error as `ExceptionType: message`."""
    look_at: str = ""
    """The config keys (and logs) where the cause is."""
    traceback: str = ""
    """The formatted traceback of the (first) error, where there is one."""


class CollectInFlight(msgspec.Struct, tag="collect_in_flight"):
    """Report the groups in flight now (a checkpoint's cut at learner step `step`): the sender
    answers with `Report(kind="in_flight", payload={"step": step, "groups": [...]})`."""

    step: int


ToReceiver = Hello | Group | Report | Fatal
ToSender = Credit | Ack | Stop | CollectInFlight
