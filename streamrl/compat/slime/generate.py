"""Run a slime generate function and reward function as streamrl's generate function.

    rollout.generate_fn = "streamrl.compat.slime:generate"
    rollout.generate_kwargs = { function = "my_rollout:generate", reward = "my_rm:reward_func" }

For each sample streamrl makes a slime `Sample` of the prompt (`prompt` = the rendered
prompt text, `label`, `metadata`, `group_index` = the prompt's seq, `index`), builds
`args` (`streamrl.compat.slime.args`) and awaits the function with `post` routed through
a `Recorder` (`streamrl.compat.slime.engine_calls`):

- `async def generate(args, sample, sampling_params[, evaluation]) -> Sample`: slime's
  per-sample form, called once per sample, all of a group's samples concurrently;
- `async def generate(args, samples[, evaluation]) -> list[Sample]` (no `sampling_params`
  parameter): the batch form, called once with the group's samples; it needs
  `rollout.generate_fn = "streamrl.compat.slime:generate_group"` (one call per group).

No `function`: one model turn from the prompt's tokens, as slime's own default
`generate` does. Then the reward, unless the function set `sample.reward`:
`reward(args, sample)` (slime --custom-rm-path), or with `group_reward` (slime
--group-rm) `reward(args, samples)` once per group, which needs `generate_group` too.
Neither: `rollout.reward_fn` scores `sample.response`. The returned Sample becomes the
trajectory (`streamrl.compat.slime.trajectory`), each trained token with the weight
version of the engine call that produced it. A sample whose status is `aborted` or
`failed` is recorded as a failed generation; in `generate_group` that fails its group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from streamrl.agents.api import GenerateContext, Trajectory
from streamrl.compat.slime.args import GenerateState, RunFacts, build_args
from streamrl.compat.slime.engine_calls import Recorder, post, recording
from streamrl.compat.slime.sample import Sample
from streamrl.compat.slime.trajectory import to_trajectory
from streamrl.types import Prompt
from streamrl.utils import import_object


class SlimeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rollout.generate_kwargs` of `streamrl.compat.slime:generate` (and `generate_group`)."""

    function: str = ""
    """The slime generate function, `module:function` or slime's `module.function`
    (--custom-generate-function-path); empty: one model turn, as slime's default."""
    reward: str = ""
    """The slime reward function (--custom-rm-path); empty: the function's own
    `sample.reward`, else `rollout.reward_fn` on `sample.response`."""
    group_reward: bool = False
    """Call `reward(args, samples)` once per group (--group-rm); needs generate_group."""
    reward_key: str = ""
    """The entry of a dict reward that is trained on (--reward-key)."""
    reward_timeout_s: float = 60.0
    """A reward call past this is a failed reward (0, counted as rollout.reward_fn's are)."""
    args: dict[str, Any] = {}
    """Extra `args` attributes by name: the function's own flags, or slime flags to override."""


_FACTS = RunFacts()


