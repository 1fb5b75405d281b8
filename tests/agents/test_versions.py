"""Per-token weight versions from responses with and without spans (`VersionRule`)."""

from __future__ import annotations

import pytest

from streamrl.agents.api import GenerateContext, VersionRule
from streamrl.fleet.client import EngineError
from streamrl.fleet.results import parse_result


def response(tokens: list[int], version: int, *, aborted: bool = False, spans=None) -> dict:
    meta = {
        "id": "r",
        "finish_reason": {"type": "abort"} if aborted else {"type": "length"},
        "weight_version": str(version),
        "output_token_logprobs": [[-1.0, t, None] for t in tokens],
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "", "output_ids": tokens, "meta_info": meta}


def test_spans_are_exact_token_by_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    result = parse_result(response([5, 6, 7], 4, spans=spans))
    assert VersionRule().versions(result, floor=3) == ([3, 3, 4], True)


def test_without_spans_a_response_that_ends_at_the_floor_is_exact():
    result = parse_result(response([5, 6], 3))
    assert VersionRule().versions(result, floor=3) == ([3, 3], True)


def test_without_spans_a_response_past_the_floor_gets_the_floor_and_is_inexact():
    # It may have started under version 3 and finished under 5: 3 is the oldest its tokens
    # can be, so staleness measured from it is never understated.
    result = parse_result(response([5, 6], 5))
    assert VersionRule().versions(result, floor=3) == ([3, 3], False)


def test_in_abort_mode_every_response_comes_from_one_version():
    result = parse_result(response([5, 6], 5))
    assert VersionRule(single_version=True).versions(result, floor=3) == ([5, 5], True)


class _ScriptedEngine:
    """Stands in for an engine (a unit test of GenerateContext): answers from a script."""

    def __init__(self, answers: list[dict]) -> None:
        self.answers = list(answers)
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids, params):
        self.prompts.append(list(input_ids))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return parse_result(answer)


class _Engines:
    router = None

    def __init__(self, engine) -> None:
        self.engine = engine

    def session(self, key):
        return self.engine


@pytest.mark.anyio
@pytest.mark.parametrize("single_version", [True, False])
async def test_a_sample_resumed_after_an_abort_has_one_exact_version_per_segment(single_version):
    engine = _ScriptedEngine(
        [response([10, 11, 12], 3, aborted=True), response([13, 14, 15, 16, 17], 4)]
    )
    floors = iter([3, 4])
    ctx = GenerateContext(
        engines=_Engines(engine),
        tokenizer=None,
        sampling_params={"max_new_tokens": 8},
        version_rule=VersionRule(single_version=single_version, floor=lambda: next(floors)),
    )
    completion = await ctx.generate([1, 2])
    assert completion.output_ids == [10, 11, 12, 13, 14, 15, 16, 17]
    assert completion.versions == [3, 3, 3, 4, 4, 4, 4, 4] and completion.versions_exact
    assert engine.prompts == [[1, 2], [1, 2, 10, 11, 12]]
    assert completion.resume_prompt_tokens == 5 and completion.num_resumes == 1


@pytest.mark.anyio
async def test_a_straddling_response_without_spans_is_labelled_with_the_floor():
    engine = _ScriptedEngine([response([10, 11], 6)])
    ctx = GenerateContext(
        engines=_Engines(engine),
        tokenizer=None,
        sampling_params={"max_new_tokens": 2},
        version_rule=VersionRule(floor=lambda: 4),
    )
    completion = await ctx.generate([1])
    assert completion.versions == [4, 4] and not completion.versions_exact


@pytest.mark.anyio
async def test_a_request_aborted_before_it_ran_is_sent_again():
    # SGLang 0.5.17's abort pause also aborts requests waiting at its gate: HTTP 499, no token.
    aborted = EngineError("http://e", "/generate", 499, "Request r was aborted")
    engine = _ScriptedEngine([response([10, 11], 3, aborted=True), aborted, response([12, 13], 4)])
    ctx = GenerateContext(
        engines=_Engines(engine),
        tokenizer=None,
        sampling_params={"max_new_tokens": 4},
        version_rule=VersionRule(single_version=True),
    )
    completion = await ctx.generate([1])
    assert completion.output_ids == [10, 11, 12, 13] and completion.versions == [3, 3, 4, 4]
    assert engine.prompts == [[1], [1, 10, 11], [1, 10, 11]]
    assert completion.resume_prompt_tokens == 3  # the call that ran, not the one aborted
