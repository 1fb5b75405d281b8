"""Multi-turn episodes against an environment, in the model's own chat format.

    context = prompt ids                          (or the environment's first observation, rendered)
    repeat up to max_turns:
        completion = await ctx.generate(context)  # model turn: trained (loss_mask 1), own versions
        result     = await env.step(action text)
        stop if result.done / turn limit / token budget
        context   += observation turn ids         # masked (loss_mask 0), version NO_VERSION

An observation turn is what the chat template writes after the model's turn:
the end of the assistant turn the model did not write itself (for ChatML,
the "\\n" after `<|im_end|>`, or all of `<|im_end|>\\n` when the model was cut
off), the observation as a message of `observation_role` (default "user")
and the assistant header. `ChatFormat` finds these pieces once per tokenizer
by rendering sentinel conversations, and refuses templates for which
rendering a longer conversation does not extend the shorter one's text (the
prefix property), because for them no per-turn token layout is exact.
Model tokens are never re-tokenized: the learner trains on exactly the ids
the engine produced, with the logprob and weight version of each.

Configure with `rollout.generate_fn = "streamrl.agents.env:generate"` and
`rollout.generate_kwargs` (see `EnvOptions`), e.g.

    [rollout.generate_kwargs]
    env = "streamrl.agents.examples.guess_number:GuessNumber"
    max_turns = 12
    env_kwargs = { find_bonus = 1.0 }
"""

from __future__ import annotations

import enum
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.utils import import_object

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What an environment returns for one action."""

    observation: str
    """Text shown to the model as the next turn (ignored when `done`)."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Anything worth keeping; the last step's info lands in the sample's metadata."""


@runtime_checkable
class Environment(Protocol):
    """One episode's state. A new instance is made per episode (per sample)."""

    async def reset(self, prompt: Any) -> str:
        """Start an episode for `prompt` (a `streamrl.types.Prompt`) and return the first
        observation. Returning `prompt.text` unchanged means "the prompt, as the data pipeline
        rendered it, is the first observation" (the usual case); any other string becomes the
        first user turn, rendered with the chat template (see `run_episode`)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the model's turn (its text, special tokens removed)."""
        ...


class EndReason(enum.StrEnum):
    DONE = "done"
    """The environment said the episode is over."""
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    """The next turn or observation would not fit in `max_total_tokens`."""


class TemplateError(ValueError):
    """The tokenizer's chat template cannot give an exact per-turn token layout."""


# ---------------------------------------------------------------- chat format

_SYSTEM, _USER = "SENTINEL_SYSTEM_5d1c", "SENTINEL_USER_5d1c"
_ASSISTANT, _OBSERVATION = "SENTINEL_ASSISTANT_5d1c", "SENTINEL_OBSERVATION_5d1c"


