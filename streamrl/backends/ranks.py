"""Several learner processes behind one LearnerBackend: rank 0 leads, the others follow.

Rank 0 (the `streamrl run` process) holds the buffer and runs the training
loop. Every backend call it makes is announced to the other ranks first, as a
small msgpack frame broadcast from rank 0 over the default process group, so
each follower makes the same call in the same order with no data of its own
(the backend moves the micro-batches from rank 0 to the ranks that need them):

    rank 0:  Leader.train_mini_batch(mbs) ─ announce TRAIN ─► backend.train_mini_batch(mbs)
    rank k:  follow(): receive TRAIN ─────────────────────► backend.train_mini_batch([])

With pipeline parallelism, SNAPSHOT (the weight publisher's snapshot) also makes
each other stage's publisher stage its layers and send rank 0 its plan; those
stages then broadcast when rank 0 asks (`streamrl.weights.stages`). A backend with a
critic (`algorithm.advantage_estimator = "gae"`) has its calls announced the same way
(VALUES, TRAIN_CRITIC) through `Leader.critic`.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from streamrl.backends.base import LearnerBackend, LossFn, MicroBatch

log = logging.getLogger(__name__)

_FRAME_BYTES = 4096


class Op(enum.StrEnum):
    LOGPROBS = "logprobs"
    TRAIN = "train"
    WEIGHTS = "weights"
    SAVE = "save"
    STAGE_CHECKPOINT = "stage_checkpoint"
    LOAD = "load"
    STOP = "stop"
    SNAPSHOT = "snapshot"
    VALUES = "values"
    TRAIN_CRITIC = "train_critic"
    OFFLOAD = "offload"
    RELOAD = "reload"


class Command(msgspec.Struct, frozen=True):
    op: Op
    temperature: float = 1.0
    reference: bool = False
    need_entropy: bool = False
    path: str = ""
    version: int = 0
    bucket_bytes: int = 0
    staging: str = "cpu"
    """Device type of the stage publishers' snapshot copies: `cpu` or `cuda` (their own GPU);
    for STAGE_CHECKPOINT, `train.checkpoint_staging`."""
    part: str = ""
    """OFFLOAD: what goes to host memory (`optimizer` or `parameters`)."""


def _device() -> torch.device:
    backend = dist.get_backend()
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def announce(command: Command) -> None:
    """Rank 0: tell every other rank which call comes next."""
    payload = msgspec.msgpack.encode(command)
    if len(payload) > _FRAME_BYTES - 4:
        raise ValueError(f"command frame too large ({len(payload)} bytes)")
    frame = torch.zeros(_FRAME_BYTES, dtype=torch.uint8)
    frame[:4] = torch.tensor(list(len(payload).to_bytes(4, "little")), dtype=torch.uint8)
    frame[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    frame = frame.to(_device())
    dist.broadcast(frame, src=0)


def receive() -> Command:
    """Ranks > 0: wait for rank 0's next command."""
    frame = torch.empty(_FRAME_BYTES, dtype=torch.uint8, device=_device())
    dist.broadcast(frame, src=0)
    data = frame.cpu().numpy().tobytes()
    size = int.from_bytes(data[:4], "little")
    return msgspec.msgpack.decode(data[4 : 4 + size], type=Command)


def send_bytes(payload: bytes, dst: int) -> None:
    """Point to point over the default group: the size, then the bytes."""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=_device())
    dist.send(size, dst=dst)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_device())
    dist.send(data, dst=dst)


def recv_bytes(src: int) -> bytes:
    """What `send_bytes` sent from `src`."""
    size = torch.empty(1, dtype=torch.int64, device=_device())
    dist.recv(size, src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())
    dist.recv(data, src=src)
    return data.cpu().numpy().tobytes()


