"""The embedded engine's process: `streamrl engine serve` (one `EngineServer` on one port).

It imports nothing of the trainer: the options come whole as flags generated
from `EngineOptions`, which is also what the launcher builds from `[engine]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading

from aiohttp import web

from streamrl.engine.options import EngineOptions
from streamrl.process import no_full_collections

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
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(serve(options))


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
    The caller has blocked STOP_SIGNALS in every thread (`serve_command`)."""
    with no_full_collections():  # until loaded (then `freeze_loaded_objects` collects once)
        from streamrl.engine.app import EngineServer  # imports torch, which starts a thread

        server = EngineServer(options)
        logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
        runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, options.host, options.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=_take_stop_signals, args=(loop, stop.set), name="stop-signals", daemon=True
        ).start()
        load = asyncio.create_task(server.load())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if load.done() and load.exception() is not None:
        logger.error("loading the engine failed", exc_info=load.exception())
        exit_code = 1
    elif load.done():
        logger.info(
            "engine ready at http://%s:%d (model %s)", options.host, options.port, options.model
        )
        await stopping
    else:
        load.cancel()
    logger.info("shutting down")  # a second signal only sets `stop` again
    await server.close()
    await runner.cleanup()
    return exit_code
