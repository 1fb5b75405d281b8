"""The default generate function: one model turn after the prompt."""

from __future__ import annotations

from typing import Any

from streamrl.agents.api import GenerateContext, Trajectory


async def generate(ctx: GenerateContext, prompt: Any) -> Trajectory:
    """Generate one response to `prompt.input_ids`; `rollout.reward_fn` scores its text."""
    trajectory = Trajectory()
    trajectory.add_completion(await ctx.generate(list(prompt.input_ids)))
    return trajectory
