"""The bodies of SGLang's HTTP protocol as the embedded engine reads and writes them.

Pure functions of the JSON: `parse_generate` turns a `/generate` body into
per-sample prompts, rids and core `SamplingParams` (a `BadRequest` for anything
SGLang would refuse), and `render_result` turns a core `Output` back into
SGLang's response object. The choices where SGLang leaves room:

- `meta_info.weight_versions` is always present: spans `{version, start, end}`
  over output tokens, `end` exclusive, covering every output token in order
  (empty when there are no output tokens). `meta_info.weight_version` is the
  version of the last output token (the engine's version when there is none).
- `n` > 1 expands every prompt into n samples, prompt-major (all samples of
  prompt 0, then prompt 1, ...); the response is then a list. Sample j gets rid
  `"{rid}-{j}"` and, with `sampling_seed` s, seed s + j (so samples differ).
- Unknown `sampling_params` keys are a 400 (as SGLang 0.5.23); unknown
  top-level keys are ignored (sglang-router adds `model`, `return_bytes`, ...).
- `stream: true` (one prompt, n = 1 only) answers server-sent events, each the
  whole response so far (cumulative, SGLang's default), `finish_reason` null
  until the last, then `data: [DONE]`.
"""

from __future__ import annotations

import base64
import itertools
import logging
import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from streamrl.engine.core import Output, SamplingParams

logger = logging.getLogger(__name__)

NonNegativeInt = Annotated[int, Meta(ge=0)]


class SamplingBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`sampling_params` of `/generate`, SGLang 0.5.x names and defaults; null = default.

    Unknown keys are refused (SGLang 0.5.23 answers 400 too)."""

    max_new_tokens: NonNegativeInt | None = 128
    temperature: Annotated[float, Meta(ge=0)] | None = 1.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = 1.0
    top_k: int | None = -1  # -1 = whole vocabulary, else >= 1
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = 0.0
    min_new_tokens: NonNegativeInt | None = 0
    n: Annotated[int, Meta(ge=1)] | None = 1  # samples per prompt
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    sampling_seed: int | None = None
    # Accepted and ignored (one warning per key when not neutral).
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict | None = None
    stream_interval: Annotated[int, Meta(ge=1)] | None = None  # tokens per streamed event
    custom_params: Any = None
    # Known to SGLang but changing what is sampled: refused unless null.
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None


_SAMPLING_DEFAULTS = dict(
    zip(SamplingBody.__struct_fields__, SamplingBody.__struct_defaults__, strict=True)
)
_IGNORED_PARAMS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
_IGNORED_PARAMS += ("custom_params",)
_UNSUPPORTED_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
_TEXT_FLAGS = ("n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class BadRequest(Exception):
    """A client error: answered with 400 and `{"error": {"message": ...}}`."""


def sse_event(payload: Any) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body


def version_spans(versions: list[str]) -> list[dict]:
    """Per-token versions -> `[{version, start, end}]`, `end` exclusive, in token order."""
    if versions and versions[0] == versions[-1] and versions.count(versions[0]) == len(versions):
        return [{"version": versions[0], "start": 0, "end": len(versions)}]  # the common case
    spans: list[dict] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


@dataclass
class GenerateCall:
    """One parsed `/generate` body: per-sample prompts, rids and sampling params."""

    prompts: list[list[int]]
    rids: list[str]
    params: list[SamplingParams]  # one per sample
    is_single: bool
    return_logprob: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    return_routed_experts: bool = False
    stream: bool = False
    stream_interval: int = 1
    """A streamed call sends an event at the first output token and then every this many
    (SGLang's rule: after token k when k % interval == 1, every token at 1), and at the end."""


def parse_generate(
    body: dict, *, tokenizer: Any, in_flight: Container[str], warned: set[str]
) -> GenerateCall:
    """A `/generate` body -> one `GenerateCall` (BadRequest on anything SGLang would refuse).

    `in_flight` holds the rids the server runs now (a duplicate is refused); `warned`
    collects the ignored sampling keys already logged once."""
    prompts, is_single = _prompts(body, tokenizer)
    per_prompt, flags = sampling_params(body.get("sampling_params"), len(prompts), warned)
    rid = body.get("rid")
    if rid is None:
        base_rids = [new_rid() for _ in prompts]
    elif isinstance(rid, str) and is_single:
        base_rids = [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        base_rids = rid
    else:
        raise BadRequest("rid must be a string (one prompt) or a list of strings (a batch)")
    if len(base_rids) != len(prompts):
        raise BadRequest(f"{len(base_rids)} rids for {len(prompts)} prompts")
    num_samples = flags["n"]
    call = GenerateCall(
        prompts=[],
        rids=[],
        params=[],
        is_single=is_single and num_samples == 1,
        return_logprob=bool(body.get("return_logprob", False)),
        skip_special_tokens=flags["skip_special_tokens"],
        spaces_between_special_tokens=flags["spaces_between_special_tokens"],
        no_stop_trim=flags["no_stop_trim"],
        return_routed_experts=bool(body.get("return_routed_experts", False)),
        stream=bool(body.get("stream", False)),
        stream_interval=flags["stream_interval"],
    )
    if call.stream and not call.is_single:
        raise BadRequest("stream=true needs one prompt with n = 1 in the embedded engine")
    for prompt, base_rid, kwargs in zip(prompts, base_rids, per_prompt, strict=True):
        for j in range(num_samples):
            sample = dict(kwargs)
            if num_samples > 1 and sample["seed"] is not None:
                sample["seed"] += j
            call.prompts.append(prompt)
            call.rids.append(base_rid if num_samples == 1 else f"{base_rid}-{j}")
            try:
                call.params.append(SamplingParams(**sample))
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
    duplicates = [r for r in call.rids if r in in_flight]
    if duplicates or len(set(call.rids)) != len(call.rids):
        raise BadRequest(f"duplicate request id(s) in flight: {duplicates or call.rids}")
    return call


_RID_PREFIX = uuid.uuid4().hex[:16]
_rid_counter = itertools.count()


def new_rid() -> str:
    """A fresh request id, 32 hex digits like `uuid4().hex`: this process's random prefix,
    then a counter. `uuid4` reads the OS entropy pool, a system call that gives up the GIL,
    and taking it back from a busy engine thread costs up to the switch interval per call."""
    return f"{_RID_PREFIX}{next(_rid_counter):016x}"


def sampling_params(raw: Any, num_prompts: int, warned: set[str]) -> tuple[list[dict], dict]:
    """Validate `sampling_params` (a dict, or one per prompt) -> per-prompt core kwargs and
    the flags that must agree across a batch (n and the text options)."""
    raws = raw if isinstance(raw, list) else [raw] * num_prompts
    if len(raws) != num_prompts:
        raise BadRequest(f"{len(raws)} sampling_params for {num_prompts} prompts")
    parsed = [_one_sampling_params(item or {}, warned) for item in raws]
    flags = [{key: values.pop(key) for key in _TEXT_FLAGS} for values in parsed]
    if any(f != flags[0] for f in flags):
        raise BadRequest("n and the text options must agree across a batch")
    flags[0]["stream_interval"] = parsed[0].pop("stream_interval") or 1
    for values in parsed[1:]:
        values.pop("stream_interval")
    for values in parsed:
        for key in (*_IGNORED_PARAMS, *_UNSUPPORTED_PARAMS):
            values.pop(key)
        values["seed"] = values.pop("sampling_seed")
        values["stop"] = (
            (values["stop"],) if isinstance(values["stop"], str) else tuple(values["stop"] or ())
        )
        values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
    return parsed, flags[0]


def _one_sampling_params(raw: Any, warned: set[str]) -> dict:
    try:
        body = msgspec.convert(raw, SamplingBody)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"sampling_params: {exc}") from None
    values = {
        key: _SAMPLING_DEFAULTS[key] if value is None else value
        for key, value in msgspec.structs.asdict(body).items()
    }
    if values["top_k"] == 0 or values["top_k"] < -1:
        raise BadRequest("sampling_params.top_k must be -1 (whole vocabulary) or >= 1")
    for key in _UNSUPPORTED_PARAMS:
        if values[key] is not None:
            raise BadRequest(f"sampling_params.{key} is not supported by the embedded engine")
    for key in _IGNORED_PARAMS:
        if values[key] != _SAMPLING_DEFAULTS[key] and key not in warned:
            warned.add(key)
            logger.warning("sampling param %s=%r is accepted but ignored", key, values[key])
    return values


def _prompts(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list")
        is_single = not isinstance(ids[0], list)
        try:  # msgspec checks every id in C (bools and floats are not ints)
            prompts = (
                [msgspec.convert(ids, list[int])] if is_single else msgspec.convert(ids, _BATCH)
            )
        except msgspec.ValidationError:
            raise BadRequest(
                "input_ids must hold integers (one list, or one list per prompt)"
            ) from None
    elif body.get("text") is not None:
        text = body["text"]
        is_single = isinstance(text, str)
        texts = [text] if is_single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        raise BadRequest("either text or input_ids must be given")
    if not all(prompts):
        raise BadRequest("every prompt must be a non-empty list of token ids")
    return prompts, is_single


_BATCH = list[list[int]]


class TextDecoder:
    """`tokenizer.decode(ids, ...)` for output text, through the Rust tokenizer directly when
    that is what `decode` would do anyway (a fast tokenizer with no clean-up pass): the
    Python wrapper's per-token type checks cost four times the decode itself."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._rust = _plain_rust_backend(tokenizer)

    def __call__(
        self, ids: list[int], *, skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> str:
        if self._rust is not None:  # fast tokenizers ignore spaces_between_special_tokens
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )


def _plain_rust_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer under `tokenizer` when its `decode` is transformers' own fast one
    (no subclass override, no clean-up pass), else None."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or backend is None:
        return None
    cls, base = type(tokenizer), PreTrainedTokenizerFast
    if cls.decode is not base.decode or cls._decode is not base._decode:
        return None
    return None if tokenizer.clean_up_tokenization_spaces else backend


def render_result(
    call: GenerateCall,
    output: Output,
    *,
    decode: TextDecoder,
    weight_version: str,
    latency_s: float,
) -> dict:
    """One core `Output` as SGLang's `/generate` response object (`finish_reason` None: a
    streamed response still running)."""
    output_ids = output.output_ids
    finish = output.finish_reason
    matched = finish.get("matched") if finish else None
    text_ids = output_ids
    if (
        finish
        and finish.get("type") == "stop"
        and isinstance(matched, int)
        and not call.no_stop_trim
    ):
        text_ids = output_ids[:-1]
    text = decode(
        text_ids,
        skip_special_tokens=call.skip_special_tokens,
        spaces_between_special_tokens=call.spaces_between_special_tokens,
    )
    if isinstance(matched, str) and matched and not call.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    versions = output.versions
    meta = {
        "id": output.rid,
        "finish_reason": finish,
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": output.cached_tokens,
        "weight_version": versions[-1] if versions else weight_version,
        "weight_versions": version_spans(versions),
        "e2e_latency": latency_s,
    }
    if call.return_logprob:
        # [logprob, token_id, null] per token; tuples encode as JSON arrays.
        meta["output_token_logprobs"] = list(zip(output.logprobs, output_ids, _NONES, strict=False))
    if call.return_routed_experts and output.routed_experts is not None:
        # SGLang's layout: base64 of little-endian int32 [prompt + output - 1, layers, top_k].
        routed = output.routed_experts.astype("<i4", copy=False).tobytes()
        meta["routed_experts"] = base64.b64encode(routed).decode("ascii")
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


_NONES = itertools.repeat(None)


def aborted_before_start(rid: str, num_prompt_tokens: int) -> Output:
    """The result of a request aborted while it waited at the pause gate."""
    return Output(
        rid=rid,
        output_ids=[],
        logprobs=[],
        versions=[],
        finish_reason={"type": "abort", "message": "aborted before it started"},
        prompt_tokens=num_prompt_tokens,
        cached_tokens=0,
    )
