"""slime's `post` and `get`, with every `/generate` of the policy recorded token by token.

A slime generate function calls the engines itself: `await post(url, payload)` with
`url` built from `args.sglang_router_ip` / `args.sglang_router_port` (which name
streamrl's router or engine). While streamrl runs such a function, a `Recorder` is set
for it (a context variable, so the tasks the function starts see it too), and a `post`
to `/generate` on one of the run's engines does not leave through a plain HTTP client:
it becomes one `GenerateContext.continue_completion` per prompt, so it

- keeps the episode on one engine, resumes a request that a weight update aborted from
  its tokens and retries engine failures (the function never sees `abort` from an update),
- records the `Completion`: output ids, behaviour logprobs and the weight version of
  every token (`meta_info.weight_versions` spans, or `VersionRule`'s safe lower bound),

and answers with SGLang's `/generate` JSON (`text`, `output_ids`, `meta_info` with
`finish_reason`, `weight_version`, `weight_versions`, and `output_token_logprobs` when
the payload asks for `return_logprob`). `streamrl.compat.slime.trajectory` later finds
each trained token of the returned Sample in these calls to give it its version.
Any other URL (a search server, a remote reward model) is a plain HTTP POST, retried
as slime's is.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from streamrl.agents.api import Completion, GenerateContext
from streamrl.types import FinishReason

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's `max_new_tokens` when a payload's sampling_params do not give one."""


@dataclass
class EngineCall:
    """One prompt of one proxied `/generate`: what was sent and what came back."""

    input_ids: list[int]
    completion: Completion


