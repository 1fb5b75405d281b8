"""Pipeline stages 1..PP-1 publish their own layers, each from its own learner rank.

With pipeline parallelism no rank holds the whole model: stage s's publisher
(TP rank 0 of DP replica 0 of stage s) is rank 0 of its own weight-update
group, over the same engines as every other stage (`streamrl.weights.layout`).
Rank 0 of the learner (the `WeightPublisher`, stage 0's publisher) stays the
one that talks HTTP to the engines; the other stage publishers only snapshot
and broadcast, when rank 0 tells them to:

    rank 0 (WeightPublisher)                       stage s publisher (a follower rank)
    publish(v), training paused:
      announce SNAPSHOT v ──default group──────►   hf_weights() -> staging buckets (version v)
      StagePlan of stage s ◄──default group─────   bucket names, dtypes, shapes; control address
    behind the next training step (ZeroMQ DEALER -> REP, one request at a time per stage):
      Rendezvous ──────────────────────────────►   its host and a port free there
      Host(group, host:port) + engines' init ──►   host the stage's group as its rank 0
      Send(group, v, i) + engines' update calls ►   broadcast bucket i of version v
      Drop(group) ─────────────────────────────►   destroy the group (engine set changed)

The stage publisher answers each request once the collective has finished (or
failed), so rank 0 sees an engine that died mid-update as a failed request.
The serving thread runs next to the follower's training loop and touches only
the stage's own weight-update group, never the learner's groups.

The stage publisher's `host` is the address of its own machine that rank 0 and
the engines reach: its Ray node's IP when Ray placed it (`STREAMRL_NODE_IP`),
else `weights.master_address` (the follower decides, `streamrl.mains.follower`).
Its control socket binds there, and each stage group's rendezvous is there too,
on a port the stage found free (`Rendezvous`), so stages on other nodes work.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from streamrl.process import free_port
from streamrl.weights.digest import digest
from streamrl.weights.group import (
    broadcast_flat,
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
)
from streamrl.weights.staging import Bucket, Staging

log = logging.getLogger(__name__)


class BucketSpec(msgspec.Struct, frozen=True):
    """One bucket's tensors, as the engines' `/update_weights_from_distributed` names them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    digest: str = ""
    """`streamrl.weights.digest` of the bucket's bytes, computed on the stage's device."""


class StagePlan(msgspec.Struct, frozen=True):
    """What a stage publisher staged: rank 0 drives the stage's broadcast from this."""

    stage: int
    version: int
    address: str
    """The stage publisher's control socket (ZeroMQ REP)."""
    buckets: list[BucketSpec]
    num_bytes: int


class Host(msgspec.Struct, frozen=True, tag=True):
    """Host `group_name` as its rank 0; answered once every engine rank has joined."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    backend: str


class Send(msgspec.Struct, frozen=True, tag=True):
    """Broadcast bucket `index` of the staged snapshot `version` into `group_name`: as one
    flat uint8 tensor (`load_format = "flattened_bucket"`) or one broadcast per tensor."""

    group_name: str
    version: int
    index: int
    is_flattened: bool = True


class Drop(msgspec.Struct, frozen=True, tag=True):
    """Destroy `group_name` (a no-op if this stage does not hold it)."""

    group_name: str


class Rendezvous(msgspec.Struct, frozen=True, tag=True):
    """Answer the stage's host and a port free there, for the next group it will `Host`."""


StageRequest = Host | Send | Drop | Rendezvous


class StageReply(msgspec.Struct, frozen=True):
    is_ok: bool
    message: str = ""
    host: str = ""
    """`Rendezvous`: the stage's host (where its groups' rendezvous listens)."""
    port: int = 0
    """`Rendezvous`: a port free on `host` a moment ago."""


@dataclass
class _Staged:
    version: int
    buckets: list[Bucket]


