"""The embedded engine's process: `streamrl engine serve` (one `EngineServer` on one port).

It imports nothing of the trainer: the options come whole as flags generated
from `EngineOptions`, which is also what the launcher builds from `[engine]`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from streamrl.engine.app import EngineServer
from streamrl.engine.options import EngineOptions

logger = logging.getLogger(__name__)


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
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(serve(options))


def event_loop_factory():
    """uvloop's event loop when it is installed (its transports and cross-thread wake-ups
    are C code), else asyncio's; None means asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve(options: EngineOptions) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0), or until loading the model fails (1)."""
    server = EngineServer(options)
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    exit_code = 0
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([load, stopping], return_when=asyncio.FIRST_COMPLETED)
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
    logger.info("shutting down")
    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the shutdown
        loop.remove_signal_handler(signum)
        signal.signal(signum, signal.SIG_IGN)
    await server.close()
    await runner.cleanup()
    return exit_code
