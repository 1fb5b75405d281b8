"""Failures that a restart would repeat: every one of the last N samples failed.

A sample fails when its generate function raises (the engines' retries spent, or the
user's code, or the agent gateway refusing a call) or its reward raises, times out or
returns something that is not a number. One failure is counted and the sample kept, as
always; `rollout.max_consecutive_failures` of them in a row (no sample in between that
succeeded) is a systematic failure: the rollout worker stops starting groups and raises
`SystematicFailure`, which the rollout process sends to the trainer as a `Fatal` frame
(`streamrl.mains.rollout`), and the run stops with the first failure's traceback instead
of a restart that would fail the same way.

Engines that do not answer (no response or HTTP 5xx once `rollout.retry_timeout_s` is
spent) are not counted either way: an engine being restarted is the engine supervisor's
business, and a long restart must not read as a bug in the user's code.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass

from streamrl.fleet.client import EngineError


class Stage(enum.StrEnum):
    GENERATION = "generation"
    REWARD = "reward"


@dataclass(frozen=True)
class Failure:
    """One failed sample, as the terminal will show it if it starts a systematic run."""

    stage: Stage
    error: str
    """`ExceptionType: message` (or the reward scorer's description)."""
    sample: str
    """Which sample: `prompt 12 sample 3`."""
    traceback: str = ""
    """The formatted traceback, where there was an exception."""


def generation_failure(exc: BaseException, sample: str) -> Failure:
    tb = "".join(traceback.format_exception(exc)).rstrip()
    return Failure(Stage.GENERATION, f"{type(exc).__name__}: {exc}", sample, tb)


def is_engine_outage(exc: BaseException) -> bool:
    """An engine that did not answer, or answered 5xx, until the retries were spent."""
    return isinstance(exc, EngineError) and (exc.status is None or exc.status >= 500)


class SystematicFailure(RuntimeError):
    """Every one of the last `num_failures` samples failed; `first` is the first of them."""

    def __init__(self, first: Failure, num_failures: int) -> None:
        self.first = first
        self.num_failures = num_failures
        super().__init__(
            f"{first.stage} failed for every one of the last {num_failures} samples "
            f"(rollout.max_consecutive_failures); the first ({first.sample}): {first.error}"
        )


class FailureWindow:
    """Counts samples that failed in a row; systematic once `max_consecutive` have (0:
    never)."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.num_consecutive = 0
        self.first: Failure | None = None
        """The first failure of the current run of failures."""

    def succeeded(self) -> None:
        """A sample was generated and scored: the run of failures is over."""
        self.num_consecutive = 0
        self.first = None

    def failed(self, failure: Failure) -> bool:
        """Count `failure`; True when it makes the failures systematic."""
        if self.num_consecutive == 0:
            self.first = failure
        self.num_consecutive += 1
        return self.is_systematic

    @property
    def is_systematic(self) -> bool:
        return 0 < self.max_consecutive <= self.num_consecutive

    def error(self) -> SystematicFailure:
        assert self.first is not None, "no failure recorded"
        return SystematicFailure(self.first, self.num_consecutive)
