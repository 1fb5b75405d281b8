"""The embedded engine's process: `streamrl engine serve` (one `EngineServer` on one port).

It imports nothing of the trainer: the options come whole as flags generated
from `EngineOptions`, which is also what the launcher builds from `[engine]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

from aiohttp import web

from streamrl.engine.options import EngineOptions
from streamrl.process import die_with_parent, free_port, no_full_collections, streamrl_argv

logger = logging.getLogger(__name__)

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class _DropHttp2Probe(logging.Filter):
    """sglang-router first probes workers with an HTTP/2 preface; aiohttp logs a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


def serve_command(args) -> int:
    """Entry point of `streamrl engine serve` (flags: `EngineOptions.add_arguments`)."""
    try:
        options = EngineOptions.from_namespace(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The engine thread and the HTTP thread share the GIL: after a device step the engine
    # thread must get it back at once, not after Python's default 5 ms.
    sys.setswitchinterval(options.switch_interval_ms / 1e3)
    # Blocked before any thread starts (importing torch starts one, so `serve` imports the
    # engine, not this module's top), so that every thread inherits the mask: SIGTERM and
    # SIGINT are then only ever taken by `_take_stop_signals`, and a second one during the
    # shutdown is taken and ignored. With handlers instead, there are moments (before they
    # are installed, between removing them and ignoring the signal, after the loop closes)
    # when the default action kills the process with -15 in place of exit code 0.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if options.http_processes > 1 and options.http_process == "off" and not options.bridge:
        print("error: --http-processes above 1 needs --http-process on or auto",
              file=sys.stderr)  # fmt: skip
        return 2
    main = serve_sibling if options.front_index else serve_split if _splits(options) else serve
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(main(options))


def _splits(options: EngineOptions) -> bool:
    """Whether this process answers HTTP only, with the model in a child (`--http-process`)."""
    if options.bridge or options.http_process == "off":
        return False
    if options.http_process == "on" or options.http_processes > 1:
        return True
    from streamrl.models import devices  # imports torch, which starts a thread

    return devices.resolve_device(options.device).type == "cuda"


def _take_stop_signals(loop: asyncio.AbstractEventLoop, on_signal) -> None:
    """Wait for the (blocked) stop signals for the life of the process: each one calls
    `on_signal` on the loop; once the loop is closed, later ones are simply taken."""
    while True:
        signum = signal.sigwait(STOP_SIGNALS)
        logger.info("received %s", signal.Signals(signum).name)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to stop
            loop.call_soon_threadsafe(on_signal)


def event_loop_factory():
    """uvloop's event loop when it is installed (its transports and cross-thread wake-ups
    are C code), else asyncio's; None means asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve(options: EngineOptions) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0), or until loading the model fails (1).
    The caller has blocked STOP_SIGNALS in every thread (`serve_command`). With
    `options.bridge` (the engine process of a split engine) generation is also served to
    the HTTP process over ZeroMQ (`streamrl.engine.bridge`)."""
    with no_full_collections():  # until loaded (then `freeze_loaded_objects` collects once)
        from streamrl.engine.app import EngineServer  # imports torch, which starts a thread

        server = EngineServer(options)
        logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
        runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, options.host, options.port)
        await site.start()
        stop = _stop_event()
        load = asyncio.create_task(server.load())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    bridge = None
    if load.done() and load.exception() is not None:
        logger.error("loading the engine failed", exc_info=load.exception())
        exit_code = 1
    elif load.done():
        if options.bridge:
            from streamrl.engine.bridge import CoreBridge

            bridge = CoreBridge(server.core, options.bridge, options.http_processes)
            bridge.start()
            server.bridge = bridge
        logger.info(
            "engine ready at http://%s:%d (model %s)", options.host, options.port, options.model
        )
        await stopping
    else:
        load.cancel()
    logger.info("shutting down")  # a second signal only sets `stop` again
    await server.close()
    if bridge is not None:
        await bridge.close()
    await runner.cleanup()
    return exit_code


