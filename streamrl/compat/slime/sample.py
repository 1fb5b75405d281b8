"""slime's `Sample`: the mutable record a slime generate function fills, under slime's names.

The fields, `Sample.Status` and the helpers a generate function calls
(`append_response_tokens`, `update_from_meta_info`, `effective_response_length`,
`get_reward_value`) behave as slime documents them. `streamrl.compat.slime.convert`
turns a filled one into streamrl's trajectory; nothing else in streamrl reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(enum.Enum):
    """slime's `Sample.Status` (its values are slime's strings)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_STATUS_OF_FINISH = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class Sample:
    """One prompt's trajectory as slime holds it: `tokens` is prompt + response ids, the last
    `response_length` of them the response; `loss_mask` and `rollout_log_probs` have one
    entry per response token (None means all trained / not recorded)."""

    Status = SampleStatus

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    """One engine version string per engine call (slime's record). streamrl keeps one
    version per token itself, from the calls `post` made (`streamrl.compat.slime.http`)."""
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    """True: kept in its group, but none of its tokens is trained (loss mask all 0)."""
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @property
    def effective_response_length(self) -> int:
        """Trained response tokens: the sum of the loss mask (`response_length` without one)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args: Any) -> float:
        """The reward as a number: `reward[args.reward_key]` when a key is set."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """Record an engine answer's weight version and set the status from its finish
        reason (stop: completed, length: truncated, abort: aborted)."""
        if "weight_version" in meta_info:
            self.weight_versions.append(str(meta_info["weight_version"]))
        finish = meta_info.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind in _STATUS_OF_FINISH:
            self.status = _STATUS_OF_FINISH[kind]

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: list[int] | None = None,
        log_probs: list[float] | None = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens: a model turn (`trainable`, with its engine logprobs) or
        tool / environment output (not trainable: loss mask 0, logprob 0.0)."""
        tokens = [int(token) for token in tokens or ()]
        if log_probs is not None:
            log_probs = [float(value) for value in log_probs]
            if len(log_probs) != len(tokens):
                raise ValueError(f"{len(log_probs)} log_probs for {len(tokens)} tokens")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens need their rollout log_probs")
        if not trainable:
            if log_probs is not None:
                raise ValueError("tokens that are not trainable take no log_probs")
            log_probs = [0.0] * len(tokens)
        before = self.response_length
        if text is not None:
            self.response += text
        if tokens:
            self.tokens = [*self.tokens, *tokens]
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        "the sample has response tokens without rollout_log_probs: "
                        "trainable tokens cannot be appended to it"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            if not tokens:
                meta_info = {k: v for k, v in meta_info.items() if k != "weight_version"}
            self.update_from_meta_info(args, meta_info)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (`status` as its string)."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        return value
