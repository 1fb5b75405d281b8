"""Helpers of the conformance suite: the target, a teacher model, readiness waits, checks.

Nothing here assumes the embedded engine: where the embedded engine reports
more than SGLang does (`/get_load`'s running and held counts), the helpers use
it and fall back to a settle time on other servers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from engine_helpers import polling_client

PROMPT = [1, 504, 3458, 314, 253, 1380, 30, 2]


@dataclass(frozen=True)
class Target:
    """The server under test and how to reach and judge it."""

    url: str
    model_path: str | None
    backend: str
    """Weight-update group backend: gloo (CPU) or nccl (this process needs a free GPU)."""
    master_address: str
    logprob_tol: float
    long_tokens: int
    settle_s: float
    weights_dtype: str
    """dtype of the tensors this process broadcasts (the engine casts them on load)."""

    @property
    def long_params(self) -> dict[str, Any]:
        """A request that is still decoding when a test pauses or aborts it."""
        return {"max_new_tokens": self.long_tokens, "ignore_eos": True, "temperature": 1.0}

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def _load_counts(url: str) -> list[dict] | None:
    """The embedded engine's per-rank counts from `/get_load`; None where a server has none."""
    try:
        rows = polling_client().get(f"{url}/get_load").json()
    except (httpx.HTTPError, ValueError):
        return None
    rows = rows if isinstance(rows, list) else [rows]
    if not rows or not all(isinstance(r, dict) and "num_running_reqs" in r for r in rows):
        return None
    return rows


def _wait_count(target: Target, field: str, count: int, what: str, timeout_s: float = 60.0) -> None:
    if _load_counts(target.url) is None:
        time.sleep(target.settle_s)
        return
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while sum(row[field] for row in _load_counts(target.url) or []) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: fewer than {count} after {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def wait_running(target: Target, count: int = 1) -> None:
    """Until `count` requests are decoding (or `settle_s` on servers that do not say)."""
    _wait_count(target, "num_running_reqs", count, "running requests")


def wait_held(target: Target, count: int = 1) -> None:
    """Until `count` `/generate` calls wait behind a pause (or `settle_s`)."""
    _wait_count(target, "num_paused_reqs", count, "requests held by the pause")


class Teacher:
    """A Hugging Face model in float32 on the CPU: log p(output | prompt) by teacher forcing."""

    def __init__(self, model_dir: str) -> None:
        import torch

        from streamrl.models import load_causal_lm

        self.model_dir = model_dir
        self.model = load_causal_lm(model_dir, device="cpu", dtype=torch.float32)
        self.model.requires_grad_(False)
        self._served = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self._loaded: dict | None = None  # the weights in the model now (None: served)

    def parameters(self) -> dict:
        """The served weights by Hugging Face name (tied weights once)."""
        return dict(self._served)

    def logprobs(
        self, prompt: Sequence[int], output_ids: Sequence[int], weights: dict | None = None
    ) -> list[float]:
        """log p(output_ids[i] | prompt + output_ids[:i]) under `weights` (default: served)."""
        import torch

        if not output_ids:
            return []
        if weights is not self._loaded:
            self.model.load_state_dict(self._served if weights is None else weights, strict=False)
            self._loaded = weights
        ids = torch.tensor([list(prompt) + list(output_ids)])
        with torch.no_grad():
            logits = self.model(ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output_ids))
        return logprobs[positions, torch.tensor(list(output_ids))].tolist()


@functools.cache
def load_teacher(model_dir: str) -> Teacher:
    """One teacher per model directory for the whole session."""
    return Teacher(model_dir)


def logprob_error(actual: Sequence[float], expected: Sequence[float]) -> tuple[float, float]:
    """(mean, max) absolute difference; the lists must have the same length."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    if not actual:
        return 0.0, 0.0
    diffs = [abs(a - b) for a, b in zip(actual, expected, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def assert_matches_teacher(
    target: Target,
    teacher: Teacher,
    prompt: Sequence[int],
    result,
    weights: dict | None = None,
) -> None:
    """The engine's logprobs of `result` agree with the teacher within the target's tolerance."""
    expected = teacher.logprobs(prompt, result.output_ids, weights)
    mean, worst = logprob_error(result.logprobs, expected)
    tol = target.logprob_tol
    assert mean <= tol and worst <= 10 * tol, (
        f"logprobs differ from the teacher: mean {mean:.2e}, max {worst:.2e} (tolerance {tol:g})"
    )


def assert_spans_cover(meta: dict, num_tokens: int) -> list[dict] | None:
    """Check `weight_versions` spans if the server sends them: in order, `end` exclusive,
    every output token exactly once. Returns them (None when absent)."""
    spans = meta.get("weight_versions")
    if spans is None:
        return None
    position = 0
    for span in spans:
        assert set(span) >= {"version", "start", "end"}, span
        assert isinstance(span["version"], str), span
        assert span["start"] == position and span["end"] > span["start"], spans
        position = span["end"]
    assert position == num_tokens, (spans, num_tokens)
    return spans


def perturbed(weights: dict, *, seed: int, scale: float = 0.02) -> dict:
    """New weights: each tensor plus seeded noise (so every layer changes)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        for name, tensor in weights.items()
    }