class Recorder:
    """The `/generate` calls one slime generate function makes (one sample, or a whole
    group for the batch form), through `ctx`.

    `seed`: the `sampling_seed` a call gets when its payload has none (deterministic
    runs); with `seed_step` 1 every call gets the next seed (the batch form: one call per
    sample), with 0 every call the same one (one sample: all its turns, as streamrl's own
    multi-turn loop does)."""

    def __init__(self, ctx: GenerateContext, *, seed: int | None = None, seed_step: int = 0):
        self.ctx = ctx
        self.calls: list[EngineCall] = []
        self._seed = seed
        self._seed_step = seed_step
        self._netlocs = {
            urlsplit(client.url).netloc
            for client in [*ctx.engines.engines, ctx.engines.router]
            if client is not None
        }
        self.floor_version = ctx.version_rule.floor()
        """The version the engines served at least when the function started: the lower
        bound of any trained token no recorded call produced."""

    def handles(self, url: str) -> bool:
        """A `/generate` on one of this run's engines (or its router)."""
        parts = urlsplit(url)
        return parts.path.rstrip("/") == "/generate" and parts.netloc in self._netlocs

    async def generate(self, payload: dict[str, Any]) -> Any:
        """Answer one `/generate` payload as SGLang would: one object for one prompt with
        n = 1, else a list (prompt-major, n per prompt)."""
        if payload.get("stream"):
            raise ValueError("post(): streamed /generate (stream=true) is not supported")
        prompts, is_single = self._prompts(payload)
        raw = payload.get("sampling_params") or {}
        params_list = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling_params for {len(prompts)} prompts")
        jobs = []
        for ids, params in zip(prompts, params_list, strict=True):
            params = dict(params)
            num_samples = int(params.pop("n", 1) or 1)
            for j in range(num_samples):
                jobs.append((ids, self._seeded(params, j)))
        answers: list[Any] = [None] * len(jobs)
        return_logprob = bool(payload.get("return_logprob", False))

        async def one(index: int, ids: list[int], params: dict[str, Any]) -> None:
            completion = Completion()
            self.ctx.completions.append(completion)
            call = EngineCall(list(ids), completion)
            self.calls.append(call)  # in the order sent, before any answer
            budget = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
            await self.ctx.continue_completion(completion, list(ids), budget, params)
            answers[index] = self._answer(call, budget, return_logprob)

        async with anyio.create_task_group() as tg:
            for index, (ids, params) in enumerate(jobs):
                tg.start_soon(one, index, ids, params)
        return answers[0] if is_single and len(answers) == 1 else answers

    def _seeded(self, params: dict[str, Any], offset: int) -> dict[str, Any]:
        params = dict(params)
        if "sampling_seed" not in params and self._seed is not None:
            params["sampling_seed"] = self._seed
            self._seed += self._seed_step
        if offset and params.get("sampling_seed") is not None:
            params["sampling_seed"] = int(params["sampling_seed"]) + offset  # SGLang's n
        return params

    def _prompts(self, payload: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt; text is encoded as the engine would (`encode`)."""
        if payload.get("input_ids") is not None:
            ids = payload["input_ids"]
            if ids and isinstance(ids[0], list):
                return [[int(t) for t in p] for p in ids], False
            return [[int(t) for t in ids]], True
        text = payload.get("text")
        if text is None:
            raise ValueError("post(): a /generate payload needs `text` or `input_ids`")
        texts = [text] if isinstance(text, str) else list(text)
        return [list(self.ctx.tokenizer.encode(t)) for t in texts], isinstance(text, str)

    def _answer(self, call: EngineCall, budget: int, return_logprob: bool) -> dict[str, Any]:
        completion = call.completion
        versions = completion.versions
        finish: dict[str, Any] = {"type": str(completion.finish_reason)}
        if completion.finish_reason is FinishReason.LENGTH:
            finish["length"] = budget
        meta: dict[str, Any] = {
            "finish_reason": finish,
            "prompt_tokens": len(call.input_ids),
            "completion_tokens": len(completion.output_ids),
            "cached_tokens": 0,
            "weight_version": str(versions[-1] if versions else self.ctx.version_rule.floor()),
            "weight_versions": _spans(versions),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [logprob, token, None]
                for logprob, token in zip(completion.logprobs, completion.output_ids, strict=True)
            ]
        return {
            "text": completion.text,
            "output_ids": list(completion.output_ids),
            "meta_info": meta,
        }


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions as `{"start", "end", "version"}` runs (the embedded engine's form)."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"start": position, "end": position + 1, "version": str(version)})
    return spans


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "streamrl_slime_recorder", default=None
)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Route the `post`s of the code run inside (and of the tasks it starts) to `recorder`."""
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


async def post(
    url: str,
    payload: Any = None,
    max_retries: int = 60,
    *,
    headers: dict[str, str] | None = None,
    json: Any = None,
) -> Any:
    """slime's `post`: POST `payload` as JSON and return the decoded answer (its text when
    it is not JSON). Inside a generate function run by streamrl, a `/generate` on the
    run's engines is served through the recorder (see the module docstring)."""
    payload = json if payload is None else payload
    recorder = _RECORDER.get()
    if recorder is not None and recorder.handles(url):
        return await recorder.generate(payload or {})
    return await _http("POST", url, payload, max_retries=max_retries, headers=headers)


async def get(url: str, max_retries: int = 1) -> Any:
    """slime's `get`: GET `url`, the decoded JSON answer."""
    return await _http("GET", url, None, max_retries=max_retries)


async def _http(
    method: str, url: str, payload: Any, *, max_retries: int, headers: dict | None = None
) -> Any:
    """A plain HTTP call, retried up to `max_retries` times one second apart (slime's rule)."""
    attempt = 0
    async with httpx.AsyncClient(timeout=None) as client:
        while True:
            try:
                kwargs = {} if payload is None else {"json": payload}
                response = await client.request(method, url, headers=headers, **kwargs)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                attempt += 1
                if attempt >= max(max_retries, 1):
                    raise
                log.info(
                    "%s %s failed (%s); retry %d of %d", method, url, exc, attempt, max_retries
                )
                await anyio.sleep(1.0)
                continue
            try:
                return response.json()
            except ValueError:
                return response.text
