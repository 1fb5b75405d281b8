"""A session: one episode's API calls as turns of one token-exact trajectory.

Every call records a `Node`: the conversation as the client will send it back (its
messages plus the assistant reply the gateway returned) and the trajectory that holds
exactly the tokens behind it. A new call is matched against the recorded nodes:

- it *extends* a node when its messages start with that node's messages (and its tool
  list is the same): the node's tokens are reused as they are, and only the new
  messages are rendered (`ChatTemplate.continuation_ids`, masked);
- when the node it extends is not one of the previous call's, or none matches and the
  session already has nodes, the agent has edited, truncated or rewound its history:
  *divergence*. With `on_divergence = "branch"` (default) the call starts a new branch
  (from the matched node, or rendered from scratch) and the session counts it; with
  `"error"` it is refused with 409 naming the first message that differs.

The episode's trajectory is the branch of the session's last call (its first choice
when it asked for n > 1): prompt ids of the branch's first render, then model tokens
(`loss_mask` 1, their logprobs and versions) and rendered observations (`loss_mask` 0)
in order, as the engine saw them. Model tokens of other branches are counted
(`gateway/abandoned_model_tokens`), not trained.

`/v1/completions` calls are the same with text: a prompt that starts with a node's text
(its prompt plus the completion returned) reuses that node's tokens and tokenizes only
the rest; a prompt of token ids is matched by ids.
"""

from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from streamrl.agents.api import Completion, GenerateContext, Trajectory
from streamrl.agents.gateway.calls import ChatRequest, Choice, Reply, Sampling, TextRequest
from streamrl.agents.gateway.messages import Message, RequestError, ToolSpec, describe_difference
from streamrl.agents.gateway.templates import ChatTemplate, TemplateError
from streamrl.agents.gateway.tool_calls import parse_turn
from streamrl.fleet.client import EngineError
from streamrl.types import FinishReason


@dataclass
class SessionOptions:
    max_calls: int = 0
    """Model calls per episode at most (a call with n > 1 counts once); 0: no limit."""
    max_total_tokens: int = 0
    """Context plus new tokens per call at most; 0: no limit beyond the engine's."""
    max_new_tokens: int = 0
    """Cap on a call's max_tokens; 0: the episode's `max_new_tokens` sampling param."""
    on_divergence: Literal["branch", "error"] = "branch"
    sampling: Literal["config", "request"] = "config"
    """`config`: temperature / top_p / top_k are the episode's, whatever a request says
    (the learner computes logprobs at rollout.sampling.temperature); `request`: a
    request's values are used (behaviour logprobs are then of that distribution)."""


@dataclass
class Node:
    kind: Literal["chat", "text"]
    trajectory: Trajectory
    output_ids: list[int]
    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    text: str | None = None
    """Text kind: the prompt plus the completion returned (what a continuation starts with)."""
    reply: str = ""
    """The reply's content (chat) or completion text: what the episode's reward scores."""
    num_children: int = 0
    num_tool_calls: int = 0
    """Tool calls the model made along this branch (not those of history a client sent)."""

    @property
    def context_ids(self) -> list[int]:
        return list(self.trajectory.prompt_ids or []) + self.trajectory.response_ids


@dataclass
class SessionResult:
    trajectory: Trajectory
    messages: list[dict[str, Any]]
    """The trained branch's conversation in OpenAI's form, ending with its last reply."""
    text: str
    """The last reply's content (or completion text)."""