class ChatFormat:
    """The text the chat template puts around an observation turn, found by probing it.

    For ChatML (SmolLM2, Qwen) and role "user":
    `turn_close` = "<|im_end|>\\n", `turn_prefix` = "<|im_start|>user\\n",
    `turn_suffix` = "<|im_end|>\\n<|im_start|>assistant\\n".
    """

    def __init__(self, tokenizer: Any, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.role = role
        self.turn_close, self.turn_prefix, self.turn_suffix = _probe(tokenizer, role)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()))

    def render_first_turn(self, text: str, system_prompt: str = "") -> list[int]:
        """Ids of a conversation [system (if given), user `text`] plus the assistant header."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.encode(rendered)

    def closing(self, model_ids: list[int]) -> str:
        """The part of the template's end-of-assistant-turn text the model did not write.

        A turn that ended on a special token whose text starts `turn_close` (SmolLM2's
        `<|im_end|>`) needs only the rest; a turn cut off by the token limit or a stop
        string needs all of it."""
        if model_ids and model_ids[-1] in self._special_ids:
            emitted = self.tokenizer.decode(model_ids[-1:], skip_special_tokens=False)
            if emitted and self.turn_close.startswith(emitted):
                return self.turn_close[len(emitted) :]
        return self.turn_close

    def observation_text(self, observation: str, model_ids: list[int]) -> str:
        return self.closing(model_ids) + self.turn_prefix + observation + self.turn_suffix

    def observation_ids(self, observation: str, model_ids: list[int]) -> list[int]:
        """Ids appended after a model turn (`model_ids`) to show `observation` and open the
        next assistant turn: exactly the template's text for them."""
        return self.encode(self.observation_text(observation, model_ids))

    def encode(self, text: str) -> list[int]:
        # The template writes every special token itself: never let the tokenizer add a BOS.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _probe(tokenizer: Any, role: str) -> tuple[str, str, str]:
    """(turn_close, turn_prefix, turn_suffix) of `role` turns in `tokenizer`'s template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; multi-turn episodes need one")
    assistant = {"role": "assistant", "content": _ASSISTANT}
    observation = {"role": role, "content": _OBSERVATION}
    heads = (
        [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}],
        [{"role": "user", "content": _USER}],  # templates that refuse a system message
    )
    problem = None
    for head in heads:
        try:
            before = tokenizer.apply_chat_template(
                [*head, assistant], tokenize=False, add_generation_prompt=False
            )
            after = tokenizer.apply_chat_template(
                [*head, assistant, observation], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja raises for roles or orders it refuses
            problem = f"{type(exc).__name__}: {exc}"
            continue
        break
    else:
        raise TemplateError(f"the chat template cannot render a {role!r} turn: {problem}")
    if not after.startswith(before):
        raise TemplateError(
            "the chat template re-renders earlier turns when a turn is added (prefix property "
            f"fails), so per-turn tokens cannot be exact:\n{before!r}\nvs\n{after!r}"
        )
    if before.count(_ASSISTANT) != 1 or after.count(_OBSERVATION) != 1:
        raise TemplateError("the chat template drops or repeats message content")
    close = before[before.index(_ASSISTANT) + len(_ASSISTANT) :]
    prefix, _, suffix = after[len(before) :].partition(_OBSERVATION)
    return close, prefix, suffix


_FORMATS: dict[tuple[int, str], tuple[Any, ChatFormat]] = {}


def chat_format(tokenizer: Any, role: str = "user") -> ChatFormat:
    """The (cached) `ChatFormat` of `tokenizer` for observation turns of `role`."""
    key = (id(tokenizer), role)
    cached = _FORMATS.get(key)
    if cached is None or cached[0] is not tokenizer:
        cached = _FORMATS[key] = (tokenizer, ChatFormat(tokenizer, role))
    return cached[1]


# ---------------------------------------------------------------- the episode loop


@dataclass
class EpisodeLimits:
    max_turns: int
    """Model turns at most."""
    max_total_tokens: int = 0
    """Prompt plus response tokens at most (keep it <= engine.max_seq_len); 0: no limit."""
    max_new_tokens: int = 0
    """Tokens per model turn; 0 means `rollout.sampling.max_new_tokens`."""


async def run_episode(
    ctx: GenerateContext,
    prompt: Any,
    env: Environment,
    limits: EpisodeLimits,
    *,
    chat: ChatFormat | None = None,
    system_prompt: str = "",
    reward: Literal["sum", "last", "reward_fn"] = "sum",
) -> Trajectory:
    """Play one episode of `env` from `prompt`; see the module docstring for the loop.

    `reward`: "sum" sets `trajectory.reward` to the sum of step rewards, "last" to the
    final step's reward (environments that score the whole episode at its end),
    "reward_fn" leaves it None so `rollout.reward_fn` scores `trajectory.text`.
    Metadata: num_turns, done, end_reason, step_rewards, and the last step's info under
    `env_info`. The last observation (after the final model turn) is not appended:
    nothing after it would be trained.
    """
    chat = chat or chat_format(ctx.tokenizer)
    trajectory = Trajectory()
    first = await env.reset(prompt)
    context = list(prompt.input_ids)
    if first != prompt.text:
        rendered = chat.render_first_turn(first, system_prompt)
        if rendered != context:
            trajectory.prompt_ids = rendered
            context = list(rendered)
    per_turn = limits.max_new_tokens or int(ctx.sampling_params.get("max_new_tokens", 128))
    step_rewards: list[float] = []
    info: dict[str, Any] = {}
    end, done = EndReason.MAX_TURNS, False
    for turn in range(limits.max_turns):
        budget = per_turn
        if limits.max_total_tokens:
            budget = min(budget, limits.max_total_tokens - len(context))
            if budget <= 0:
                end = EndReason.TOKEN_BUDGET
                break
        completion = await ctx.generate(context, max_new_tokens=budget)
        trajectory.add_completion(completion)
        context.extend(completion.output_ids)
        action = ctx.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        result = await env.step(action)
        step_rewards.append(float(result.reward))
        info = result.info
        if result.done:
            end, done = EndReason.DONE, True
            break
        if turn + 1 == limits.max_turns:
            break
        observation = chat.observation_ids(result.observation, completion.output_ids)
        if limits.max_total_tokens and len(context) + len(observation) >= limits.max_total_tokens:
            end = EndReason.TOKEN_BUDGET
            break
        trajectory.add_observation(observation)
        context.extend(observation)
    if reward == "sum":
        trajectory.reward = sum(step_rewards)
    elif reward == "last":
        trajectory.reward = step_rewards[-1] if step_rewards else 0.0
    trajectory.metadata.update(
        num_turns=trajectory.num_turns,
        done=done,
        end_reason=str(end),
        step_rewards=step_rewards,
        env_info=info,
    )
    return trajectory


# ---------------------------------------------------------------- the generate function


class EnvOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rollout.generate_kwargs` of `streamrl.agents.env:generate`."""

    env: str
    """`module:Class` (or factory) of the environment; called as `Class(**env_kwargs)`."""
    env_kwargs: dict[str, Any] = {}
    max_turns: int = 10
    """Model turns per episode at most."""
    max_total_tokens: int = 0
    """Prompt plus response tokens per episode at most; 0: no limit (the engine's
    max_seq_len still applies)."""
    max_new_tokens: int = 0
    """Tokens per model turn; 0 means rollout.sampling.max_new_tokens."""
    observation_role: str = "user"
    """Chat role of observation turns."""
    system_prompt: str = ""
    """System message when the environment's first observation is not the prompt."""
    reward: Literal["sum", "last", "reward_fn"] = "sum"
    """How the episode is scored: see `run_episode`."""
    episode_log: str = ""
    """Append one JSON line per episode (turns, end reason, reward, versions) to this file;
    relative paths are from the rollout process's working directory (the repository)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 0 or self.max_new_tokens < 0:
            raise ValueError("max_turns must be >= 1; max_total_tokens, max_new_tokens >= 0")

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.max_total_tokens, self.max_new_tokens)


def parse_options(kwargs: dict[str, Any], kind: type[msgspec.Struct]) -> Any:
    """Validate `rollout.generate_kwargs` into `kind`; errors name the offending key."""
    try:
        return msgspec.convert(kwargs, kind)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"rollout.generate_kwargs: {exc}") from None


def make_env(spec: str, env_kwargs: dict[str, Any]) -> Environment:
    """A fresh environment from its `module:Class` spec."""
    factory = import_object(spec, "rollout.generate_kwargs.env")
    env = factory(**env_kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"rollout.generate_kwargs.env: {spec} has no async reset/step")
    return env


async def generate(ctx: GenerateContext, prompt: Any) -> Trajectory:
    """`rollout.generate_fn` for environments: one episode of `generate_kwargs.env`."""
    options = parse_options(ctx.kwargs, EnvOptions)
    env = make_env(options.env, options.env_kwargs)
    started = time.monotonic()
    try:
        trajectory = await run_episode(
            ctx,
            prompt,
            env,
            options.limits,
            chat=chat_format(ctx.tokenizer, options.observation_role),
            system_prompt=options.system_prompt,
            reward=options.reward,
        )
    finally:
        close = getattr(env, "aclose", None)
        if close is not None:
            await close()
    if options.episode_log:
        log_episode(options.episode_log, prompt, trajectory, time.monotonic() - started)
    return trajectory


generate.needs_chat_template = True
"""Turns are rendered with the tokenizer's chat template (`streamrl check` asks for one)."""


def log_episode(path: str, prompt: Any, trajectory: Trajectory, wall_s: float) -> None:
    """One JSON line describing a finished episode (for length and version statistics)."""
    model_versions = [
        v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m
    ]
    record = {
        "prompt_seq": getattr(prompt, "seq", None),
        "num_turns": trajectory.num_turns,
        "end_reason": trajectory.metadata.get("end_reason"),
        "reward": trajectory.reward,
        "num_response_tokens": len(trajectory.response_ids),
        "num_model_tokens": len(model_versions),
        "oldest_version": min(model_versions, default=None),
        "newest_version": max(model_versions, default=None),
        "num_resumes": trajectory.num_resumes,
        "wall_s": round(wall_s, 3),
        "time": time.time(),
    }
    for key in ("done", "tool_calls", "tool_errors", "tool_timeouts", "has_final_answer"):
        if key in trajectory.metadata:
            record[key] = trajectory.metadata[key]
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
