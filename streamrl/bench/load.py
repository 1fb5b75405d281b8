"""The load of `streamrl bench engine`: N generate requests at once, and what each took.

`measure_http` sends one `/generate` call per prompt, all at once, over one
aiohttp session with no connection limit (the client must not be what limits
the rate); `num_probes` of them, spread evenly over the send order, stream
(server-sent events) so that their time to first token can be seen from the
client. `ClientProcesses` does the same from several processes, each with its own
event loop and session, the requests dealt out between them: one Python client
spends ~0.1-0.2 ms of its one core per request sent and per answer read, so a
burst of hundreds of requests reaches a fast engine over tens of milliseconds, and
that (not the engine) can set a round's pace. `measure_in_process` hands the same
prompts to an `EngineCore` in one call. All return the same figures: tokens, wall
time, tokens/s, per-request latency and (HTTP, probes) time to first token, with
counts of anything wrong (a non-200 answer, a response without logprobs, fewer
tokens than asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import statistics
import time
from typing import Any

import msgspec

PROMPT_TOKEN_RANGE = (10, 30000)
"""Prompt token ids are drawn from here (below the model's vocabulary size if it is smaller):
inside SmolLM2's vocabulary and every random shape's."""


def prompts_for(
    count: int, length: int, *, seed: int, vocab_size: int | None = None
) -> list[list[int]]:
    """`count` prompts of `length` random token ids, the same for a seed on every machine."""
    import numpy as np

    low, high = PROMPT_TOKEN_RANGE
    if vocab_size is not None:
        high = min(high, vocab_size)
    return np.random.default_rng(seed).integers(low, high, (count, length)).tolist()


def request_body(prompt: list[int], max_new_tokens: int, *, stream: bool = False) -> bytes:
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    if stream:  # events at the first token and at the end only (SGLang's stream_interval rule)
        body["stream"] = True
        body["sampling_params"]["stream_interval"] = max(1, max_new_tokens)
    return msgspec.json.encode(body)


def probe_indices(count: int, num_probes: int) -> set[int]:
    """`num_probes` request indices spread evenly over 0..count-1 (first and last included)."""
    num_probes = min(num_probes, count)
    if num_probes <= 0:
        return set()
    if num_probes == 1:
        return {0}
    return {round(i * (count - 1) / (num_probes - 1)) for i in range(num_probes)}


def http_session():
    """A client session with no connection limit, kept open across rounds (as the rollout
    worker keeps its client): connections opened once, not once per round."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def measure_http(
    url: str,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    num_probes: int,
    session=None,
) -> dict[str, Any]:
    """One round: every prompt sent at once to `url`'s /generate, through `session` (a fresh
    `http_session` when None)."""
    if session is None:
        async with http_session() as fresh:
            return await measure_http(
                url, prompts, max_new_tokens=max_new_tokens, num_probes=num_probes, session=fresh
            )
    probes = probe_indices(len(prompts), num_probes)
    answers, wall_s = await _send_all(session, url, prompts, probes, max_new_tokens)
    return figures(answers, wall_s, max_new_tokens)


async def _send_all(session, url: str, prompts, probes, max_new_tokens: int):
    """Every prompt sent at once (those whose index is in ``probes`` streamed): the answers
    in prompt order, and the seconds from the first send to the last answer."""
    started = time.perf_counter()
    calls = [
        _stream_one(session, url, prompt, max_new_tokens, started)
        if index in probes
        else _one(session, url, prompt, max_new_tokens, started)
        for index, prompt in enumerate(prompts)
    ]
    answers = await asyncio.gather(*calls)
    return answers, time.perf_counter() - started


