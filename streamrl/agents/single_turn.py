"""The default generate function: one model turn after the prompt.

A group's n samples are made by one engine call (`for_group`), so they share
the prompt's prefill and one HTTP round trip."""

from __future__ import annotations

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.types import Prompt


async def generate(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """Generate one response to `prompt.input_ids`; `rollout.reward_fn` scores its text."""
    trajectory = Trajectory()
    trajectory.add_completion(await ctx.generate(list(prompt.input_ids)))
    return trajectory


async def generate_group(ctx: GenerateContext, prompt: Prompt, n: int) -> list[Trajectory]:
    """The n samples of one group from a single engine call."""
    trajectories = []
    for completion in await ctx.generate_samples(list(prompt.input_ids), n):
        trajectory = Trajectory()
        trajectory.add_completion(completion)
        trajectories.append(trajectory)
    return trajectories


generate.for_group = generate_group
generate.resumable = True
"""A sample is one completion of the prompt, scored by `rollout.reward_fn`: a sample saved
mid-way (at a checkpoint's cut) can be continued from its tokens. A generate function
that wraps this one declares `resumable = True` too, and names what it does after the
completion as `finish(ctx, trajectory) -> trajectory` (applied to a continued sample)."""
