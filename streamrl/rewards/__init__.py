"""Reward functions: the calling convention and a scorer that never crashes a run.

A reward function takes one `RewardInput` and returns a float, or an
awaitable of one, or a dict with a `"reward"` key plus extra float metrics
(e.g. `{"reward": 1.0, "format": 1.0}`). Sync functions run in a worker
thread so a slow verifier does not stall the rollout worker's event loop.
Built-in verifiers live in `streamrl.rewards.math` and `streamrl.tasks`, a reward
service client in `streamrl.rewards.remote`; custom ones are named in the config as
`module:function`, with keyword arguments from `rollout.reward_kwargs` (docs/rewards.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from math import isfinite
from numbers import Real
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from streamrl.utils import import_object

RewardFn = Callable[["RewardInput"], float | dict[str, float] | Awaitable[Any]]


class RewardInput(msgspec.Struct, kw_only=True):
    """What a reward function sees of one sample."""

    prompt: str
    """The rendered prompt text (chat template applied)."""
    response: str
    """The generated text (for multi-turn episodes: everything after the prompt)."""
    label: Any = None
    """The row's reference answer (`data.label_key`), any JSON value; None if absent."""
    metadata: dict[str, Any] = {}
    """The row's metadata dict (`data.metadata_key`)."""


class RewardOutcome(msgspec.Struct, kw_only=True):
    """A scored sample: reward 0.0 and `error` set when the function failed."""

    reward: float
    metrics: dict[str, float] = {}
    """Extra values a function returned beside `reward` (dict returns only)."""
    error: str | None = None
    """"ExceptionType: message", "timeout after X s", or a bad-return description."""


def load_reward_fn(
    spec: str, kwargs: dict[str, Any] | None = None, *, key: str = "rollout.reward_fn"
) -> RewardFn:
    """Import the reward function named `module:function` (config key `key`), with `kwargs`
    (the section's `reward_kwargs`) bound after the sample: `fn(sample, **kwargs)`.

    ValueError, naming the key, when it cannot be imported, its signature does not take those
    kwargs, or its `check_kwargs(**kwargs)` attribute, when it has one, rejects their values.
    """
    fn = import_object(spec, key)
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r} is not callable ({type(fn).__name__})")
    if not kwargs:
        return fn
    kwargs_key = key.removesuffix("reward_fn") + "reward_kwargs"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins)
        signature = None
    if signature is not None:
        try:
            signature.bind(None, **kwargs)
        except TypeError as exc:
            raise ValueError(
                f"{kwargs_key}: {spec} does not take {sorted(kwargs)}: {exc}"
            ) from None
    check = getattr(fn, "check_kwargs", None)
    if check is not None:  # the function's own check of the values
        try:
            check(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kwargs_key}: {exc}") from None
    return functools.partial(fn, **kwargs)


async def score(fn: RewardFn, inp: RewardInput, *, timeout_s: float) -> RewardOutcome:
    """Call `fn(inp)` with a deadline; failures become an outcome, never an exception.

    An exception, a timeout, or a return that is not a finite number (or a dict
    with a finite `reward` and finite metrics) gives reward 0.0 and `error`.
    A timed-out sync function is abandoned in its thread (Python cannot kill
    it); it keeps running to completion in the background. Cancellation of
    the caller itself propagates as usual.
    """
    result: Any = None
    with anyio.move_on_after(timeout_s) as scope:
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(inp)
            else:
                result = await anyio.to_thread.run_sync(fn, inp, abandon_on_cancel=True)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as exc:
            return RewardOutcome(reward=0.0, error=f"{type(exc).__name__}: {exc}")
    if scope.cancelled_caught:
        return RewardOutcome(reward=0.0, error=f"timeout after {timeout_s:g} s")
    return _outcome(result)


def _outcome(result: Any) -> RewardOutcome:
    """Validate a reward function's return value."""
    if isinstance(result, dict):
        if "reward" not in result:
            return _bad(f"returned a dict without a 'reward' key (keys: {sorted(result)})")
        metrics: dict[str, float] = {}
        for key, value in result.items():
            if key != "reward":
                number = _finite(value)
                if number is None:
                    return _bad(f"metric {key!r} is not a finite number: {value!r}")
                metrics[str(key)] = number
        reward = _finite(result["reward"])
        if reward is None:
            return _bad(f"returned a non-finite or non-numeric reward: {result['reward']!r}")
        return RewardOutcome(reward=reward, metrics=metrics)
    reward = _finite(result)
    if reward is None:
        return _bad(f"returned a non-finite or non-numeric reward: {result!r}")
    return RewardOutcome(reward=reward)


def _finite(value: Any) -> float | None:
    """`value` as a float if it is a finite real number (bools count as 0/1), else None."""
    if not isinstance(value, Real) and not hasattr(value, "__float__"):
        return None
    if isinstance(value, str | bytes):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if isfinite(number) else None


def _bad(reason: str) -> RewardOutcome:
    return RewardOutcome(reward=0.0, error=f"BadReturn: {reason}")
