"""slime's flags, each with the streamrl key it becomes or the reason it has none.

`KEYS`: a flag that sets one config key (its values converted). `SHAPE`: Megatron model
flags (`MODEL_ARGS`): streamrl reads the model's shape from `model.path`'s config.json,
so they are not mapped, only compared with it (`SHAPE_FIELDS`). `NOT_MAPPED`: flags with
no counterpart and why. Flags that set several keys or depend on each other (GPU
counts, KL, custom functions, evaluation sets, debug modes) are handled in
`streamrl.compat.slime.command_line`. docs/slime-mapping.md is the prose form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def one(values: list[str]) -> str:
    return values[0] if values else ""


def integer(values: list[str]) -> int:
    return int(float(one(values)))


def number(values: list[str]) -> float:
    return float(one(values))


def true(values: list[str]) -> bool:
    return True if not values else one(values).lower() not in ("0", "false", "no")


def strings(values: list[str]) -> list[str]:
    return list(values)


def integers(values: list[str]) -> list[int]:
    return [int(value) for value in values]


@dataclass(frozen=True)
class Key:
    """The flag sets `key` to `convert(values)`; `note` says how it differs from slime."""

    key: str
    convert: Callable[[list[str]], Any] = one
    note: str = ""


KEYS: dict[str, Key] = {
    # data
    "--prompt-data": Key("data.path"),
    "--input-key": Key("data.input_key"),
    "--label-key": Key("data.label_key"),
    "--metadata-key": Key("data.metadata_key"),
    "--apply-chat-template": Key("data.apply_chat_template", true),
    "--rollout-shuffle": Key(
        "data.shuffle", true, "reshuffled every epoch with train.seed + epoch"
    ),
    "--rollout-max-prompt-len": Key(
        "data.max_prompt_tokens", integer, "longer prompts are skipped and counted"
    ),
    # rollout
    "--rollout-batch-size": Key("rollout.batch_size", integer),
    "--n-samples-per-prompt": Key("rollout.n_samples_per_prompt", integer),
    "--over-sampling-batch-size": Key("rollout.over_sampling_batch_size", integer),
    "--rollout-max-response-len": Key("rollout.sampling.max_new_tokens", integer, "per model turn"),
    "--rollout-temperature": Key("rollout.sampling.temperature", number),
    "--rollout-top-p": Key("rollout.sampling.top_p", number),
    "--rollout-top-k": Key("rollout.sampling.top_k", integer),
    "--rollout-stop": Key("rollout.sampling.stop", strings),
    "--rollout-stop-token-ids": Key("rollout.sampling.stop_token_ids", integers),
    "--rollout-max-context-len": Key("engine.max_seq_len", integer, "the engine's context length"),
    "--use-rollout-routing-replay": Key("algorithm.routing_replay", true),
    "--dynamic-sampling-filter-path": Key(
        "buffer.filters",
        lambda values: ["zero_std", *(v.replace(".", ":") if ":" not in v else v for v in values)],
        "a filter here is f(group) -> bool, not slime's f(args, samples): rewrite the function",
    ),
    # training
    "--num-rollout": Key("train.steps", integer),
    "--global-batch-size": Key("learner.global_batch_size", integer),
    "--max-tokens-per-gpu": Key("learner.micro_batch_tokens", integer),
    "--log-probs-max-tokens-per-gpu": Key("learner.logprob_micro_batch_tokens", integer),
    "--save": Key("train.output_dir"),
    "--save-interval": Key("train.save_interval", integer),
    "--seed": Key("train.seed", integer),
    "--eval-interval": Key("eval.interval", integer),
    # algorithm
    "--kl-loss-type": Key("algorithm.kl_loss_type"),
    "--entropy-coef": Key("algorithm.entropy_coef", number),
    "--eps-clip": Key("algorithm.eps_clip", number),
    "--eps-clip-high": Key("algorithm.eps_clip_high", number),
    "--eps-clip-c": Key("algorithm.dual_clip_c", number),
    "--tis-clip": Key("algorithm.tis_clip", number),
    "--gamma": Key("algorithm.gamma", number),
    "--lambd": Key("algorithm.lam", number),
    "--value-clip": Key("algorithm.value_clip", number),
    "--critic-load": Key(
        "learner.critic.path",
        one,
        "a Hugging Face directory or a streamrl checkpoint's critic/ (convert a Megatron one)",
    ),
    "--critic-lr": Key("learner.critic.lr", number),
    "--normalize-advantages": Key("algorithm.normalize_advantages", true),
    # optimizer
    "--lr": Key("learner.lr", number),
    "--min-lr": Key("learner.min_lr", number),
    "--lr-decay-style": Key("learner.lr_decay_style"),
    "--lr-warmup-iters": Key(
        "learner.lr_warmup_steps", integer, "update k < W runs at lr (k + 1) / W (Megatron: k / W)"
    ),
    "--weight-decay": Key("learner.weight_decay", number),
    "--adam-beta1": Key("learner.adam_beta1", number),
    "--adam-beta2": Key("learner.adam_beta2", number),
    "--adam-eps": Key("learner.adam_eps", number),
    "--clip-grad": Key("learner.grad_clip", number),
    # parallelism
    "--tensor-model-parallel-size": Key("learner.megatron.tensor_parallel_size", integer),
    "--pipeline-model-parallel-size": Key("learner.megatron.pipeline_parallel_size", integer),
    "--expert-model-parallel-size": Key("learner.megatron.expert_model_parallel_size", integer),
    "--sequence-parallel": Key("learner.megatron.sequence_parallel", true),
    "--use-distributed-optimizer": Key("learner.megatron.use_distributed_optimizer", true),
    "--moe-token-dispatcher-type": Key("learner.megatron.moe_token_dispatcher"),
    "--moe-grouped-gemm": Key("learner.megatron.moe_grouped_gemm", true),
    "--moe-aux-loss-coeff": Key("learner.megatron.moe_aux_loss_coeff", number),
    "--moe-z-loss-coeff": Key("learner.megatron.moe_z_loss_coeff", number),
    "--moe-router-bias-update-rate": Key("learner.megatron.moe_router_bias_update_rate", number),
    "--rollout-num-gpus-per-engine": Key("engine.tp_size", integer),
    "--sglang-mem-fraction-static": Key("engine.mem_fraction_static", number),
    "--update-weight-buffer-size": Key("weights.bucket_bytes", integer),
    # logging
    "--use-wandb": Key("logging.wandb", true),
    "--wandb-project": Key("logging.wandb_project"),
    "--wandb-mode": Key("logging.wandb_mode"),
}

SHAPE_REASON = "model shape: streamrl reads it from model.path's config.json"

SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "--num-layers": ("num_hidden_layers",),
    "--hidden-size": ("hidden_size",),
    "--ffn-hidden-size": ("intermediate_size",),
    "--num-attention-heads": ("num_attention_heads",),
    "--num-query-groups": ("num_key_value_heads",),
    "--kv-channels": ("head_dim",),
    "--vocab-size": ("vocab_size",),
    "--rotary-base": ("rope_theta",),
    "--norm-epsilon": ("rms_norm_eps",),
    "--num-experts": ("num_experts", "n_routed_experts"),
    "--moe-ffn-hidden-size": ("moe_intermediate_size",),
    "--moe-router-topk": ("num_experts_per_tok",),
    "--q-lora-rank": ("q_lora_rank",),
    "--kv-lora-rank": ("kv_lora_rank",),
    "--qk-head-dim": ("qk_nope_head_dim",),
    "--qk-pos-emb-head-dim": ("qk_rope_head_dim",),
    "--v-head-dim": ("v_head_dim",),
}
"""Shape flags with a config.json field to compare against (the first one present)."""

SHAPE: frozenset[str] = frozenset(
    {
        *SHAPE_FIELDS,
        "--swiglu", "--group-query-attention", "--disable-bias-linear", "--add-qkv-bias",
        "--normalization", "--use-rotary-position-embeddings", "--position-embedding-type",
        "--rotary-percent", "--rotary-interleaved", "--no-rope-fusion", "--qk-layernorm",
        "--untie-embeddings-and-output-weights", "--post-self-attn-layernorm",
        "--post-mlp-layernorm", "--seq-length", "--max-position-embeddings",
        "--use-rope-scaling", "--rope-scaling-factor", "--make-vocab-size-divisible-by",
        "--moe-layer-freq", "--moe-shared-expert-intermediate-size",
        "--moe-router-score-function", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-router-pre-softmax", "--moe-router-load-balancing-type", "--moe-router-dtype",
        "--multi-latent-attention", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
        "--spec", "--init-method-std", "--use-mcore-models", "--apply-layernorm-1p",
        "--moe-shared-expert-overlap", "--qk-layernorm-weight-decay",
    }
)  # fmt: skip

_PERF = "a Megatron performance option streamrl does not take (its own kernels: SDPA, fused ops)"

NOT_MAPPED: dict[str, str] = {
    "--ref-load": "the KL reference is model.path's initial weights",
    "--load": "resume with `streamrl run CONFIG --resume` (streamrl checkpoints hold the async state)",
    "--megatron-to-hf-mode": "streamrl converts Hugging Face weights to Megatron itself",
    "--no-load-optim": "a fresh run starts with a fresh optimizer",
    "--no-load-rng": "a fresh run starts from train.seed",
    "--finetune": "a fresh run starts at step 0",
    "--partial-rollout": "always on: a sample aborted by a weight update resumes from its tokens",
    "--mask-offpolicy-in-partial-rollout": (
        "resumed tokens keep their own version and behaviour logprob; decoupled PPO corrects them"
    ),
    "--use-fault-tolerance": "always on (engine.health_interval_s, engine.max_restarts)",
    "--rollout-health-check-interval": "engine.health_interval_s",
    "--rollout-health-check-timeout": "engine.health_timeout_s",
    "--rollout-health-check-first-wait": "an engine counts once its /health answers",
    "--use-dynamic-batch-size": "micro-batches are packed by tokens (learner.micro_batch_tokens, learner.pack_sequences)",
    "--micro-batch-size": "micro-batches are packed by tokens (learner.micro_batch_tokens)",
    "--balance-data": "micro-batches are packed by tokens",
    "--num-steps-per-rollout": "derived: rollout.batch_size * n / learner.global_batch_size",
    "--num-epoch": "the data repeats until train.steps",
    "--rollout-seed": "per-sample seeds come from train.seed with rollout.deterministic = true",
    "--offload": "with --colocate: cluster.colocate and learner.offload = 'all'",
    "--offload-train": "with --colocate: learner.offload = 'all' ('optimizer' keeps the weights)",
    "--offload-rollout": "with --colocate: cluster.colocate releases the engines' memory",
    "--keep-old-actor": "the proximal policy of decoupled PPO is the learner's own forward pass",
    "--kl-coef": "no KL in the reward: use --use-kl-loss (algorithm.kl_loss_coef)",
    "--num-critic-only-steps": "the policy trains from the first step",
    "--bf16": "learner.dtype = 'auto' is bfloat16 on CUDA",
    "--fp16": "learner.dtype takes float32 or bfloat16",
    "--attention-dropout": "RL trains without dropout",
    "--hidden-dropout": "RL trains without dropout",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in float32",
    "--attention-softmax-in-fp32": "softmax runs in float32 in SDPA",
    "--attention-backend": "learner.megatron.attention picks sdpa or local",
    "--use-flash-attn": _PERF,
    "--moe-permute-fusion": _PERF,
    "--overlap-grad-reduce": _PERF,
    "--overlap-param-gather": _PERF,
    "--context-parallel-size": "context parallelism is not supported yet (docs/megatron.md)",
    "--expert-tensor-parallel-size": "expert TP is learner.megatron.tensor_parallel_size",
    "--decoder-last-pipeline-num-layers": "pipeline stages split the layers evenly",
    "--decoder-first-pipeline-num-layers": "pipeline stages split the layers evenly",
    "--optimizer-cpu-offload": "the optimizer stays on the GPU",
    "--overlap-cpu-optimizer-d2h-h2d": "the optimizer stays on the GPU",
    "--use-precision-aware-optimizer": "AdamW keeps float32 state",
    "--sglang-server-concurrency": "admission and engine.max_batch_size bound what is in flight",
    "--sglang-router-ip": "streamrl starts its router; engine.router_url attaches to one",
    "--sglang-router-port": "streamrl starts its router; engine.router_url attaches to one",
    "--wandb-key": "set WANDB_API_KEY",
    "--wandb-host": "set WANDB_BASE_URL",
    "--wandb-team": "set WANDB_ENTITY",
    "--wandb-group": "set WANDB_RUN_GROUP",
    "--wandb-dir": "always run_dir/wandb/",
    "--wandb-run-id": "a --resume continues the same W&B run",
    "--disable-wandb-random-suffix": "the W&B run name is logging.wandb_name or the run directory's",
    "--log-probs-chunk-size": _PERF,
    "--ci-test": "slime's own CI switch",
    "--log-passrate": "the reward statistics are in metrics.jsonl",
    "--rollout-function-path": (
        "the whole rollout loop is streamrl's: bring the per-sample logic as "
        "--custom-generate-function-path"
    ),
    "--rollout-sample-filter-path": "no counterpart (buffer.filters drop whole groups)",
    "--rollout-all-samples-process-path": "no counterpart",
    "--load-debug-rollout-data-subsample": "no counterpart",
    "--save-debug-train-data": "no counterpart",
    "--eval-reward-key": "evaluation sets score with their own reward_fn",
    "--rm-url": "used with --rm-type remote_rm",
}
