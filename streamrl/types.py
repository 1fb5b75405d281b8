"""The data of one sample's life: prompts, samples, groups, and the wire codec.

Per-token data is held as numpy arrays and travels as msgpack extension
frames of raw little-endian bytes (dtype code + buffer), so one 1,024-token
sample costs four `memcpy`s on each side instead of 4,096 Python objects.
Fields are only ever appended, so older peers keep decoding newer frames.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec
import numpy as np

NO_VERSION = -1
"""Version of a response token the policy did not produce (tool output, environment text)."""

_NDARRAY_EXT = 1


class FinishReason(enum.StrEnum):
    """Why a sample's generation ended (the engine's report is `fleet.results.EngineFinish`;
    `error`: every engine attempt failed)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SampleStatus(enum.StrEnum):
    OK = "ok"
    REWARD_FAILED = "reward_failed"
    """The reward function raised or timed out; reward is 0 and the error is in metadata."""
    GENERATION_FAILED = "generation_failed"
    """Every engine attempt failed; the sample holds what was generated before that."""


def int_array(values: Any) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


def float_array(values: Any) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32)


class Prompt(msgspec.Struct, kw_only=True):
    """One rendered prompt (`streamrl.data.source.PromptSource` makes them), named by its position
    `seq` in the run's prompt stream: what a generate function gets."""

    seq: int
    """Position in the stream; the key of resume bookkeeping."""
    index: int
    """Row index in the data file (0-based)."""
    epoch: int
    text: str
    """The prompt as rendered (chat template applied when configured)."""
    input_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = {}


class Sample(msgspec.Struct, kw_only=True, gc=False):
    """One trajectory: a prompt and everything after it, token by token.

    `response_ids` holds every token after the prompt, the model's and (in
    multi-turn episodes) the environment's; `loss_mask` is 1 on the model's
    tokens, which alone are trained. For each model token, `logprobs` is the
    behaviour policy's log-probability (of logits / temperature) and
    `versions` the weight version that produced it; both are 0 / NO_VERSION on
    masked tokens.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float = 0.0
    finish_reason: FinishReason = FinishReason.STOP
    status: SampleStatus = SampleStatus.OK
    response_text: str = ""
    metadata: dict[str, Any] = {}
    versions_exact: bool = True
    """False when some token's version is a lower bound of the version that produced it
    (an SGLang response that may straddle an update: `streamrl.agents.api.VersionRule`);
    staleness computed from it is then an upper bound."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay: int16 `[prompt + response tokens - 1, layers * top_k]`, row t the
    experts token t was routed to in every layer (SGLang's `return_routed_experts` layout;
    the last token is never fed), -1 where unknown (dense layers, tokens the engine did not
    report). None without `rollout.return_routed_experts`."""
    turn_starts: list[int] = []
    """Offsets in `response_ids` where each model turn starts, ascending (multi-turn
    episodes; the buffer's per-turn staleness rule reads them). Empty means one turn."""

    def __post_init__(self) -> None:
        self.prompt_ids = int_array(self.prompt_ids)
        self.response_ids = int_array(self.response_ids)
        self.logprobs = float_array(self.logprobs)
        self.versions = int_array(self.versions)
        self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=np.uint8)
        n = len(self.response_ids)
        lengths = {len(self.logprobs), len(self.versions), len(self.loss_mask)}
        if lengths != {n}:
            raise ValueError(
                f"Sample: logprobs, versions and loss_mask need one entry per response token "
                f"({n}), got {len(self.logprobs)}, {len(self.versions)}, {len(self.loss_mask)}"
            )
        if self.routed_experts is not None:  # the wire flattens arrays: rows are implied
            rows = len(self.prompt_ids) + n - 1
            routed = np.asarray(self.routed_experts, dtype=np.int16)
            if rows <= 0 or routed.size % rows:
                raise ValueError(
                    f"Sample: routed_experts of {routed.size} values is not {rows} rows "
                    "(one per token but the last)"
                )
            self.routed_experts = np.ascontiguousarray(routed.reshape(rows, -1))

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def model_versions(self) -> np.ndarray:
        """Versions of the tokens the policy produced (the trained ones)."""
        return self.versions[self.loss_mask.astype(bool)]

    @property
    def oldest_version(self) -> int | None:
        """Oldest weight version among trained tokens; None when nothing is trained."""
        versions = self.model_versions
        return int(versions.min()) if len(versions) else None


class Group(msgspec.Struct, kw_only=True, tag="group"):
    """The n samples of one prompt: the unit of generation, transport and admission.

    `group_id` is unique per run; a resend of the same group is de-duplicated
    by the buffer. `prompt_seq` is the prompt's position in the run's prompt
    stream (epoch * len(data) + position in that epoch's order), which makes
    resuming exact.
    """

    group_id: str
    prompt_seq: int
    prompt_index: int
    epoch: int = 0
    samples: list[Sample] = []
    label: Any = None
    started_at: float = 0.0
    """Unix time the rollout worker took the prompt."""
    finished_at: float = 0.0
    """Unix time the last sample was scored."""
    worker_id: str = ""
    metadata: dict[str, Any] = {}

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def oldest_version(self) -> int | None:
        """Oldest trained-token version over all samples (staleness is measured from it)."""
        versions = [v for s in self.samples if (v := s.oldest_version) is not None]
        return min(versions) if versions else None

    @property
    def newest_version(self) -> int | None:
        versions = [int(s.model_versions.max()) for s in self.samples if s.num_trained_tokens]
        return max(versions) if versions else None

    @property
    def num_versions_spanned(self) -> int:
        """1 + newest - oldest version of its trained tokens (1 = one policy made it all)."""
        oldest, newest = self.oldest_version, self.newest_version
        return 0 if oldest is None else newest - oldest + 1

    @property
    def num_response_tokens(self) -> int:
        return sum(s.num_response_tokens for s in self.samples)

    def staleness(self, version: int) -> int:
        """Learner version minus the oldest trained token's version (0 when nothing is trained)."""
        oldest = self.oldest_version
        return 0 if oldest is None else version - oldest

    def mark_finished(self) -> None:
        self.finished_at = time.time()


class PartialSample(msgspec.Struct, kw_only=True, frozen=True):
    """One sample of a group in flight at a checkpoint's cut: the tokens its model turn had so far
    (each with its behaviour logprob and version), or all of them if it had finished."""

    index: int
    output_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    text: str = ""
    finish_reason: str = ""
    """Empty while the sample was still being generated."""
    versions_exact: bool = True


class PartialGroup(msgspec.Struct, kw_only=True, frozen=True):
    """A group in flight at a checkpoint's cut (`Report(kind="in_flight")`), saved with a checkpoint
    and continued on resume: its prompt is named by `prompt_seq`. `samples` is empty when
    the generate function cannot be continued from tokens (multi-turn episodes): the group
    is then generated again from its prompt."""

    prompt_seq: int
    samples: list[PartialSample] = []


# ---------------------------------------------------------------- codec


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        header = obj.dtype.str.encode().ljust(4)
        return msgspec.msgpack.Ext(_NDARRAY_EXT, header + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype = np.dtype(bytes(data[:4]).strip().decode())
    return np.frombuffer(data[4:], dtype=dtype)


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {type(obj).__name__} as {kind}")


def make_encoder() -> msgspec.msgpack.Encoder:
    """An encoder for any Struct in streamrl's wire protocols (reuse it: it keeps a buffer)."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def make_decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder for `kind` (a Struct or a tagged union of Structs)."""
    return msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook, dec_hook=_dec_hook)
