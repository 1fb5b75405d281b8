"""`remote_reward` against a real HTTP reward service started in the test (aiohttp, a free
port): scores, batches, retries, and errors that name the URL and the config key."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
from aiohttp import web

from streamrl.metrics import read_metrics
from streamrl.rewards import RewardInput, load_reward_fn, score
from tests.e2e_rewards import vowel_fraction

pytestmark = pytest.mark.anyio

REMOTE = "streamrl.rewards.remote:remote_reward"
FAST_RETRIES = {"max_retries": 3, "backoff_s": 0.01, "timeout_s": 5.0}


class RewardService:
    """A reward service on 127.0.0.1: the reward of a sample is the length of its response;
    `answer` may be replaced to fail, stall or answer otherwise; `bodies` holds every request
    body it received, in order."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/score"
        self.port = port
        self.bodies: list = []
        self.received = anyio.Event()
        self.answer: Callable[[dict], Awaitable[web.Response]] = self.score

    async def score(self, body: dict) -> web.Response:
        if "samples" in body:
            return web.json_response({"rewards": [len(s["response"]) for s in body["samples"]]})
        return web.json_response(len(body["response"]))

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.received.set()
        return await self.answer(body)


@contextlib.asynccontextmanager
async def reward_service(port: int) -> AsyncIterator[RewardService]:
    service = RewardService(port)
    app = web.Application()
    app.router.add_post("/score", service.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield service
    finally:
        await runner.cleanup()


def sample(response: str, label=None) -> RewardInput:
    return RewardInput(prompt="q", response=response, label=label, metadata={"row": 7})


async def test_each_sample_is_posted_alone_with_its_fields_and_scored(free_port):
    async with reward_service(free_port()) as service:
        reward = load_reward_fn(REMOTE, {"url": service.url})
        outcome = await score(reward, sample("four", label="4"), timeout_s=10)
    assert (outcome.reward, outcome.error) == (4.0, None)
    assert service.bodies == [
        {"prompt": "q", "response": "four", "label": "4", "metadata": {"row": 7}}
    ]


async def test_an_object_answer_gives_the_reward_key_and_keeps_other_numbers_as_metrics(
    free_port,
):
    async with reward_service(free_port()) as service:

        async def judged(body: dict) -> web.Response:
            return web.json_response({"score": 0.5, "format": 1, "why": "clear"})

        service.answer = judged
        reward = load_reward_fn(REMOTE, {"url": service.url, "reward_key": "score"})
        outcome = await score(reward, sample("x"), timeout_s=10)
    assert (outcome.reward, outcome.metrics, outcome.error) == (0.5, {"format": 1.0}, None)


async def test_concurrent_samples_are_posted_in_batches_of_batch_size(free_port):
    responses = ["a" * length for length in range(1, 9)]
    rewards: dict[str, float] = {}
    async with reward_service(free_port()) as service:
        reward = load_reward_fn(REMOTE, {"url": service.url, "batch_size": 4, "batch_wait_s": 5})

        async def one(response: str) -> None:
            outcome = await score(reward, sample(response), timeout_s=10)
            assert outcome.error is None
            rewards[response] = outcome.reward

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for response in responses:
                tg.start_soon(one, response)
    assert rewards == {response: float(len(response)) for response in responses}
    assert [len(body["samples"]) for body in service.bodies] == [4, 4]
    assert time.monotonic() - started < 4  # full batches go at once, not after batch_wait_s
    posted = [s["response"] for body in service.bodies for s in body["samples"]]
    assert sorted(posted) == sorted(responses)


async def test_a_batch_that_does_not_fill_is_posted_after_batch_wait_s(free_port):
    async with reward_service(free_port()) as service:
        reward = load_reward_fn(REMOTE, {"url": service.url, "batch_size": 4, "batch_wait_s": 0.05})
        outcome = await score(reward, sample("abc"), timeout_s=10)
    assert (outcome.reward, [len(b["samples"]) for b in service.bodies]) == (3.0, [1])


async def test_a_transient_503_is_retried_with_backoff(free_port):
    async with reward_service(free_port()) as service:

        async def unavailable_twice(body: dict) -> web.Response:
            if len(service.bodies) <= 2:
                return web.Response(status=503, text="warming up")
            return await service.score(body)

        service.answer = unavailable_twice
        reward = load_reward_fn(REMOTE, {"url": service.url, **FAST_RETRIES})
        outcome = await score(reward, sample("hello"), timeout_s=10)
    assert (outcome.reward, outcome.error) == (5.0, None)
    assert len(service.bodies) == 3


async def test_nothing_listening_is_an_error_naming_the_url_and_the_config_key(free_port):
    url = f"http://127.0.0.1:{free_port()}/score"
    reward = load_reward_fn(REMOTE, {"url": url, **FAST_RETRIES})
    outcome = await score(reward, sample("x"), timeout_s=10)
    assert outcome.reward == 0.0
    assert outcome.error.startswith(f"RemoteRewardError: reward service {url} (reward_kwargs.url)")
    assert "is down or failing: 4 attempts in" in outcome.error
    assert "ConnectError" in outcome.error


async def test_a_client_error_is_not_retried(free_port):
    async with reward_service(free_port()) as service:

        async def bad_request(body: dict) -> web.Response:
            return web.Response(status=422, text="no label")

        service.answer = bad_request
        reward = load_reward_fn(REMOTE, {"url": service.url, **FAST_RETRIES})
        outcome = await score(reward, sample("x"), timeout_s=10)
    assert outcome.error.endswith("refused the request: HTTP 422: no label")
    assert len(service.bodies) == 1


async def test_a_batch_answer_of_the_wrong_length_fails_every_sample_in_it(free_port):
    async with reward_service(free_port()) as service:

        async def one_short(body: dict) -> web.Response:
            return web.json_response({"rewards": [1.0]})

        service.answer = one_short
        reward = load_reward_fn(REMOTE, {"url": service.url, "batch_size": 2, "batch_wait_s": 5})
        outcomes = []

        async def one(response: str) -> None:
            outcomes.append(await score(reward, sample(response), timeout_s=10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a")
            tg.start_soon(one, "b")
    assert [o.reward for o in outcomes] == [0.0, 0.0]
    assert all('expected {"rewards": [...]} with 2 entries' in o.error for o in outcomes)


async def test_a_cancelled_batch_poster_hands_the_other_samples_back(free_port):
    """The first caller posts a batch of two and is cancelled while the service stalls; the
    second caller posts its own sample again and gets its score."""
    release = anyio.Event()
    async with reward_service(free_port()) as service:

        async def stall_first(body: dict) -> web.Response:
            if len(service.bodies) == 1:
                await release.wait()
            return await service.score(body)

        service.answer = stall_first
        reward = load_reward_fn(REMOTE, {"url": service.url, "batch_size": 2, "batch_wait_s": 0.2})
        outcomes: dict[str, object] = {}

        async def one(response: str) -> None:
            outcomes[response] = await score(reward, sample(response), timeout_s=10)

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as first_scope:
                async with anyio.create_task_group() as first:
                    first.start_soon(one, "first")  # runs first, so it forms the batch
                    tg.start_soon(one, "second")
                    await service.received.wait()
                    first_scope.cancel()
        release.set()
    assert [s["response"] for s in service.bodies[0]["samples"]] == ["first", "second"]
    assert [s["response"] for s in service.bodies[1]["samples"]] == ["second"]
    assert "first" not in outcomes
    assert (outcomes["second"].reward, outcomes["second"].error) == (6.0, None)


def test_reward_kwargs_are_checked_when_loaded_and_errors_name_the_key():
    with pytest.raises(ValueError, match=r"rollout\.reward_kwargs: .*'batchsize'"):
        load_reward_fn(REMOTE, {"url": "http://x", "batchsize": 2})
    with pytest.raises(
        ValueError, match=r"rollout\.reward_kwargs: .*missing a required argument: 'url'"
    ):
        load_reward_fn(REMOTE, {"batch_size": 2})
    with pytest.raises(ValueError, match=r"eval\.datasets\[0\]\.reward_kwargs: url = 'x:1'"):
        load_reward_fn(REMOTE, {"url": "x:1"}, key="eval.datasets[0].reward_fn")
    with pytest.raises(ValueError, match=r"rollout\.reward_kwargs: batch_size = 0"):
        load_reward_fn(REMOTE, {"url": "http://x", "batch_size": 0})
    with pytest.raises(ValueError, match=r"rollout\.reward_kwargs: .*exact_match does not take"):
        load_reward_fn("streamrl.rewards.math:exact_match", {"url": "http://x"})


@pytest.mark.slow
def test_a_run_scores_its_samples_and_evals_with_a_reward_service(tmp_path, free_port):
    """`streamrl run` on a tiny model with `remote_reward` in batches of a group: every
    training and eval sample reaches the service, and no reward fails."""
    from run_helpers import streamrl_run, write_config

    bodies: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            rewards = [vowel_fraction(RewardInput(**s)) for s in body["samples"]]
            answer = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"prompt": "What is 2 + 2?", "label": "4"}\n' * 2)
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    config = write_config(
        tmp_path,
        steps=2,
        extra=f'[eval]\ninterval = 2\n[[eval.datasets]]\nname = "tiny"\npath = "{evals}"\n'
        "[eval.datasets.sampling]\nmax_new_tokens = 12\n",
    )
    text = config.read_text().replace(
        'reward_fn = "tests.e2e_rewards:vowel_fraction"',
        'reward_fn = "streamrl.rewards.remote:remote_reward"\n'
        f'reward_kwargs = {{ url = "{url}", batch_size = 4, batch_wait_s = 0.5 }}',
    )
    config.write_text(text)
    try:
        result = streamrl_run(config)
    finally:
        server.shutdown()
        thread.join()
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    steps = [r for r in records if "kind" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rollout"]["reward_failures"] == 0  # the rollout's final counters
    assert any(r.get("kind") == "eval" for r in records)
    samples = [s for body in bodies for s in body["samples"]]
    assert all(1 <= len(body["samples"]) <= 4 for body in bodies)
    trained = [s for s in samples if "Reply with only the number." in s["prompt"]]
    evaluated = [s for s in samples if s not in trained]
    assert len(trained) >= 2 * 2 * 4  # steps x groups x samples, and any started beyond
    assert len(evaluated) >= 2 and {s["label"] for s in evaluated} == {"4"}
    assert all(set(s) == {"prompt", "response", "label", "metadata"} for s in samples)
