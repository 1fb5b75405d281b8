"""What an engine accepts, checked before a request is sent.

A request an engine cannot serve costs more than its own sample: SGLang 0.5.17 dies
on a token id beyond its embedding (a CUDA device-side assert in the lookup, fatal to
the process: seen on the H200), answers an unknown sampling parameter with HTTP 500 (a
TypeError inside it: the client would take that for a failing engine and retry it for
`rollout.retry_timeout_s`), and refuses a prompt at or past its context length. So
`EngineClient` checks every `/generate` against `RequestLimits` first and raises
`RequestRejected` with a reason; the rollout worker records the sample as failed and
counts the reason. Nothing reaches the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)
"""The `sampling_params` keys SGLang 0.5.17 takes (`sglang/srt/sampling/sampling_params.py`,
`SamplingParams`' public fields); the embedded engine accepts the same set."""

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default when `max_new_tokens` is absent or null."""


class RequestRejected(ValueError):
    """A request refused before sending; `reason` is one of `REASONS` (for counting)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"request rejected ({reason}): {detail}")


REASONS = ("unknown_sampling_param", "token_out_of_vocab", "empty_prompt", "context_overflow")


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What every engine of a run accepts."""

    vocab_size: int
    """Rows of the embedding: token ids must lie in [0, vocab_size)."""
    context_length: int
    """Prompt plus generated tokens per request at most."""

    def check(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any]) -> None:
        """Raise `RequestRejected` unless every prompt and the parameters can be served."""
        unknown = sorted(set(sampling_params) - SAMPLING_KEYS)
        if unknown:
            raise RequestRejected(
                "unknown_sampling_param", f"{unknown} (known: {', '.join(sorted(SAMPLING_KEYS))})"
            )
        max_new = sampling_params.get("max_new_tokens")
        max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new)
        for prompt in prompts:
            if not prompt:
                raise RequestRejected("empty_prompt", "a prompt has no tokens")
            low, high = min(prompt), max(prompt)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise RequestRejected(
                    "token_out_of_vocab", f"token id {bad} outside [0, {self.vocab_size})"
                )
            if len(prompt) + max_new > self.context_length:
                raise RequestRejected(
                    "context_overflow",
                    f"{len(prompt)} prompt tokens + max_new_tokens {max_new} > context length "
                    f"{self.context_length}",
                )


def context_length_of(server_info: Mapping[str, Any], model_max: int) -> int:
    """An engine's context length from its `/server_info`: SGLang's `context_length` (None
    means the model's own), the embedded engine's `max_seq_len`, else `model_max`."""
    for key in ("context_length", "max_seq_len"):
        value = server_info.get(key)
        if isinstance(value, int) and value > 0:
            return min(value, model_max) if key == "context_length" else value
    return model_max