async def serve_split(options: EngineOptions) -> int:
    """`serve` split in two processes (`streamrl.engine.front`): this one answers HTTP, its
    child runs the model. Exit code 0 on SIGTERM/SIGINT; 1 when the child fails to load or
    exits on its own (a dead engine is never served as a live one)."""
    from streamrl.engine.front import FrontServer  # imports torch, which starts a thread

    front = FrontServer(options, engine_port=free_port())
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
    runner = web.AppRunner(front.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port, reuse_port=options.http_processes > 1)
    await site.start()
    stop = _stop_event()
    # Its output goes to this process's; started from the event loop's (main) thread, as
    # PDEATHSIG follows the thread that forked.
    engine = subprocess.Popen(
        streamrl_argv("engine", "serve", *front.engine_options().to_argv()),
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )

    def start_sibling(sibling_options: EngineOptions) -> subprocess.Popen:
        return subprocess.Popen(
            streamrl_argv("engine", "serve", *sibling_options.to_argv()),
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )  # on the event loop's (main) thread, as the engine's: PDEATHSIG follows it

    start = asyncio.create_task(front.start(engine, start_sibling=start_sibling))
    ending = [asyncio.create_task(stop.wait()), asyncio.create_task(front.engine_exit.wait())]
    await asyncio.wait([start, *ending], return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if start.done() and start.exception() is not None:
        logger.error("starting the engine process failed: %s", start.exception())
        exit_code = 1
    elif start.done():
        logger.info(
            "engine ready at http://%s:%d (model %s; HTTP in process %s, the model in %d)",
            options.host, options.port, options.model,
            ", ".join(str(pid) for pid in [os.getpid(), *(p.pid for p in front.siblings)]),
            front.engine.pid,
        )  # fmt: skip
        await asyncio.wait(ending, return_when=asyncio.FIRST_COMPLETED)
        if front.engine_exit.is_set() and not stop.is_set():
            exit_code = 1  # the engine process died on its own
    else:
        start.cancel()
        if front.engine_exit.is_set() and not stop.is_set():
            exit_code = 1
    logger.info("shutting down")
    await front.close()
    await runner.cleanup()
    for task in ending:
        task.cancel()
    return exit_code


async def serve_sibling(options: EngineOptions) -> int:
    """One of the other HTTP processes of `--http-processes` (started by the first one, which
    it dies with): attach to the engine process, say so, and bind the public port once the
    first one says all are attached. Exit code 0 on SIGTERM/SIGINT, 1 if attaching fails."""
    from streamrl.engine.front import FrontServer  # imports torch, which starts a thread

    front = FrontServer(options, engine_port=options.engine_port)
    stop = _stop_event()
    attach = asyncio.create_task(_attach_sibling(front))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([attach, stopping], return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    runner = None
    if attach.done() and attach.exception() is not None:
        logger.error("HTTP process %d failed to attach: %s", front.index, attach.exception())
        exit_code = 1
    elif attach.done():
        logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
        runner = web.AppRunner(front.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, options.host, options.port, reuse_port=True).start()
        front.is_ready = True
        await stopping
    else:
        attach.cancel()
    await front.close()
    if runner is not None:
        await runner.cleanup()
    stopping.cancel()
    return exit_code


async def _attach_sibling(front) -> None:
    """Attach, tell the first HTTP process (a file in the bridge directory), and wait for its
    word that every HTTP process is attached (another file) before serving."""
    await front.attach()
    (front.bridge_dir / f"attached-{front.index}").touch()
    while not (front.bridge_dir / "serve").exists():
        await asyncio.sleep(0.02)


def _stop_event() -> asyncio.Event:
    """Set by SIGTERM/SIGINT (taken by a thread of its own for the life of the process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    threading.Thread(
        target=_take_stop_signals, args=(loop, stop.set), name="stop-signals", daemon=True
    ).start()
    return stop
