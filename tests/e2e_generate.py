"""Generate functions for end-to-end tests (importable by child processes)."""

from __future__ import annotations

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.types import Prompt


async def always_raises(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """A generate function with a bug that every call hits."""
    raise RuntimeError(f"this generate function always fails (prompt {prompt.seq})")