class StageServer:
    """A stage publisher's side (stage >= 1): stages snapshots, serves rank 0's requests.

    `take()` runs in the follower's main thread (inside the announced SNAPSHOT
    call); requests are served by one thread owned by this object, from
    `start()` to `close()`."""

    def __init__(self, stage: int, device: torch.device, host: str = "127.0.0.1") -> None:
        self.stage = stage
        self.device = device
        self.host = host
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop_address = f"inproc://stage-{stage}-stop-{id(self)}"
        self._stop_receiver = self._context.socket(zmq.PAIR)
        self._stop_receiver.bind(self._stop_address)
        self._staging: Staging | None = None
        self._staged: _Staged | None = None
        self._lock = threading.Lock()
        self._groups: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._decoder = msgspec.msgpack.Decoder(StageRequest)
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"stage-{self.stage}-publisher")
        self._thread.start()

    def close(self) -> None:
        """Stop serving (after the request in progress), destroy held groups, close sockets."""
        if self._thread is not None:
            stopper = self._context.socket(zmq.PAIR)
            stopper.setsockopt(zmq.LINGER, 0)
            stopper.connect(self._stop_address)
            stopper.send(b"")
            self._thread.join()
            stopper.close()
            self._thread = None
        for name in list(self._groups):
            self._drop(name)
        self._socket.close()
        self._stop_receiver.close()
        self._context.term()

    def take(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        bucket_bytes: int,
        staging: str,
    ) -> StagePlan:
        """Pack this stage's tensors into its staging buffers as `version` (the way rank 0
        packs stage 0's); the plan for rank 0.

        Rank 0 asks for no broadcast while a snapshot is taken, so no broadcast reads
        the buffers while they are overwritten."""
        device = str(self.device) if staging == "cuda" else "cpu"
        if self._staging is None or (self._staging.bucket_bytes, self._staging.device) != (
            bucket_bytes,
            device,
        ):
            self._staging = Staging(bucket_bytes, device)
        with self._lock:
            self._staged = None  # until packed: a Send now is refused, not served half-written
        buckets = self._staging.pack(weights)
        with self._lock:
            self._staged = _Staged(version, buckets)
        specs = [
            BucketSpec(bucket.names, bucket.dtypes, bucket.shapes, digest([bucket.flat]))
            for bucket in buckets
        ]
        num_bytes = sum(bucket.layout.num_bytes for bucket in buckets)
        return StagePlan(self.stage, version, self.address, specs, num_bytes)

    # ---- the serving thread ------------------------------------------------

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_receiver, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_receiver in ready:
                return
            *request_id, payload = self._socket.recv_multipart()
            try:
                reply = self._handle(self._decoder.decode(payload))
            except Exception as exc:  # the reply carries it to rank 0, which fails the update
                log.exception("stage %d: request failed", self.stage)
                reply = StageReply(is_ok=False, message=f"{type(exc).__name__}: {exc}")
            self._socket.send_multipart([*request_id, self._encoder.encode(reply)])

    def _handle(self, request: StageRequest) -> StageReply:
        if isinstance(request, Rendezvous):
            return StageReply(True, host=self.host, port=free_port(self.host))
        if isinstance(request, Host):
            if request.group_name in self._groups:
                return StageReply(False, f"stage {self.stage} already holds {request.group_name}")
            self._groups[request.group_name] = init_weight_update_group(
                master_address=request.master_address,
                master_port=request.master_port,
                rank=0,
                world_size=request.world_size,
                group_name=request.group_name,
                backend=request.backend,
            )
            return StageReply(True)
        if isinstance(request, Send):
            with self._lock:
                staged = self._staged
            if staged is None or staged.version != request.version:
                held = None if staged is None else staged.version
                return StageReply(
                    False, f"stage {self.stage} holds version {held}, not {request.version}"
                )
            group = self._groups.get(request.group_name)
            if group is None:
                return StageReply(False, f"stage {self.stage} holds no {request.group_name}")
            bucket = staged.buckets[request.index]
            if request.is_flattened:
                broadcast_flat(group, bucket.flat)
            else:
                broadcast_tensors(group, bucket.layout.unpack(bucket.flat))
            return StageReply(True)
        self._drop(request.group_name)
        return StageReply(True)

    def _drop(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            destroy_weight_update_group(group)


class RemoteStages:
    """Rank 0's handle on the publishers of stages 1..PP-1 (see the module docstring).

    `leader` is `streamrl.backends.ranks.Leader`; `snapshot` and `plans`
    run in the publisher's worker thread while training waits, the async
    requests in its event loop."""

    def __init__(self, leader: Any, *, staging: str = "cpu") -> None:
        self.leader = leader
        self.staging = staging
        self._context = zmq.asyncio.Context()
        self._addresses: dict[int, str] = {}
        self._request_ids = itertools.count()
        self._sockets: dict[int, tuple[str, zmq.asyncio.Socket]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StageReply)

    def snapshot(self, version: int, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage stages `version`; yields stage 0's tensors (exhaust it, then `plans`)."""
        return self.leader.snapshot(version, bucket_bytes=bucket_bytes, staging=self.staging)

    def plans(self, version: int) -> list[StagePlan]:
        """The plans of stages 1..PP-1, in stage order, each checked to be at `version`."""
        plans = [
            msgspec.msgpack.decode(frame, type=StagePlan) for frame in self.leader.stage_plans()
        ]
        for expected, plan in enumerate(plans, start=1):
            if plan.stage != expected or plan.version != version:
                raise RuntimeError(
                    f"stage publisher sent stage {plan.stage} at version {plan.version}, "
                    f"expected stage {expected} at version {version}"
                )
            self._addresses[plan.stage] = plan.address
        return plans

    async def rendezvous(self, stage: int) -> tuple[str, int]:
        """Where `stage` will host its next group: its host and a port free there."""
        reply = await self.request(stage, Rendezvous())
        return reply.host, reply.port

    async def request(self, stage: int, request: StageRequest) -> StageReply:
        """Send `request` to `stage`'s publisher and wait for its answer; RuntimeError if it
        failed. Needs a plan of that stage first (its address).

        Cancelling the wait is safe: each request carries an id, the answer to a
        request nobody waits for any more is dropped, and the stage serves the
        next request once the current one has finished."""
        socket = self._socket(stage)
        request_id = next(self._request_ids).to_bytes(8, "little")
        await socket.send_multipart([b"", request_id, self._encoder.encode(request)])
        while True:
            *envelope, payload = await socket.recv_multipart()
            if envelope == [b"", request_id]:
                break
            log.info("pipeline stage %d: dropped the answer to an abandoned request", stage)
        reply = self._decoder.decode(payload)
        if not reply.is_ok:
            raise RuntimeError(f"pipeline stage {stage}: {reply.message}")
        return reply

    def _socket(self, stage: int) -> zmq.asyncio.Socket:
        if stage not in self._addresses:
            raise RuntimeError(f"pipeline stage {stage} has sent no snapshot plan yet")
        address, socket = self._sockets.get(stage, ("", None))
        if socket is None or address != self._addresses[stage]:
            if socket is not None:
                socket.close()
            address = self._addresses[stage]
            socket = self._context.socket(zmq.DEALER)  # never stuck on an unanswered request
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._sockets[stage] = (address, socket)
        return socket

    def close(self) -> None:
        for _, socket in self._sockets.values():
            socket.close()
        self._sockets.clear()
        self._context.term()