class ClientProcesses:
    """`count` client processes (spawned, each with its own event loop and `http_session`,
    kept for every round) that send one round's requests between them: request i from
    process i mod count, all starting together at a barrier. A round's wall time runs from
    the barrier to the last answer of any process. Use as a context manager (the processes
    stop at its end)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"client processes must be at least 1, got {count}")
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._barrier = context.Barrier(count)
        self._pipes = []
        self._processes = []
        self._round = 0  # the rounds sent, which each reply names
        for index in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_client_process, args=(theirs, self._barrier),
                name=f"bench-client-{index}", daemon=True,
            )  # fmt: skip
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # that process is gone already
                pipe.send(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()

    async def measure(
        self, url: str, prompts: list[list[int]], *, max_new_tokens: int, num_probes: int
    ) -> dict[str, Any]:
        """One round, as `measure_http` measures it, sent from every process at once."""
        probes = probe_indices(len(prompts), num_probes)
        count = len(self._pipes)
        self._round += 1
        for offset, pipe in enumerate(self._pipes):
            indices = range(offset, len(prompts), count)
            dealt = [prompts[i] for i in indices]
            dealt_probes = {j for j, i in enumerate(indices) if i in probes}
            pipe.send((self._round, url, dealt, dealt_probes, max_new_tokens))
        # Every process's reply is read before anything is raised: none is left on its pipe
        # for the next round to take as its own.
        replies = await asyncio.gather(
            *(asyncio.to_thread(self._reply, pipe, self._round) for pipe in self._pipes),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        answers: list[dict] = [{}] * len(prompts)
        for offset, (dealt_answers, _) in enumerate(replies):
            answers[offset::count] = dealt_answers
        return figures(answers, max(wall for _, wall in replies), max_new_tokens)

    @staticmethod
    def _reply(pipe, round_id: int) -> tuple[list[dict], float]:
        """Round ``round_id``'s reply on ``pipe`` (a reply to an earlier round, one that was
        interrupted before it read it, is dropped)."""
        while True:
            try:
                replied_round, reply = pipe.recv()
            except EOFError:
                raise RuntimeError(
                    "a bench client process exited in the middle of a round"
                ) from None
            if replied_round == round_id:
                break
        if isinstance(reply, BaseException):
            raise RuntimeError(f"a bench client process failed: {reply!r}") from reply
        return reply


def _client_process(pipe, barrier) -> None:
    """A `ClientProcesses` member: rounds from ``pipe`` until None; each round's answers and
    wall time (or the exception that ended it) go back on ``pipe``."""
    gc.freeze()  # what this process imported stays out of every collection (as the bench's)
    asyncio.run(_client_rounds(pipe, barrier))


async def _client_rounds(pipe, barrier) -> None:
    async with http_session() as session:
        while (job := await asyncio.to_thread(pipe.recv)) is not None:
            round_id, url, prompts, probes, max_new_tokens = job
            await asyncio.to_thread(barrier.wait)
            try:
                reply = await _send_all(session, url, prompts, probes, max_new_tokens)
            except Exception as error:  # the round fails in the bench, with this
                reply = error
            pipe.send((round_id, reply))


async def _one(session, url: str, prompt, max_new_tokens: int, started: float) -> dict:
    async with session.post(
        f"{url}/generate",
        data=request_body(prompt, max_new_tokens),
        headers={"Content-Type": "application/json"},
    ) as response:
        raw = await response.read()
        done_s = time.perf_counter() - started
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {raw[:200]!r}", "latency_s": done_s}
    return _answer(msgspec.json.decode(raw), done_s)


async def _stream_one(session, url: str, prompt, max_new_tokens: int, started: float) -> dict:
    first_token_s = None
    last = None
    async with session.post(
        f"{url}/generate",
        data=request_body(prompt, max_new_tokens, stream=True),
        headers={"Content-Type": "application/json"},
    ) as response:
        if response.status != 200:
            raw = await response.read()
            return {"error": f"HTTP {response.status}: {raw[:200]!r}"}
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            last = msgspec.json.decode(payload)
            if first_token_s is None and _num_tokens(last) > 0:
                first_token_s = time.perf_counter() - started
        done_s = time.perf_counter() - started
    if last is None:
        return {"error": "the stream ended without an event"}
    answer = _answer(last, done_s)
    answer["ttft_s"] = first_token_s
    return answer


def _num_tokens(result: dict) -> int:
    meta = result.get("meta_info") or {}
    count = meta.get("completion_tokens")
    return int(count) if count is not None else len(result.get("output_ids") or ())


def _answer(result: dict, latency_s: float) -> dict:
    meta = result.get("meta_info") or {}
    return {
        "tokens": _num_tokens(result),
        "num_logprobs": len(meta.get("output_token_logprobs") or ()),
        "latency_s": latency_s,
    }


async def measure_in_process(
    core, prompts: list[list[int]], *, max_new_tokens: int, num_probes: int = 0
) -> dict:
    """All prompts in one `EngineCore.generate` call (no HTTP, no JSON); `num_probes` of them
    (spread as `measure_http` spreads its streamed ones) report their first token, for a time
    to first token seen as an in-process caller sees it (on its event loop)."""
    from streamrl.engine.core import Request, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    probes = probe_indices(len(prompts), num_probes)
    first_token_s: dict[int, float] = {}

    def first_token(index: int):
        def on_tokens(ids: list[int], logprobs: list[float], versions: list[str]) -> None:
            first_token_s.setdefault(index, time.perf_counter() - started)

        return on_tokens

    requests = [
        Request(f"p{i}", prompt, params)
        if i not in probes
        else Request(f"p{i}", prompt, params, on_tokens=first_token(i),
                     stream_interval=max(1, max_new_tokens))
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    started = time.perf_counter()
    outputs = await core.generate(requests)
    wall_s = time.perf_counter() - started
    answers = [
        {"tokens": len(o.output_ids), "num_logprobs": len(o.logprobs), "latency_s": wall_s}
        for o in outputs
    ]
    for index, ttft_s in first_token_s.items():
        answers[index]["ttft_s"] = ttft_s
    return figures(answers, wall_s, max_new_tokens)


def figures(answers: list[dict], wall_s: float, max_new_tokens: int) -> dict[str, Any]:
    """Tokens/s over the wall time, latency and TTFT medians, and what went wrong."""
    good = [a for a in answers if "error" not in a]
    tokens = sum(a["tokens"] for a in good)
    ttfts = [a["ttft_s"] for a in good if a.get("ttft_s") is not None]
    latencies = [a["latency_s"] for a in good]
    errors = [a["error"] for a in answers if "error" in a]
    return {
        "requests": len(answers),
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "latency_s_median": statistics.median(latencies) if latencies else None,
        "latency_s_max": max(latencies) if latencies else None,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "ttft_s_all": ttfts,
        "num_errors": len(errors),
        "errors": errors[:5],
        "num_short": sum(a["tokens"] < max_new_tokens for a in good),
        "num_without_logprobs": sum(a["num_logprobs"] != a["tokens"] for a in good),
    }
