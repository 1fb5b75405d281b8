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

import signal
import sys
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
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    trainer = Trainer(cfg, resume=args.resume)
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


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


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
