"""A reward model behind HTTP: `remote_reward` posts samples to a reward service (slime
`--rm-type remote_rm --rm-url URL`).

    [rollout]
    reward_fn = "streamrl.rewards.remote:remote_reward"
    reward_kwargs = { url = "http://rm-host:8000/score", batch_size = 8 }

The protocol, JSON over HTTP POST:

- one sample a request (`batch_size = 1`, the default; slime's body plus `metadata`):
  `{"prompt": str, "response": str, "label": any, "metadata": {...}}`, answered by a
  number, or by an object whose `reward_key` entry is the reward and whose other numbers
  are kept as metrics (`reward/<name>` in the sample's metadata);
- batches (`batch_size > 1`): samples scored at about the same time (a group's, and
  concurrent groups') go together as `{"samples": [<one sample object>, ...]}`, answered by
  `{"rewards": [<a number or an object, as above>, ...]}`, one per sample, in order.

A connection error, a timeout, HTTP 408, 429 or 5xx is retried `max_retries` times, after
`backoff_s`, doubling up to `max_backoff_s`; then, or at once on another 4xx or an answer of
the wrong shape, `RemoteRewardError` names the URL, its config key and the last failure:
the sample is a reward failure (reward 0, counted). Keep `(max_retries + 1) * timeout_s`
plus the backoff under `rollout.reward_timeout_s`, which stops the call otherwise.
"""

from __future__ import annotations

import functools
import inspect
import ssl
import time
from typing import Any

import anyio
import certifi
import httpx
from anyio.lowlevel import RunVar

from streamrl.rewards import RewardInput

RETRIED_STATUSES = frozenset({408, 429})
"""HTTP statuses retried besides 5xx."""
ANSWER_EXCERPT_CHARS = 200

_BATCHERS: RunVar[dict[tuple, _Batcher]] = RunVar("streamrl_remote_reward_batchers")


class RemoteRewardError(RuntimeError):
    """The reward service is unreachable, failing, or answered something unusable."""


async def remote_reward(
    inp: RewardInput,
    *,
    url: str,
    batch_size: int = 1,
    batch_wait_s: float = 0.05,
    timeout_s: float = 30.0,
    max_retries: int = 5,
    backoff_s: float = 0.5,
    max_backoff_s: float = 8.0,
    reward_key: str = "reward",
    headers: dict[str, str] | None = None,
) -> float | dict[str, float]:
    """The reward service's score of one sample (module docstring for the protocol).

    `url`: the endpoint (slime --rm-url). `batch_size`: samples a POST carries at most (1:
    each alone). `batch_wait_s`: how long the first sample of a batch waits for the rest.
    `timeout_s`: one attempt's limit. `max_retries`: attempts after the first. `backoff_s`,
    `max_backoff_s`: the wait before the first retry, doubled each retry up to the latter.
    `reward_key`: the reward's entry in an object answer (slime --reward-key).
    `headers`: extra HTTP headers (e.g. Authorization).
    """
    client = RewardClient(
        url=url,
        timeout_s=timeout_s,
        max_retries=max_retries,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
        headers=headers or {},
    )
    sample = {
        "prompt": inp.prompt,
        "response": inp.response,
        "label": inp.label,
        "metadata": inp.metadata,
    }
    if batch_size <= 1:
        answer = await client.post(sample)
    else:
        answer = await _batcher(client, batch_size, batch_wait_s).score(sample)
    return _reward(answer, reward_key, url)


def check_kwargs(**kwargs: Any) -> None:
    """ValueError naming the first bad `reward_kwargs` entry of `remote_reward`
    (`load_reward_fn` calls it when the run starts)."""
    bound = inspect.signature(remote_reward).bind(None, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    url = values["url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url = {url!r} is not an http:// or https:// URL")
    for name, low in (("batch_size", 1), ("max_retries", 0)):
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} = {value!r}: an integer >= {low}")
    for name in ("batch_wait_s", "timeout_s", "backoff_s", "max_backoff_s"):
        value = values[name]
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} = {value!r}: seconds >= 0")
    if values["timeout_s"] == 0:
        raise ValueError("timeout_s = 0: give one attempt some time")
    if not isinstance(values["reward_key"], str) or not values["reward_key"]:
        raise ValueError(f"reward_key = {values['reward_key']!r}: a key of the answer object")
    headers = values["headers"]
    if headers is not None and not (
        isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())
    ):
        raise ValueError(f"headers = {headers!r}: a table of strings")


remote_reward.check_kwargs = check_kwargs  # type: ignore[attr-defined]


