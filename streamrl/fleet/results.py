"""What one `/generate` answer means: `GenerateResult`, parsed from SGLang's JSON.

Token versions. `GenerateResult.versions` holds one integer per output token,
parsed from the engine's version strings ("default" -> 0, digits -> int). When
the response carries `meta_info.weight_versions` spans (the embedded engine
always sends them) they are expanded and `versions_exact` is True. Without
spans every token gets `meta_info.weight_version`, the version when the
request *finished*, and `versions_exact` is False: for a request that
straddled an update that overstates the freshness of its early tokens, so
staleness computed from such results is a lower bound.

Routed experts (MoE routing replay). With `return_routed_experts` in the
request (SGLang also needs `--enable-return-routed-experts`),
`meta_info.routed_experts` is base64 of a little-endian int32 C-order array of
`prompt_tokens + completion_tokens - 1` rows (every token the engine fed: the
prompt, then each output token but the last), each row the chosen expert ids
of every layer, `num_hidden_layers * num_experts_per_tok` values.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np


class EngineFinish(msgspec.Struct, frozen=True, kw_only=True):
    """Why the engine ended a request, as it reports it (`meta_info.finish_reason`): `type`
    is stop | length | abort; `matched` is the stop token id or string, `length` the token
    budget, `message` the abort reason. A sample's own reason is `streamrl.types.FinishReason`."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """One sample. `logprobs` and `versions` have one entry per output token
    (`logprobs` is empty without `return_logprob`)."""

    rid: str
    text: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    versions_exact: bool
    weight_version: int
    finish_reason: EngineFinish
    prompt_tokens: int
    cached_tokens: int
    meta: dict[str, Any]
    routed_experts: np.ndarray | None = None
    """int32 `[prompt_tokens + len(output_ids) - 1, layers * top_k]`, None when not reported."""

    @property
    def is_aborted(self) -> bool:
        return self.finish_reason.type == "abort"


def parse_version(version: str | int | None) -> int:
    """An engine's weight_version string as an integer: "default" (or None) -> 0, "12" -> 12."""
    if version is None or version == "default":
        return 0
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    if isinstance(version, str) and version.isdigit():
        return int(version)
    raise ValueError(f"weight_version {version!r} is neither 'default' nor an integer")


def parse_routed_experts(encoded: str, num_rows: int) -> np.ndarray:
    """`meta_info.routed_experts` (base64 int32) -> `[num_rows, layers * top_k]`."""
    values = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if num_rows <= 0 or values.size % num_rows:
        raise ValueError(
            f"meta_info.routed_experts holds {values.size} ids, not a whole number per "
            f"token for {num_rows} tokens (prompt_tokens + completion_tokens - 1)"
        )
    return values.reshape(num_rows, -1)


def parse_result(payload: dict) -> GenerateResult:
    """One `/generate` response object -> `GenerateResult`."""
    meta = payload.get("meta_info", {})
    output_ids = list(payload.get("output_ids") or [])
    num_tokens = len(output_ids)
    final_version = parse_version(meta.get("weight_version"))
    spans = meta.get("weight_versions")
    if spans:
        versions = [0] * num_tokens
        covered = 0
        for span in spans:
            start, end = int(span["start"]), int(span["end"])
            versions[start:end] = [parse_version(span["version"])] * (end - start)
            covered += end - start
        if covered != num_tokens:
            raise ValueError(f"weight_versions spans cover {covered} of {num_tokens} tokens")
        exact = True
    else:
        versions = [final_version] * num_tokens
        exact = num_tokens == 0
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    prompt_tokens = int(meta.get("prompt_tokens", 0))
    finish = meta.get("finish_reason") or {"type": "unknown"}
    if isinstance(finish, str):  # some servers send a bare string
        finish = {"type": finish}
    return GenerateResult(
        rid=str(meta.get("id", "")),
        text=payload.get("text", ""),
        output_ids=output_ids,
        logprobs=logprobs,
        versions=versions,
        versions_exact=exact,
        weight_version=final_version,
        finish_reason=EngineFinish(
            type=str(finish.get("type")),
            matched=finish.get("matched"),
            length=finish.get("length"),
            message=finish.get("message"),
        ),
        prompt_tokens=prompt_tokens,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        meta=meta,
        routed_experts=(
            parse_routed_experts(meta["routed_experts"], prompt_tokens + num_tokens - 1)
            if meta.get("routed_experts")
            else None
        ),
    )
