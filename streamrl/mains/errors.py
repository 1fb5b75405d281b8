"""The errors that stop a run; each message says why and where to look."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that cannot go on; the message says why and where to look."""


class RolloutFatal(RunError):
    """The rollout process reported an error that a restart would repeat (`Fatal`)."""
