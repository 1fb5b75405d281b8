"""The embedded engine's memory handoff: SGLang's colocated-training endpoints.

    /release_memory_occupation  {"tags": [...] | null}  free weights, KV cache, CUDA graphs
    /resume_memory_occupation   {"tags": [...] | null}  take them back (weights as zeros)

Tags are SGLang's (`weights`, `kv_cache`, `cuda_graph`); none or an empty list means all
three. What each frees, and why the runner's tensors stay the same objects, is in
`streamrl.engine.runner.occupation`. As with SGLang started with `--enable-memory-saver`
(and without `--enable-weights-cpu-backup`), released weights are not kept anywhere: the
trainer pushes new ones after every resume. Unlike SGLang, which answers such calls with
garbage (token 0 everywhere), the embedded engine refuses `/generate` with HTTP 400 while
any region is released, and after a resume of the weights until an update has loaded
weights; calls held at a pause gate wait as usual and are checked when it opens.

A release while requests run or wait is refused (400; SGLang asserts it never happens):
the trainer pauses with mode `abort` first. Both answer 200 with `{"success": true,
"message", "released_bytes"}` (streamrl's addition: SGLang answers an empty body).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp import web

from streamrl.engine.core import EngineCore, MemoryBusy
from streamrl.engine.protocol import BadRequest, json_response, read_json
from streamrl.engine.runner.occupation import parse_tags

logger = logging.getLogger(__name__)


class MemoryEndpoints:
    """Release and resume over one `EngineCore` (`core()` once loaded)."""

    def __init__(self, core: Callable[[], EngineCore]) -> None:
        self._core = core

    def routes(self) -> list[tuple[str, Callable]]:
        """(path, handler) of every route here (SGLang answers GET and POST on both)."""
        return [
            ("/release_memory_occupation", self.release_memory_occupation),
            ("/resume_memory_occupation", self.resume_memory_occupation),
        ]

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _tags(await _body(request))
        started = time.perf_counter()
        try:
            freed = await self._core().release_memory(tags)
        except MemoryBusy as exc:
            raise BadRequest(str(exc)) from None
        elapsed_s = time.perf_counter() - started
        logger.info("released %s (%.0f MB) in %.3f s", ", ".join(tags), freed / 1e6, elapsed_s)
        return json_response(
            {"success": True, "message": f"released {', '.join(tags)}", "released_bytes": freed}
        )

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _tags(await _body(request))
        started = time.perf_counter()
        try:
            await self._core().resume_memory(tags)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        logger.info("resumed %s in %.3f s", ", ".join(tags), time.perf_counter() - started)
        return json_response({"success": True, "message": f"resumed {', '.join(tags)}"})


async def _body(request: web.Request) -> dict:
    """The JSON body, or {} for a GET (read_json gives {} for an empty POST)."""
    return {} if request.method == "GET" else await read_json(request)


def _tags(body: dict) -> tuple[str, ...]:
    try:
        return parse_tags(body.get("tags"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