class Session:
    """One episode's calls (see the module docstring)."""

    def __init__(
        self, session_id: str, ctx: GenerateContext, template: ChatTemplate, options: SessionOptions
    ) -> None:
        self.session_id = session_id
        self.ctx = ctx
        self.template = template
        self.options = options
        self.nodes: list[Node] = []
        self.latest: list[Node] = []
        self.counters: collections.Counter = collections.Counter()
        self.openai_base_url = ""
        """The base URL of an OpenAI client for this session (the gateway sets it)."""
        self.anthropic_base_url = ""
        """The base URL of an Anthropic client for this session."""
        self._lock = anyio.Lock()

    # ---------------------------------------------------------------- chat

    async def chat(self, request: ChatRequest) -> Reply:
        if request.messages and request.messages[-1].role == "assistant":
            raise RequestError(
                "the last message is an assistant message (a prefill): not supported"
            )
        async with self._lock:
            self._count_call()
            base = self._match_chat(request)
            try:
                if base is None:
                    prompt_ids = self.template.prompt_ids(request.messages, request.tools)
                    suffix: list[int] = []
                else:
                    prompt_ids = None
                    suffix = self.template.continuation_ids(
                        base.messages, request.messages, request.tools, base.output_ids
                    )
            except TemplateError as exc:
                raise RequestError(f"chat template: {exc}") from None
        context = (base.context_ids if base else prompt_ids) + suffix
        completions = await self._generate(context, request.sampling)
        parse = self.template.tool_format if request.tools and request.parse_tools else None
        choices = [self._choice(i, c, request.sampling, parse) for i, c in enumerate(completions)]
        async with self._lock:
            nodes = []
            for completion, choice in zip(completions, choices, strict=True):
                reply = Message("assistant", choice.content, tuple(choice.tool_calls))
                node = Node(
                    "chat",
                    self._extended(base, prompt_ids, suffix, completion),
                    completion.output_ids,
                    messages=(*request.messages, reply),
                    tools=request.tools,
                    reply=choice.content,
                    num_tool_calls=(base.num_tool_calls if base else 0) + len(choice.tool_calls),
                )
                nodes.append(node)
            self._record(base, nodes)
        return Reply(choices, len(context))

    def _match_chat(self, request: ChatRequest) -> Node | None:
        best: Node | None = None
        for node in self.nodes:
            size = len(node.messages)
            if (
                node.kind == "chat"
                and size < len(request.messages)
                and node.tools == request.tools
                and request.messages[:size] == node.messages
                and (best is None or size >= len(best.messages))
            ):
                best = node
        self._check_divergence(best, lambda: self._chat_difference(request))
        return best

    def _chat_difference(self, request: ChatRequest) -> str:
        last = self.latest[0]
        if last.tools != request.tools:
            return "the tool definitions differ from the previous call's"
        return describe_difference(last.messages, request.messages)

    # ---------------------------------------------------------------- completions

    async def complete(self, request: TextRequest) -> Reply:
        async with self._lock:
            self._count_call()
            base = self._match_text(request)
            if request.prompt_ids is not None:
                known = len(base.context_ids) if base else 0
                suffix = list(request.prompt_ids[known:])
            elif base is not None:
                suffix = self.template.encode(request.prompt[len(base.text) :])
            else:  # a raw prompt: the tokenizer adds its BOS, as for pretraining text
                suffix = list(self.ctx.tokenizer(request.prompt)["input_ids"])
        prompt_ids = None if base else suffix
        context = (base.context_ids + suffix) if base else suffix
        if not context:
            raise RequestError("prompt: empty")
        completions = await self._generate(context, request.sampling)
        choices = [self._choice(i, c, request.sampling, None) for i, c in enumerate(completions)]
        async with self._lock:
            nodes = []
            for completion, choice in zip(completions, choices, strict=True):
                text = None if request.prompt is None else request.prompt + choice.text
                trajectory = self._extended(base, prompt_ids, suffix if base else [], completion)
                nodes.append(
                    Node("text", trajectory, completion.output_ids, text=text, reply=choice.text)
                )
            self._record(base, nodes)
        return Reply(choices, len(context))

    def _match_text(self, request: TextRequest) -> Node | None:
        best: Node | None = None
        best_size = -1
        for node in self.nodes:
            if node.kind != "text":
                continue
            if request.prompt_ids is not None:
                ids = node.context_ids
                size = len(ids)
                fits = size <= len(request.prompt_ids) and request.prompt_ids[:size] == ids
            else:
                size = len(node.text or "")
                fits = node.text is not None and request.prompt.startswith(node.text)
            if fits and size >= best_size:
                best, best_size = node, size
        self._check_divergence(best, lambda: "the prompt does not continue the previous call's")
        return best

    # ---------------------------------------------------------------- shared

    def _count_call(self) -> None:
        limit = self.options.max_calls
        if limit and self.counters["calls"] >= limit:
            raise RequestError(
                f"session {self.session_id}: the episode's limit of {limit} model calls is "
                "reached (rollout.generate_kwargs.max_calls)",
                status=429,
                kind="rate_limit_error",
            )
        self.counters["calls"] += 1

    def _check_divergence(self, base: Node | None, difference) -> None:
        """Count (or refuse) a call that does not continue the previous call's reply."""
        if not self.nodes or (base is not None and any(base is n for n in self.latest)):
            return
        if self.options.on_divergence == "error":
            raise RequestError(
                f"session {self.session_id}: the conversation departs from what the session "
                f"recorded ({difference()}); rollout.generate_kwargs.on_divergence = 'error' "
                "allows one branch per episode",
                status=409,
                kind="conflict_error",
            )
        self.counters["forks" if base is not None else "fresh_starts"] += 1

    async def _generate(self, context: list[int], sampling: Sampling) -> list[Completion]:
        budget = self.options.max_new_tokens or int(
            self.ctx.sampling_params.get("max_new_tokens", 128)
        )
        if sampling.max_tokens is not None:
            budget = min(budget, sampling.max_tokens)
        if self.options.max_total_tokens:
            room = self.options.max_total_tokens - len(context)
            if room <= 0:
                raise RequestError(
                    f"the context has {len(context)} tokens, at or past the episode's "
                    f"max_total_tokens = {self.options.max_total_tokens}",
                    kind="context_length_exceeded",
                )
            budget = min(budget, room)
        if budget <= 0:
            raise RequestError("max_tokens must be at least 1")
        overrides = self._overrides(sampling)
        try:
            if sampling.n == 1:
                return [await self.ctx.generate(context, max_new_tokens=budget, **overrides)]
            return await self.ctx.generate_samples(
                context, sampling.n, **{**overrides, "max_new_tokens": budget}
            )
        except EngineError as exc:
            client_error = exc.status is not None and 400 <= exc.status < 500
            raise RequestError(
                f"engine: {exc}", status=400 if client_error else 502, kind="api_error"
            ) from None

    def _overrides(self, sampling: Sampling) -> dict[str, Any]:
        params = self.ctx.sampling_params
        overrides: dict[str, Any] = {}
        if sampling.stop:
            overrides["stop"] = [*params.get("stop", []), *sampling.stop]
        if sampling.seed is not None:
            overrides["sampling_seed"] = sampling.seed
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(sampling, key)
            if value is None or value == params.get(key):
                continue
            if self.options.sampling == "request":
                overrides[key] = value
            else:
                self.counters["sampling_ignored"] += 1
        return overrides

    def _choice(
        self, index: int, completion: Completion, sampling: Sampling, tool_format
    ) -> Choice:
        parsed = parse_turn(completion.text, tool_format)
        self.counters["unparsed_tool_calls"] += len(parsed.problems)
        self.counters["model_tokens"] += len(completion.output_ids)
        if completion.finish_reason == FinishReason.LENGTH:
            finish = "length"
        else:
            finish = "tool_calls" if parsed.calls else "stop"
        return Choice(
            index=index,
            output_ids=list(completion.output_ids),
            logprobs=list(completion.logprobs),
            versions=list(completion.versions),
            text=completion.text,
            content=parsed.content,
            tool_calls=parsed.calls,
            finish=finish,
            stop_sequence=self._matched_stop(completion, sampling) if finish == "stop" else None,
        )

    def _matched_stop(self, completion: Completion, sampling: Sampling) -> str | None:
        """The request's stop string that ended the turn (None when it ended otherwise)."""
        ids = completion.output_ids
        if not sampling.stop or not ids or ids[-1] in self.template.special_ids:
            return None
        text = self.ctx.tokenizer.decode(ids, skip_special_tokens=False)
        ends = {s: text.rfind(s) + len(s) for s in sampling.stop if s and s in text}
        return max(ends, key=ends.get) if ends else None

    @staticmethod
    def _extended(
        base: Node | None, prompt_ids: list[int] | None, suffix: list[int], completion: Completion
    ) -> Trajectory:
        if base is None:
            trajectory = Trajectory(prompt_ids=list(prompt_ids or []))
        else:
            trajectory = copy.deepcopy(base.trajectory)
        if suffix:
            trajectory.add_observation(suffix)
        trajectory.add_completion(completion)
        return trajectory

    def _record(self, base: Node | None, nodes: list[Node]) -> None:
        if base is not None:
            base.num_children += len(nodes)
        self.nodes.extend(nodes)
        self.latest = nodes

    # ---------------------------------------------------------------- the episode

    def result(self) -> SessionResult:
        """The trained branch (see the module docstring) with the session's counters in
        its metadata; raises RuntimeError when the agent made no model call."""
        if not self.latest:
            raise RuntimeError(f"session {self.session_id}: the agent made no model call")
        node = self.latest[0]
        trajectory = copy.deepcopy(node.trajectory)
        trained = sum(trajectory.loss_mask)
        trajectory.text = node.reply
        trajectory.metadata.update(
            {
                "gateway/calls": self.counters["calls"],
                "gateway/branches": sum(1 for n in self.nodes if n.num_children == 0),
                "gateway/forks": self.counters["forks"],
                "gateway/fresh_starts": self.counters["fresh_starts"],
                "gateway/abandoned_model_tokens": self.counters["model_tokens"] - trained,
                "gateway/unparsed_tool_calls": self.counters["unparsed_tool_calls"],
                "gateway/sampling_ignored": self.counters["sampling_ignored"],
                "tool_calls": node.num_tool_calls,
                "turn_versions": turn_versions(trajectory),
            }
        )
        messages = [m.to_openai() for m in node.messages] if node.kind == "chat" else []
        return SessionResult(trajectory, messages, node.reply)


def turn_versions(trajectory: Trajectory) -> list[list[int]]:
    """[oldest, newest] weight version of each model turn's tokens, in order."""
    bounds = [*trajectory.turn_starts, len(trajectory.response_ids)]
    out = []
    for start, end in itertools.pairwise(bounds):
        versions = [
            v
            for v, m in zip(
                trajectory.versions[start:end], trajectory.loss_mask[start:end], strict=True
            )
            if m
        ]
        if versions:
            out.append([min(versions), max(versions)])
    return out
