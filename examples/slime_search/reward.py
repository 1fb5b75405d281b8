"""A reward function written for slime (`--custom-rm-path reward.reward_func`).

A random tiny model can learn nothing about search or answers, so the example scores a
property of its own tokens that it can learn (streamrl.agents.synthetic's `repeat`): the
share of the model's tokens that repeat the token before them in the same turn. Tool
output (loss mask 0) is not the model's and is not counted.
"""

from __future__ import annotations

from streamrl.compat.slime import Sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    mask = sample.loss_mask or [1] * len(response)
    trained = sum(mask)
    repeats = sum(
        1
        for i in range(1, len(response))
        if mask[i] and mask[i - 1] and response[i] == response[i - 1]
    )
    return repeats / trained if trained else 0.0