class RewardClient:
    """POSTs JSON to the reward service with a timeout and retries (module docstring)."""

    def __init__(
        self,
        *,
        url: str,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_backoff_s: float,
        headers: dict[str, str],
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.headers = headers

    @property
    def key(self) -> tuple:
        """Equal for clients with equal settings."""
        settings = (self.url, self.timeout_s, self.max_retries, self.backoff_s, self.max_backoff_s)
        return (*settings, tuple(sorted(self.headers.items())))

    async def post(self, body: Any) -> Any:
        """The decoded JSON answer to `body`; RemoteRewardError when none comes."""
        started = time.monotonic()
        last_failure = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await anyio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s, verify=_tls()) as http:
                    response = await http.post(self.url, json=body, headers=self.headers)
            except httpx.TransportError as exc:  # refused, reset, timed out, ...
                last_failure = f"{type(exc).__name__}: {exc}"
                continue
            status = response.status_code
            if status >= 500 or status in RETRIED_STATUSES:
                last_failure = f"HTTP {status}: {_excerpt(response.text)}"
                continue
            if status >= 400:
                raise RemoteRewardError(
                    f"{self._where()} refused the request: HTTP {status}: {_excerpt(response.text)}"
                )
            try:
                return response.json()
            except ValueError:
                raise RemoteRewardError(
                    f"{self._where()} answered with no JSON: {_excerpt(response.text)}"
                ) from None
        raise RemoteRewardError(
            f"{self._where()} is down or failing: {self.max_retries + 1} attempts in "
            f"{time.monotonic() - started:.1f} s, the last: {last_failure}"
        )

    def _where(self) -> str:
        return f"reward service {self.url} (reward_kwargs.url)"


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every request, with httpx's CA bundle (certifi): an
    `httpx.AsyncClient` builds its own otherwise, which takes ~0.1 s."""
    return ssl.create_default_context(cafile=certifi.where())


def _reward(answer: Any, reward_key: str, url: str) -> float | dict[str, float]:
    """A number answer as the reward; an object's `reward_key` as the reward, its other
    numbers as metrics."""
    if isinstance(answer, int | float):
        return float(answer)
    if isinstance(answer, dict) and reward_key in answer:
        metrics = {
            key: value
            for key, value in answer.items()
            if key not in (reward_key, "reward") and isinstance(value, int | float)
        }
        return {"reward": answer[reward_key], **metrics}
    raise RemoteRewardError(
        f"reward service {url} (reward_kwargs.url) answered {_excerpt(repr(answer))}: "
        f"expected a number or an object with {reward_key!r} (reward_kwargs.reward_key)"
    )


def _excerpt(text: str) -> str:
    text = text.strip()
    return text if len(text) <= ANSWER_EXCERPT_CHARS else text[:ANSWER_EXCERPT_CHARS] + "..."


def _batcher(client: RewardClient, batch_size: int, wait_s: float) -> _Batcher:
    """This event loop's batcher for these settings (calls that share one share batches)."""
    try:
        batchers = _BATCHERS.get()
    except LookupError:
        batchers = {}
        _BATCHERS.set(batchers)
    key = (client.key, batch_size, wait_s)
    if key not in batchers:
        batchers[key] = _Batcher(client, batch_size, wait_s)
    return batchers[key]


class _Call:
    """One sample waiting in a batcher for its answer."""

    def __init__(self, sample: dict[str, Any]) -> None:
        self.sample = sample
        self.answer: Any = None
        self.error: str | None = None
        self.is_done = False
        self.is_taken = False
        """In a batch being posted."""
        self.changed = anyio.Event()
        """Set when the call is done, or handed back to `pending` by a cancelled poster."""

    def finish(self, answer: Any = None, error: str | None = None) -> None:
        self.answer, self.error, self.is_done = answer, error, True
        self.changed.set()


class _Batcher:
    """Gathers concurrent calls into POSTs of up to `batch_size` samples.

    The caller that forms a batch (one at a time, under `forming`) waits up to `wait_s` for
    it to fill, takes its own sample and the oldest waiting ones, posts them (outside the
    lock, so batches overlap) and hands every caller its answer. A poster that is cancelled
    hands the other samples back to be posted by their own callers; their callers wait on
    `_Call.changed`, so no background task is needed.
    """

    def __init__(self, client: RewardClient, batch_size: int, wait_s: float) -> None:
        self.client = client
        self.batch_size = batch_size
        self.wait_s = wait_s
        self.pending: list[_Call] = []
        self.forming = anyio.Lock()
        self.filled = anyio.Event()

    async def score(self, sample: dict[str, Any]) -> Any:
        call = _Call(sample)
        self._add([call])
        try:
            while not call.is_done:
                batch = await self._take(call)
                if batch is None:
                    await call.changed.wait()
                    if not call.is_done:  # handed back: form a batch again
                        call.changed = anyio.Event()
                else:
                    await self._post(batch, call)
        finally:
            if call in self.pending:
                self.pending.remove(call)
        if call.error is not None:
            raise RemoteRewardError(call.error)
        return call.answer

    def _add(self, calls: list[_Call]) -> None:
        self.pending.extend(calls)
        if len(self.pending) >= self.batch_size:
            self.filled.set()

    async def _take(self, call: _Call) -> list[_Call] | None:
        """A batch holding `call`, or None when another caller has taken `call` already."""
        async with self.forming:
            if call.is_taken or call.is_done:
                return None
            if len(self.pending) < self.batch_size:
                with anyio.move_on_after(self.wait_s):
                    await self.filled.wait()
            others = [other for other in self.pending if other is not call]
            batch = [call, *others[: self.batch_size - 1]]
            for taken in batch:
                taken.is_taken = True
                self.pending.remove(taken)
            if len(self.pending) < self.batch_size:
                self.filled = anyio.Event()
            return batch

    async def _post(self, batch: list[_Call], call: _Call) -> None:
        try:
            answer = await self.client.post({"samples": [c.sample for c in batch]})
        except RemoteRewardError as exc:
            for taken in batch:
                taken.finish(error=str(exc))
            return
        except BaseException:  # cancelled: the others go back to their own callers
            others = [taken for taken in batch if taken is not call]
            for other in others:
                other.is_taken = False
            self._add(others)
            for other in others:
                other.changed.set()
            raise
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            error = (
                f"reward service {self.client.url} (reward_kwargs.url) answered a batch of "
                f"{len(batch)} with {_excerpt(repr(answer))}: expected "
                f'{{"rewards": [...]}} with {len(batch)} entries'
            )
            for taken in batch:
                taken.finish(error=error)
            return
        for taken, reward in zip(batch, rewards, strict=True):
            taken.finish(answer=reward)
