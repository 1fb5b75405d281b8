"""The run's rollout process, kept alive: `RolloutKeeper` starts it, watches it and starts
it again when it dies.

    RolloutKeeper.start ─► RolloutSpec (where the stream and the engines are, where the data
                           resumes) ─► the process waiting for it, or a new one
    keep_alive          ─► exit: restart (up to rollout.max_restarts), an event in
                           events.jsonl; `Fatal`: RolloutFatal at once
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from streamrl.config import RunConfig
from streamrl.events import append_event
from streamrl.mains.errors import RolloutFatal, RunError
from streamrl.mains.rollout import RolloutSpec, start_rollout, write_spec
from streamrl.process import ProcessHandle, Spawner
from streamrl.queues.accounting import position_after
from streamrl.queues.protocol import Fatal
from streamrl.types import PartialGroup, make_encoder

if TYPE_CHECKING:  # the trainer imports these once its engines are spawned
    from streamrl.actors.learner import LearnerLoop
    from streamrl.fleet.supervisor import EngineSupervisor
    from streamrl.queues.intake import Intake

log = logging.getLogger(__name__)


class RolloutKeeper:
    """The run's rollout process: started, watched, and started again when it dies.

    A new process resumes the prompt stream after every group that arrived
    (`Intake.received_seqs`), so the groups the dead one had in flight, or had sent
    without an ack that never came, are generated again, and none is trained twice
    (groups are de-duplicated by id). Its credits are revoked when the new process says
    hello. After `rollout.max_restarts` restarts a death fails the run; a `Fatal` from the
    process (an error a restart would repeat) fails it at once."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_dir: Path,
        spawner: Spawner,
        engines: EngineSupervisor,
        intake: Intake,
        loop: LearnerLoop,
        model_path: str,
        children: list[ProcessHandle],
        saved_in_flight: list[PartialGroup],
        waiting: ProcessHandle | None = None,
        tokenizer_class: str = "",
        limits: tuple[int, int] = (0, 0),
    ) -> None:
        """`children`: the trainer's list of processes to stop, which this keeps current;
        `waiting`: a rollout process already started, waiting for its spec;
        `tokenizer_class` and `limits` (`resolved_tokenizer`'s class, `known_limits`) spare
        each process the transformers code that imports torch."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.spawner = spawner
        self.engines = engines
        self.intake = intake
        self.loop = loop
        self.model_path = model_path
        self.children = children
        self.saved_in_flight = saved_in_flight
        """Groups a checkpoint saved in flight: continued first by the (next) process."""
        self.tokenizer_class = tokenizer_class
        self.limits = limits
        self.waiting = waiting
        self.process: ProcessHandle | None = None
        self.num_restarts = 0

    def start(self) -> None:
        """Start a rollout process from where the stream stands now: after every group that
        arrived, with the checkpoint's groups in flight that have not arrived continued
        first (their seqs are not handed out again)."""
        received = self.intake.received_seqs
        pending = [g for g in self.saved_in_flight if g.prompt_seq not in received]
        resume_file = ""
        if pending:
            resume_path = self.run_dir / "rollout_resume.msgpack"
            resume_path.write_bytes(make_encoder().encode(pending))
            resume_file = str(resume_path)
        done = received | {group.prompt_seq for group in pending}
        spec = RolloutSpec(
            buffer_address=self.intake.bind(),
            engine_urls=self.engines.urls,
            router_url=self.engines.router_url,
            model_path=self.model_path,
            position=position_after(done, since=self.loop.start_position),
            start_version=self.loop.version,
            resume_file=resume_file,
            vocab_size=self.limits[0],
            max_position_embeddings=self.limits[1],
        )
        if self.waiting is not None:
            # Started with the engines and waiting for its spec (if it died meanwhile,
            # `keep_alive` finds it exited and restarts it as any other).
            self.process, self.waiting = self.waiting, None
            write_spec(self.run_dir, spec)
            return
        self.process = start_rollout(
            self.spawner, self.run_dir, spec, log_level=self.cfg.logging.level,
            tokenizer_class=self.tokenizer_class,
        )  # fmt: skip
        self.children.append(self.process)

    async def keep_alive(self, scope: anyio.CancelScope) -> None:
        """Restart the process whenever it exits before `scope` is cancelled (it was told to
        stop); RunError once it has died `rollout.max_restarts` + 1 times, RolloutFatal as
        soon as it reports a `Fatal`."""
        while True:
            with scope:
                code = await self._exit_or_fatal()
            if scope.cancel_called:
                return
            child = self.process
            fatal = self.intake.fatal
            if fatal is not None:
                _event(self.run_dir, "rollout_fatal", reason=fatal.reason, code=code)
                raise RolloutFatal(_fatal_message(fatal, child))
            if self.num_restarts >= self.cfg.rollout.max_restarts:
                raise RunError(
                    f"the {child.name} process exited with code {code} during training "
                    f"(after {self.num_restarts} restarts, rollout.max_restarts); last lines "
                    f"of {child.log_path}:\n{child.log_tail()}"
                )
            self.num_restarts += 1
            log.error(
                "the rollout process exited with code %s; restarting it (restart %d): "
                "groups whose prompt has not arrived are generated again",
                code,
                self.num_restarts,
            )
            _event(
                self.run_dir,
                "rollout_restarted",
                code=code,
                restart=self.num_restarts,
                log_tail=child.log_tail(),  # why it died, kept beside the event
            )
            self.children.remove(child)
            self.start()

    async def _exit_or_fatal(self) -> int | None:
        """The process's exit code, or None as soon as it reported a `Fatal`."""
        code = None
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                nonlocal code
                code = await anyio.to_thread.run_sync(self.process.wait, abandon_on_cancel=True)
                tg.cancel_scope.cancel()

            async def fatal() -> None:
                await self.intake.fatal_arrived.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(fatal)
        return code

    async def wait_exit(self, *, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the process to exit (it was told to stop)."""
        with anyio.move_on_after(timeout_s):
            await anyio.to_thread.run_sync(self.process.wait, abandon_on_cancel=True)


def _fatal_message(fatal: Fatal, child: ProcessHandle) -> str:
    """The terminal's account of a rollout's `Fatal`: what, the error, where to look, the
    traceback."""
    lines = [f"the rollout stopped on an error a restart would repeat: {fatal.reason}"]
    if fatal.look_at:
        lines.append(f"  look at: {fatal.look_at}")
    if fatal.traceback:
        lines.append("  the first failure's traceback:")
        lines.extend(f"    {line}" for line in fatal.traceback.splitlines())
    lines.append(f"  the rollout's log: {child.log_path}")
    return "\n".join(lines)


def _event(run_dir: Path, event: str, **details) -> None:
    """A rollout event in `run_dir/events.jsonl`."""
    append_event(run_dir, {"component": "rollout", "event": event, **details})
