"""Generate functions for end-to-end tests (importable by child processes)."""

from __future__ import annotations

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.types import Prompt


async def always_raises(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """A generate function with a bug that every call hits."""
    raise RuntimeError(f"this generate function always fails (prompt {prompt.seq})")


async def exits_the_process(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """A generate function that takes the rollout process down with it (a crash, not an
    error: the trainer sees the process die and restarts it)."""
    import os
    import sys

    print("exits_the_process: the rollout process ends here", file=sys.stderr, flush=True)
    os._exit(3)
