"""`streamrl.agents.synthetic` with `generate_kwargs.response_tokens`: a random model's
responses spread over a range of lengths (it never stops by itself)."""

from __future__ import annotations

import pytest

from streamrl.agents.api import GenerateContext
from streamrl.agents.synthetic import generate_scored, response_budgets
from streamrl.fleet.results import EngineFinish, GenerateResult
from streamrl.types import Prompt


class LengthEngine:
    """Generates exactly `max_new_tokens` tokens (as `ignore_eos` makes an engine do)."""

    router = None

    def __init__(self) -> None:
        self.params: list[dict] = []

    def session(self, key: str) -> LengthEngine:
        return self

    async def generate(self, input_ids, params):
        self.params.append(dict(params))
        count = params["max_new_tokens"]
        return GenerateResult(
            rid="r", text="", output_ids=[7] * count, logprobs=[-1.0] * count,
            versions=[0] * count, versions_exact=True, weight_version=0,
            finish_reason=EngineFinish(type="length"), prompt_tokens=3, cached_tokens=0, meta={},
        )  # fmt: skip


@pytest.mark.anyio
async def test_each_sample_generates_its_own_budget_between_the_bounds_with_ignore_eos():
    engine = LengthEngine()
    ctx = GenerateContext(
        engines=engine,
        tokenizer=None,
        sampling_params={"max_new_tokens": 8192, "temperature": 1.0},
        kwargs={"response_tokens": [256, 8192]},
    )
    prompt = Prompt(seq=5, index=0, epoch=0, text="", input_ids=[1, 2, 3])
    trajectories = await generate_scored.for_group(ctx, prompt, 8)
    lengths = [len(t.response_ids) for t in trajectories]
    assert lengths == response_budgets([256, 8192], seq=5, n=8)  # in sample order
    assert all(256 <= n <= 8192 for n in lengths) and len(set(lengths)) == 8
    assert all(p["ignore_eos"] is True for p in engine.params)
    assert all(t.reward == -1.0 for t in trajectories)  # still scored (confidence)


def test_budgets_are_fixed_by_the_stream_position_and_spread_over_the_range():
    assert response_budgets([256, 8192], seq=3, n=4) == response_budgets([256, 8192], seq=3, n=4)
    assert response_budgets([256, 8192], seq=3, n=4) != response_budgets([256, 8192], seq=4, n=4)
    many = [b for seq in range(200) for b in response_budgets([256, 8192], seq=seq, n=4)]
    assert min(many) < 512 and max(many) > 4096  # log-uniform: both ends are reached
    with pytest.raises(ValueError, match="response_tokens"):
        response_budgets([512, 256], seq=0, n=1)