class Leader:
    """Rank 0's view of a multi-process backend: announce, then call."""

    def __init__(self, backend: LearnerBackend) -> None:
        self.backend = backend
        self.tokenizer = getattr(backend, "tokenizer", None)
        critic = getattr(backend, "critic", None)
        self.critic = None if critic is None else LeaderCritic(critic)
        """The backend's critic behind announced calls (None without one)."""

    @property
    def is_publisher(self) -> bool:
        return self.backend.is_publisher

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def compute_logprobs(
        self, micro_batches: list[MicroBatch], *, temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        announce(Command(Op.LOGPROBS, temperature=temperature, reference=reference))
        return self.backend.compute_logprobs(
            micro_batches, temperature=temperature, reference=reference
        )

    def train_mini_batch(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        need_entropy: bool,
    ) -> dict[str, float]:
        announce(Command(Op.TRAIN, temperature=temperature, need_entropy=need_entropy))
        return self.backend.train_mini_batch(
            micro_batches, loss_fn, temperature=temperature, need_entropy=need_entropy
        )

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        announce(Command(Op.WEIGHTS))
        yield from self.backend.hf_weights()

    @property
    def stage_publisher_ranks(self) -> list[int]:
        """Global ranks of the publishers of pipeline stages 1..PP-1 (empty without PP)."""
        layout = getattr(self.backend, "layout", None)
        if layout is None:
            return []
        return [
            layout.global_rank(tp_rank=0, dp_rank=0, pp_rank=stage)
            for stage in range(1, layout.pp_size)
        ]

    def snapshot(
        self, version: int, *, bucket_bytes: int, staging: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like `hf_weights`, and every other stage's publisher stages its layers as `version`
        (collect their plans with `stage_plans` after exhausting this)."""
        announce(Command(Op.SNAPSHOT, version=version, bucket_bytes=bucket_bytes, staging=staging))
        yield from self.backend.hf_weights()

    def stage_plans(self) -> list[bytes]:
        """The encoded `StagePlan` of stages 1..PP-1, in stage order (after `snapshot`)."""
        return [recv_bytes(rank) for rank in self.stage_publisher_ranks]

    def save(self, path: Path) -> None:
        announce(Command(Op.SAVE, path=str(path)))
        self.backend.save(path)

    def stage_checkpoint(self, path: Path, *, staging: str = "host") -> Callable[[], None]:
        """Every rank copies its part of the checkpoint; each writes it in a thread of its
        own (rank 0: the function returned, which returns once every rank's is written)."""
        announce(Command(Op.STAGE_CHECKPOINT, path=str(path), staging=staging))
        return self.backend.stage_checkpoint(path, staging=staging)

    def load(self, path: Path) -> None:
        announce(Command(Op.LOAD, path=str(path)))
        self.backend.load(path)

    def offload_to_host(self, part: str) -> float:
        announce(Command(Op.OFFLOAD, part=part))
        return self.backend.offload_to_host(part)

    def reload_from_host(self) -> float:
        announce(Command(Op.RELOAD))
        return self.backend.reload_from_host()

    def close(self) -> None:
        announce(Command(Op.STOP))


class LeaderCritic:
    """Rank 0's view of the critic of a multi-process backend: announce, then call."""

    def __init__(self, critic) -> None:
        self.critic = critic

    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        announce(Command(Op.VALUES))
        return self.critic.compute_values(micro_batches)

    def train_mini_batch(self, micro_batches: list[MicroBatch], loss_fn) -> dict[str, float]:
        announce(Command(Op.TRAIN_CRITIC))
        return self.critic.train_mini_batch(micro_batches, loss_fn)


def follow(
    backend: LearnerBackend,
    loss_fn: LossFn,
    *,
    value_loss_fn=None,
    stage_host: str = "127.0.0.1",
) -> None:
    """Ranks > 0: mirror rank 0's calls until it says stop (`value_loss_fn`: the critic's
    loss, `streamrl.backends.step.make_value_loss_fn`, for a backend with a critic).

    The publisher of a pipeline stage > 0 also serves that stage's broadcasts
    (a `StageServer` thread, reached at `stage_host`: this machine's address that rank 0
    and the engines reach) for as long as it follows."""
    stage = _stage_server(backend, stage_host)
    try:
        _follow(backend, loss_fn, value_loss_fn, stage)
    finally:
        if stage is not None:
            stage.close()


def _stage_server(backend: LearnerBackend, host: str):
    layout = getattr(backend, "layout", None)
    if layout is None or layout.pp_rank == 0 or not backend.is_publisher:
        return None
    from streamrl.weights.stages import StageServer

    stage = StageServer(layout.pp_rank, backend.device, host=host)
    stage.start()
    return stage


def _follow(backend: LearnerBackend, loss_fn: LossFn, value_loss_fn, stage) -> None:
    writer = _CheckpointWriter()
    try:
        _follow_commands(backend, loss_fn, value_loss_fn, stage, writer)
    finally:
        writer.wait()


def _follow_commands(backend, loss_fn, value_loss_fn, stage, writer: _CheckpointWriter) -> None:
    while True:
        command = receive()
        log.debug("follower: %s", command)
        if command.op in (Op.STOP, Op.SAVE, Op.LOAD, Op.STAGE_CHECKPOINT):
            writer.wait()  # rank 0 has waited for its own write: this one is ending
        if command.op is Op.STOP:
            return
        if command.op is Op.LOGPROBS:
            backend.compute_logprobs(
                [], temperature=command.temperature, reference=command.reference
            )
        elif command.op is Op.TRAIN:
            backend.train_mini_batch(
                [], loss_fn, temperature=command.temperature, need_entropy=command.need_entropy
            )
        elif command.op is Op.WEIGHTS or (command.op is Op.SNAPSHOT and stage is None):
            for _ in backend.hf_weights():
                pass
        elif command.op is Op.SNAPSHOT:
            plan = stage.take(
                backend.hf_weights(),
                version=command.version,
                bucket_bytes=command.bucket_bytes,
                staging=command.staging,
            )
            send_bytes(msgspec.msgpack.encode(plan), dst=0)
        elif command.op is Op.SAVE:
            backend.save(Path(command.path))
        elif command.op is Op.STAGE_CHECKPOINT:
            writer.start(backend.stage_checkpoint(Path(command.path), staging=command.staging))
        elif command.op is Op.LOAD:
            backend.load(Path(command.path))
        elif command.op is Op.VALUES:
            backend.critic.compute_values([])
        elif command.op is Op.TRAIN_CRITIC:
            backend.critic.train_mini_batch([], value_loss_fn)
        elif command.op is Op.OFFLOAD:
            backend.offload_to_host(command.part)
        elif command.op is Op.RELOAD:
            backend.reload_from_host()


class _CheckpointWriter:
    """A follower's checkpoint write in flight (at most one): its thread, and its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        def run() -> None:
            try:
                write()
            except BaseException as exc:  # raised again in this rank's main thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="checkpoint-write", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
