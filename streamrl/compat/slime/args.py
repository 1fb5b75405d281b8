"""The `args` a slime generate or reward function reads, filled from the streamrl run.

slime hands its functions the whole argparse namespace of `train.py`; the functions
read a few dozen of its attributes (router address, sampling settings, length limits,
`n_samples_per_prompt`, ...) plus flags their authors added. `build_args` answers the
ones below from the run (the router or first engine of the run, `rollout.sampling`,
the run config through `RunFacts`), then `rollout.generate_kwargs.args` adds or
overrides any attribute by name. Reading any other attribute raises an
`AttributeError` that says where to set it. `GenerateState(args)` gives what slime's
`slime.rollout.sglang_rollout.GenerateState` gives a function: the tokenizer, the
sampling params, a semaphore.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from streamrl.agents.api import GenerateContext


@dataclass(frozen=True)
class RunFacts:
    """What `args` needs from the run config beyond a generate context (set by
    `streamrl.compat.slime.generate.configure` in the rollout process)."""

    model_path: str = ""
    batch_size: int = 0
    n_samples_per_prompt: int = 1
    max_context_len: int = 0
    """engine.max_seq_len: prompt plus response tokens per sequence; 0: unknown."""
    seed: int = 0
    apply_chat_template: bool = True
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    num_engines: int = 1
    engine_tp_size: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> RunFacts:
        """The facts of a `RunConfig`."""
        return cls(
            model_path=cfg.model.path,
            batch_size=cfg.rollout.batch_size,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            max_context_len=cfg.engine.max_seq_len,
            seed=cfg.train.seed,
            apply_chat_template=cfg.data.apply_chat_template,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            metadata_key=cfg.data.metadata_key,
            num_engines=cfg.engine.num_engines,
            engine_tp_size=cfg.engine.tp_size,
        )


class SlimeArgs(argparse.Namespace):
    """slime's namespace of flags; a missing attribute names the key that would set it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"args.{name}: streamrl does not fill this slime flag; set it in "
            f"rollout.generate_kwargs.args (e.g. args = {{ {name} = ... }}), "
            f"docs/slime-functions.md lists the ones it fills"
        )


def build_args(
    ctx: GenerateContext,
    facts: RunFacts,
    *,
    options: Any,
    n_samples_per_prompt: int | None = None,
) -> SlimeArgs:
    """The namespace a slime function reads, for one generate call through `ctx`."""
    engines = ctx.engines
    url = urlsplit((engines.router or engines.engines[0]).url)
    params = ctx.sampling_params
    num_gpus = facts.num_engines * facts.engine_tp_size
    values: dict[str, Any] = {
        "sglang_router_ip": url.hostname,
        "sglang_router_port": url.port,
        "hf_checkpoint": facts.model_path or getattr(ctx.tokenizer, "name_or_path", ""),
        "rollout_max_response_len": params.get("max_new_tokens", 128),
        "rollout_max_context_len": facts.max_context_len or None,
        "rollout_max_prompt_len": None,
        "rollout_temperature": params.get("temperature", 1.0),
        "rollout_top_p": params.get("top_p", 1.0),
        "rollout_top_k": params.get("top_k", -1),
        "rollout_stop": params.get("stop"),
        "rollout_stop_token_ids": params.get("stop_token_ids"),
        "rollout_skip_special_tokens": False,
        "rollout_seed": facts.seed,
        "seed": facts.seed,
        "n_samples_per_prompt": n_samples_per_prompt or facts.n_samples_per_prompt,
        "rollout_batch_size": facts.batch_size,
        "partial_rollout": False,
        "mask_offpolicy_in_partial_rollout": False,
        "custom_generate_function_path": options.function or None,
        "custom_rm_path": options.reward or None,
        "group_rm": options.group_reward,
        "reward_key": options.reward_key or None,
        "eval_reward_key": None,
        "apply_chat_template": facts.apply_chat_template,
        "input_key": facts.input_key,
        "label_key": facts.label_key,
        "metadata_key": facts.metadata_key,
        "rollout_num_gpus": num_gpus,
        "rollout_num_gpus_per_engine": facts.engine_tp_size,
        "sglang_server_concurrency": 512,
        "sglang_dp_size": None,
        "sglang_enable_deterministic_inference": "sampling_seed" in params,
        "sglang_speculative_algorithm": None,
        "use_rollout_routing_replay": ctx.return_routed_experts,
        "use_distributed_post": False,
        "router_policy": None,
        "ci_test": False,
    }
    values.update(options.args)
    args = SlimeArgs(**values)
    args.__dict__["_streamrl_tokenizer"] = ctx.tokenizer
    return args


class GenerateState:
    """slime's per-run generation state, as a function reads it: `tokenizer`, `processor`
    (None: text models only), `sampling_params` (slime's dict from the `rollout_*` flags),
    `semaphore`. One per `args` (slime's is a singleton)."""

    def __new__(cls, args: Any) -> GenerateState:
        state = args.__dict__.get("_streamrl_state")
        if state is None:
            state = super().__new__(cls)
            state._setup(args)
            args.__dict__["_streamrl_state"] = state
        return state

    def _setup(self, args: Any) -> None:
        self.args = args
        self.tokenizer = args.__dict__.get("_streamrl_tokenizer")
        if self.tokenizer is None:
            from streamrl.models import load_tokenizer

            self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency)
        self.sampling_params = sampling_params(args)
        self.aborted = False


def sampling_params(args: Any) -> dict[str, Any]:
    """slime's `sampling_params` for `args` (what its rollout hands a generate function)."""
    params: dict[str, Any] = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    return {key: value for key, value in params.items() if value is not None}
