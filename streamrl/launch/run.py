"""`streamrl run CONFIG`: pick where the processes run, then run the trainer.

    streamrl run ─► load + validate the config (exit 2 on a bad key)
                 ─► refuse what cannot start (no SGLang, no Ray) before anything starts
                 ─► Trainer(spawner = LocalSpawner | RaySpawner).run()   (streamrl.mains.trainer)
                 ─► exit 0 done, 1 failed (the reason on stderr), 130 interrupted

With `cluster.launcher = "local"` every process is a child of this one (they die
with it: PDEATHSIG); with `"ray"` the engines, the rollout process and learner
ranks 1..N-1 run in Ray actors (`streamrl.launch.ray`). Either way the trainer stops every process it
started, also on Ctrl-C, SIGTERM or a failure.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

import anyio

from streamrl.config import ConfigError, RunConfig, load_config
from streamrl.mains.errors import RunError
from streamrl.mains.trainer import Trainer
from streamrl.process import ProcessDied
from streamrl.queues.accounting import AccountingError


def run_command(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Both signals raise KeyboardInterrupt in the main thread. Left to asyncio, Ctrl-C would
    # cancel the main task instead, and a cancellation absorbed on its way out (a shielded
    # scope finishing cleanup) can end the run as if it had completed: exit 0, not 130.
    trainer = Trainer(cfg, resume=args.resume)
    interrupt = _Interrupt(trainer)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        try:
            summary = anyio.run(run_trainer, trainer)
        finally:
            # Also here, outside the event loop: a KeyboardInterrupt raised in one of its
            # tasks can end `anyio.run` before the main task's `finally` stopped the children,
            # and a worker thread waiting on one would then hold the interpreter's exit.
            trainer.stop()
    except KeyboardInterrupt:
        print("streamrl: interrupted; every process stopped", file=sys.stderr)
        return 130
    except KNOWN_ERRORS as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # from a task group: the first known error is the cause
        known = _first_known(group)
        if known is None:
            raise
        print(f"streamrl: {known}", file=sys.stderr)
        return 1
    print(
        f"streamrl: done: {summary['steps']} steps, version {summary['version']}, "
        f"run dir {cfg.train.output_dir}",
        file=sys.stderr,
    )
    return 0


KNOWN_ERRORS = (RunError, ProcessDied, TimeoutError, ConfigError, AccountingError)
"""Errors whose message says what went wrong: printed without a traceback (exit 1)."""


def _first_known(group: BaseExceptionGroup) -> BaseException | None:
    for inner in group.exceptions:
        if isinstance(inner, BaseExceptionGroup):
            found = _first_known(inner)
            if found is not None:
                return found
        elif isinstance(inner, KNOWN_ERRORS):
            return inner
    return None


class _Interrupt:
    """The SIGTERM / SIGINT handler: raises KeyboardInterrupt in the main thread, and the
    first time starts a watchdog. If the run is still stopping `STOP_GRACE_S` later, the
    watchdog prints every thread's stack (what held the exit), stops the children itself,
    and ends the process with 130: an interrupted run never hangs (one was seen still
    stopping 60 s after a SIGTERM on a loaded machine)."""

    STOP_GRACE_S = 40.0
    FORCED_STOP_S = 15.0

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.watchdog: threading.Thread | None = None

    def __call__(self, signum, frame) -> None:
        if self.watchdog is None:
            self.watchdog = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)
            self.watchdog.start()
        raise KeyboardInterrupt

    def _watch(self) -> None:
        time.sleep(self.STOP_GRACE_S)
        print(
            f"streamrl: still stopping {self.STOP_GRACE_S:.0f} s after the interrupt; "
            "every thread's stack:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        stopper = threading.Thread(target=self.trainer.stop, name="forced-stop", daemon=True)
        stopper.start()
        stopper.join(self.FORCED_STOP_S)
        if stopper.is_alive():
            message = f"the forced stop did not finish in {self.FORCED_STOP_S:.0f} s; processes may remain"
        else:
            message = "every process stopped (by the watchdog)"
        print(f"streamrl: interrupted; {message}", file=sys.stderr, flush=True)
        os._exit(130)


async def run(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run training to `train.steps`; returns the summary (also written to summary.json)."""
    return await run_trainer(Trainer(cfg, resume=resume))


async def run_trainer(trainer: Trainer) -> dict[str, Any]:
    """`trainer`'s run, after refusing what cannot start; every process it started is
    stopped when it ends, however it ends (`Trainer.stop` is idempotent)."""
    cfg = trainer.cfg
    if cfg.engine.backend == "sglang":
        from streamrl.fleet.sglang import check_sglang_backend

        check_sglang_backend(cfg)  # before anything starts
    if cfg.cluster.launcher == "ray":
        from streamrl.launch.ray.spawner import require_ray

        require_ray()  # before anything starts
    try:
        trainer.prepare()
        if cfg.cluster.launcher == "ray":
            from streamrl.launch.ray.spawner import RaySpawner

            trainer.spawner = RaySpawner.start(cfg, trainer.run_dir)
        return await trainer.run()
    finally:
        trainer.stop()