def configure(cfg: Any) -> None:
    """Take what `args` needs from the run config (the rollout process calls this once)."""
    global _FACTS
    _FACTS = RunFacts.from_config(cfg)
    check_kwargs(dict(cfg.rollout.generate_kwargs))


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Validate `rollout.generate_kwargs` and import the functions it names (`streamrl check`
    calls this); errors name the key."""
    options = _options(kwargs)
    if options.function:
        _load(options.function, "function")
    if options.reward:
        _load(options.reward, "reward")


async def generate(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """One sample of `prompt` through the slime function and reward (module docstring)."""
    options = _options(ctx.kwargs)
    if options.group_reward:
        raise ValueError(
            "rollout.generate_kwargs.group_reward needs the whole group: use "
            "rollout.generate_fn = 'streamrl.compat.slime:generate_group'"
        )
    args = build_args(ctx, _FACTS, options=options)
    sample = _new_sample(prompt, index=None)
    recorder = Recorder(ctx, seed=ctx.sampling_params.get("sampling_seed"))
    function = _function(options)
    with recording(recorder):
        if _is_batch_form(function):
            (sample,) = _as_list(await _call(function, args, [sample]), 1)
        else:
            params = _sampling_params(args, ctx)
            sample = _one(await _call(function, args, sample, params))
    (error,) = await _score(options, args, [sample])
    return _trajectory(sample, recorder, options, error)


async def generate_group(ctx: GenerateContext, prompt: Prompt) -> Trajectory:
    """`generate` for one sample (evaluation); a run calls `for_group` for each group."""
    options = _options(ctx.kwargs)
    if not options.group_reward:
        return await generate(ctx, prompt)
    (trajectory,) = await for_group(ctx, prompt, 1)
    return trajectory


async def for_group(ctx: GenerateContext, prompt: Prompt, n: int) -> list[Trajectory]:
    """The group's n samples: the batch form called once, or the per-sample form n times
    concurrently (sample j with its own engine session and `sampling_seed` + j)."""
    options = _options(ctx.kwargs)
    args = build_args(ctx, _FACTS, options=options, n_samples_per_prompt=n)
    samples = [_new_sample(prompt, index=prompt.seq * n + j) for j in range(n)]
    function = _function(options)
    seed = ctx.sampling_params.get("sampling_seed")
    if _is_batch_form(function):
        recorder = Recorder(ctx, seed=seed, seed_step=1)
        with recording(recorder):
            samples = _as_list(await _call(function, args, samples), n)
        recorders = [recorder] * n
    else:
        recorders = [Recorder(_sample_context(ctx, j), seed=_plus(seed, j)) for j in range(n)]

        async def one(j: int) -> None:
            with recording(recorders[j]):
                params = _sampling_params(args, recorders[j].ctx)
                samples[j] = _one(await _call(function, args, samples[j], params))

        async with anyio.create_task_group() as tg:
            for j in range(n):
                tg.start_soon(one, j)
    errors = await _score(options, args, samples)
    return [
        _trajectory(sample, recorder, options, error)
        for sample, recorder, error in zip(samples, recorders, errors, strict=True)
    ]


generate.configure = configure
generate.check_kwargs = check_kwargs
generate_group.configure = configure
generate_group.check_kwargs = check_kwargs
generate_group.for_group = for_group


# ---------------------------------------------------------------- the default function


async def default_generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One model turn from the prompt's tokens, as slime's default generate function."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if not sample.tokens:
        encoded = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        sample.tokens = list(encoded)
    payload = {
        "input_ids": sample.tokens,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    output = await post(url, payload)
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args,
        tokens=[token for _, token, _ in pairs],
        log_probs=[logprob for logprob, _, _ in pairs],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


# ---------------------------------------------------------------- helpers


def _options(kwargs: dict[str, Any]) -> SlimeOptions:
    try:
        return msgspec.convert(kwargs, SlimeOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"rollout.generate_kwargs: {exc}") from None


@functools.cache
def _load(spec: str, key: str) -> Callable:
    """`module:function`, or slime's `module.function`."""
    if ":" not in spec:
        module, _, name = spec.rpartition(".")
        spec = f"{module}:{name}"
    function = import_object(spec, f"rollout.generate_kwargs.{key}")
    if not callable(function):
        raise ValueError(f"rollout.generate_kwargs.{key}: {spec!r} is not callable")
    return function


def _function(options: SlimeOptions) -> Callable:
    return _load(options.function, "function") if options.function else default_generate


def _is_batch_form(function: Callable) -> bool:
    """slime's per-sample form takes `sampling_params`; the batch form does not."""
    return "sampling_params" not in inspect.signature(function).parameters


async def _call(function: Callable, *args: Any) -> Any:
    if "evaluation" in inspect.signature(function).parameters:
        return await function(*args, evaluation=False)
    return await function(*args)


def _one(result: Any) -> Sample:
    if isinstance(result, list):
        if len(result) != 1:
            raise ValueError(
                f"the slime generate function returned {len(result)} samples for one: "
                f"streamrl trains one trajectory per sample"
            )
        result = result[0]
    if not isinstance(result, Sample):
        raise TypeError(
            f"the slime generate function returned {type(result).__name__}, not a Sample"
        )
    return result


def _as_list(result: Any, n: int) -> list[Sample]:
    samples = list(result) if isinstance(result, list | tuple) else [result]
    if len(samples) != n:
        raise ValueError(f"the slime generate function returned {len(samples)} samples for {n}")
    return [_one(sample) for sample in samples]


def _new_sample(prompt: Prompt, *, index: int | None) -> Sample:
    return Sample(
        group_index=prompt.seq,
        index=index,
        prompt=prompt.text,
        label=prompt.label,
        metadata=dict(prompt.metadata),
    )


def _sampling_params(args: Any, ctx: GenerateContext) -> dict[str, Any]:
    """slime's sampling params plus this sample's `sampling_seed` (deterministic runs)."""
    params = dict(GenerateState(args).sampling_params)
    if "sampling_seed" in ctx.sampling_params:
        params["sampling_seed"] = ctx.sampling_params["sampling_seed"]
    return params


def _plus(seed: int | None, offset: int) -> int | None:
    return None if seed is None else seed + offset


def _sample_context(ctx: GenerateContext, j: int) -> GenerateContext:
    """Sample j's context in a group: its own engine session and seed (`sampling_seed` + j,
    as SGLang's `n` seeds the samples of one call)."""
    params = dict(ctx.sampling_params)
    if "sampling_seed" in params:
        params["sampling_seed"] += j
    return dataclasses.replace(
        ctx, session_key=f"{ctx.session_key}-{j}", sampling_params=params, completions=[]
    )


async def _score(options: SlimeOptions, args: Any, samples: list[Sample]) -> list[str | None]:
    """Set `sample.reward` with the slime reward function, unless the generate function did.
    Returns each sample's reward error: a reward that raises or runs past
    `reward_timeout_s` leaves the reward 0 (the sample is then counted as reward_failed)."""
    errors: list[str | None] = [None] * len(samples)
    if not options.reward:
        return errors
    reward = _load(options.reward, "reward")
    pending = [i for i, sample in enumerate(samples) if sample.reward is None]
    if not pending:
        return errors
    timeout_s = options.reward_timeout_s
    if options.group_reward:
        try:
            values = await _reward_call(reward, args, [samples[i] for i in pending], timeout_s)
            if not isinstance(values, list) or len(values) != len(pending):
                raise ValueError(f"the group reward returned {values!r} for {len(pending)} samples")
        except Exception as exc:
            values = [None] * len(pending)
            for i in pending:
                errors[i] = _error(exc)
        for i, value in zip(pending, values, strict=True):
            samples[i].reward = value
        return errors

    async def one(i: int) -> None:
        try:
            samples[i].reward = await _reward_call(reward, args, samples[i], timeout_s)
        except Exception as exc:
            errors[i] = _error(exc)

    async with anyio.create_task_group() as tg:
        for i in pending:
            tg.start_soon(one, i)
    return errors


def _trajectory(
    sample: Sample, recorder: Recorder, options: SlimeOptions, reward_error: str | None
) -> Trajectory:
    if reward_error is not None:
        sample.reward = 0.0
    trajectory = to_trajectory(
        sample, recorder.calls, floor_version=recorder.floor_version, reward_key=options.reward_key
    )
    trajectory.reward_error = reward_error
    return trajectory


def _error(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout (rollout.generate_kwargs.reward_timeout_s)"
    return f"{type(exc).__name__}: {exc}"


async def _reward_call(reward: Callable, args: Any, what: Any, timeout_s: float) -> Any:
    with anyio.fail_after(timeout_s):
        if inspect.iscoroutinefunction(reward):
            return await reward(args, what)
        result = await anyio.to_thread.run_sync(reward, args, what, abandon_on_cancel=True)
        return await result if inspect.isawaitable(result) else result
