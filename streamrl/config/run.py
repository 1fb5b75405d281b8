"""`RunConfig`: the sections composed into one run, the rules that span sections, and the
values derived from several keys (staleness in force, buffer capacity, GPU placement, how
weights travel).

A rule that spans sections raises in `__post_init__` with a message that names the
dotted keys; `streamrl.config.loading` turns it into a `ConfigError` naming the file.
"""

from __future__ import annotations

from typing import Any

from streamrl.config.sections import (
    DEVICE_STAGED_TRANSPORTS,
    EMPTYING_PAUSES,
    AlgorithmConfig,
    BufferConfig,
    ClusterConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    LearnerConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
    WeightsConfig,
    _Section,
)
from streamrl.placement import engine_gpu_ids


class RunConfig(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    engine: EngineConfig = EngineConfig()
    buffer: BufferConfig = BufferConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    cluster: ClusterConfig = ClusterConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    def __post_init__(self) -> None:
        for problem in _cross_field_problems(self):
            raise ValueError(problem)

    @property
    def effective_max_staleness(self) -> int:
        """eta enforced from the start: `buffer.max_staleness` (`buffer.auto.start` when
        "auto", which the learner then moves), or 0 in sync mode."""
        return 0 if self.train.mode == "sync" else self.buffer.start_staleness

    @property
    def buffer_capacity(self) -> int:
        """Groups the buffer holds: `buffer.capacity`, or (eta + 2) * groups_started_per_step
        with eta the highest bound the run may use (`buffer.auto.limit` when "auto")."""
        if self.buffer.capacity:
            return self.buffer.capacity
        eta = 0 if self.train.mode == "sync" else self.buffer.staleness_limit
        return (eta + 2) * self.groups_started_per_step

    @property
    def groups_started_per_step(self) -> int:
        """Groups admission lets start per version: `rollout.over_sampling_batch_size`, or
        rollout.batch_size when that is 0."""
        return self.rollout.over_sampling_batch_size or self.rollout.batch_size

    @property
    def total_optimizer_steps(self) -> int:
        """train.steps * optimizer_steps_per_step: the optimizer updates of a whole run."""
        return self.train.steps * self.optimizer_steps_per_step

    @property
    def lr_schedule(self) -> dict[str, Any]:
        """The keyword arguments of `streamrl.schedules.lr_at` for the policy: learner.lr,
        lr_warmup_steps, lr_decay_style, min_lr and the decay length (learner.lr_decay_steps,
        or total_optimizer_steps - lr_warmup_steps when that is 0)."""
        learner = self.learner
        decay_steps = learner.lr_decay_steps
        if not decay_steps and learner.lr_decay_style != "constant":
            decay_steps = max(self.total_optimizer_steps - learner.lr_warmup_steps, 0)
        return {
            "lr": learner.lr,
            "warmup_steps": learner.lr_warmup_steps,
            "decay_style": learner.lr_decay_style,
            "decay_steps": decay_steps,
            "min_lr": min(learner.min_lr, learner.lr),
        }

    @property
    def critic_lr(self) -> float:
        """The critic's peak learning rate: learner.critic.lr, or learner.lr when that is 0."""
        return self.learner.critic.lr or self.learner.lr

    @property
    def samples_per_step(self) -> int:
        """rollout.batch_size * rollout.n_samples_per_prompt."""
        return self.rollout.batch_size * self.rollout.n_samples_per_prompt

    @property
    def optimizer_steps_per_step(self) -> int:
        """samples_per_step / learner.global_batch_size (1 when that is 0)."""
        if not self.learner.global_batch_size:
            return 1
        return self.samples_per_step // self.learner.global_batch_size

    @property
    def learner_gpu_ids(self) -> set[int]:
        """The CUDA devices of the learner ranks: `cluster.learner_gpus`, or 0..num_gpus-1."""
        return set(self.cluster.learner_gpus or range(self.learner.num_gpus))

    @property
    def engine_gpu_ids(self) -> set[int]:
        """The CUDA devices of the engines `streamrl run` starts (`streamrl.placement`); empty
        for attached engines (`engine.urls`) or a placement the fleet will refuse."""
        if self.engine.urls:
            return set()
        try:
            placement = engine_gpu_ids(
                self.engine.num_engines, self.engine.tp_size, self.cluster.engine_gpus
            )
        except ValueError:
            return set()
        return {gpu for gpus in placement for gpu in gpus}

    @property
    def pause_mode(self) -> str:
        """`weights.pause_mode` resolved: `auto` is `retract_abort` for SGLang, `in_place`
        otherwise."""
        if self.weights.pause_mode != "auto":
            return self.weights.pause_mode
        return "retract_abort" if self.engine.backend == "sglang" else "in_place"

    def stages_weights_on_device(self, learner_device_type: str) -> bool:
        """Whether a push stages the published tensors on the learner's device, in buffers
        kept from the first push on (`DEVICE_STAGED_TRANSPORTS`); gloo stages them in host
        memory."""
        return self.weight_transport(learner_device_type) in DEVICE_STAGED_TRANSPORTS

    def weight_transport(self, learner_device_type: str) -> str:
        """`weights.transport` resolved: `auto` becomes NCCL when learner and engines are on
        different GPUs; ipc when the engines started here (embedded or SGLang) share the
        learner's one GPU (gloo through host memory ran at ~1 GB/s there, ipc at 25-48 GB/s:
        bench/results/gpu/*_h200x1_ipc.json; SGLang's /update_weights_from_tensor took the
        same payload: docs/sglang.md); gloo otherwise (CPU, mixed placements, attached
        engines). With `cluster.launcher = "ray"`, NCCL whenever the learner is on CUDA and
        `engine.device` is not `cpu`: Ray gives each engine GPUs of its own."""
        if self.weights.transport != "auto":
            return self.weights.transport
        if learner_device_type != "cuda" or self.engine.device == "cpu":
            return "gloo"
        if self.cluster.launcher == "ray":
            return "nccl"  # Ray gives the engines GPUs of their own, maybe on other nodes
        learner, engines = self.learner_gpu_ids, self.engine_gpu_ids
        if engines and not engines & learner:
            return "nccl"
        is_shared = len(learner) == 1 and engines == learner
        if is_shared and not self.engine.urls and not _ipc_problems(self):
            return "ipc"
        return "gloo"


def _cross_field_problems(cfg: RunConfig) -> list[str]:
    problems = []
    gbs = cfg.learner.global_batch_size
    if gbs and cfg.samples_per_step % gbs:
        problems.append(
            f"learner.global_batch_size = {gbs} must divide rollout.batch_size * "
            f"rollout.n_samples_per_prompt = {cfg.samples_per_step}"
        )
    if cfg.algorithm.routing_replay and cfg.learner.backend != "megatron":
        problems.append(
            "algorithm.routing_replay needs learner.backend = 'megatron' (the torch backend "
            "runs transformers' own MoE layers, which cannot take another router's choice)"
        )
    if (
        cfg.train.mode == "async"
        and cfg.buffer.staleness_limit > 0
        and cfg.algorithm.off_policy_correction == "none"
        and not cfg.algorithm.allow_uncorrected_async
    ):
        problems.append(
            "async training with buffer.max_staleness > 0 needs an off-policy correction: set "
            "algorithm.off_policy_correction to 'decoupled_ppo' or 'tis', or buffer.max_staleness "
            "= 0, or train.mode = 'sync' (algorithm.allow_uncorrected_async = true overrides this)"
        )
    if cfg.buffer.is_auto and cfg.train.mode != "async":
        problems.append(
            f"buffer.max_staleness = 'auto' needs train.mode = 'async' (got "
            f"{cfg.train.mode!r}): the bound follows the learner's waits and its off-policy "
            f"diagnostics, which only an async run has; set a number"
        )
    if cfg.buffer.capacity and cfg.buffer.capacity < cfg.rollout.batch_size:
        problems.append(
            f"buffer.capacity = {cfg.buffer.capacity} is below rollout.batch_size = "
            f"{cfg.rollout.batch_size}: the learner could never get a full batch"
        )
    if not cfg.data.path:
        problems.append("data.path is required (a JSONL/Parquet file or builtin:<task>)")
    if cfg.engine.backend == "sglang" and cfg.model.path.startswith(("random:", "smollm2")):
        problems.append("engine.backend = 'sglang' needs model.path to be a Hugging Face directory")
    if (
        cfg.engine.backend == "sglang"
        and cfg.pause_mode not in EMPTYING_PAUSES
        and "--disable-radix-cache" not in cfg.engine.extra_args
    ):
        problems.append(
            f"weights.pause_mode = {cfg.pause_mode!r} with engine.backend = 'sglang': SGLang "
            f"keeps the KV of requests held across an update in its radix cache, computed "
            f"with the old weights, and new requests with the same prefix would reuse it "
            f"(the cache cannot be flushed while requests are held); use weights.pause_mode "
            f"= 'abort' (the default for SGLang) or 'retract_abort', or add "
            f"'--disable-radix-cache' to engine.extra_args"
        )
    if cfg.learner.backend == "torch" and cfg.learner.num_gpus > 1:
        problems.append("learner.num_gpus > 1 needs learner.backend = 'megatron'")
    mcfg = cfg.learner.megatron
    if cfg.learner.backend == "torch":
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(mcfg, key) > 1:
                problems.append(f"learner.megatron.{key} > 1 needs learner.backend = 'megatron'")
    if mcfg.recompute_layers and not (
        cfg.learner.backend == "megatron" and cfg.learner.gradient_checkpointing
    ):
        problems.append(
            f"learner.megatron.recompute_layers = {mcfg.recompute_layers} needs "
            f"learner.backend = 'megatron' and learner.gradient_checkpointing = true"
        )
    if cfg.learner.backend == "megatron":
        model_parallel = mcfg.tensor_parallel_size * mcfg.pipeline_parallel_size
        if cfg.learner.num_gpus % model_parallel:
            problems.append(
                f"learner.num_gpus = {cfg.learner.num_gpus} must be a multiple of "
                f"learner.megatron.tensor_parallel_size * pipeline_parallel_size = {model_parallel}"
            )
    problems += _update_interval_problems(cfg)
    if cfg.weights.transport == "ipc":
        problems += _ipc_problems(cfg)
    if cfg.cluster.launcher == "ray":
        problems += _ray_problems(cfg)
    names = [d.name for d in cfg.eval.datasets]
    if len(set(names)) != len(names):
        problems.append(f"eval.datasets names must be unique, got {names}")
    problems += _recipe_problems(cfg)
    problems += _lora_problems(cfg)
    problems += _colocate_problems(cfg)
    return problems


def _colocate_problems(cfg: RunConfig) -> list[str]:
    """`cluster.colocate` and `learner.offload` against the schedule and the placement."""
    colocate, offload = cfg.cluster.colocate, cfg.learner.offload
    if not colocate:
        if offload != "none":
            return [
                f"learner.offload = {offload!r} needs cluster.colocate = true: the learner's "
                f"state goes to host memory only while colocated engines generate"
            ]
        return []
    problems = []
    if cfg.train.mode != "sync":
        problems.append(
            f"cluster.colocate = true needs train.mode = 'sync' (got {cfg.train.mode!r}): "
            f"colocated engines hand their GPU memory to the learner for each step, so "
            f"generation and training cannot overlap; set train.mode = 'sync', or "
            f"cluster.colocate = false to keep both resident"
        )
    if cfg.cluster.launcher == "ray":
        problems.append(
            "cluster.colocate = true needs cluster.launcher = 'local': Ray gives the engines "
            "GPUs of their own"
        )
    if cfg.learner.lora.is_enabled:
        problems.append(
            "cluster.colocate = true with learner.lora: an update sends only the adapters, and "
            "the base weights an engine released are gone; set cluster.colocate = false"
        )
    engines, learner = cfg.engine_gpu_ids, cfg.learner_gpu_ids
    if engines and not engines & learner:
        problems.append(
            f"cluster.colocate = true but the engines' GPUs {sorted(engines)} "
            f"(cluster.engine_gpus) share none with the learner's {sorted(learner)} "
            f"(cluster.learner_gpus): there is no memory to hand over; set "
            f"cluster.colocate = false, or put them on the same GPUs"
        )
    return problems


def _lora_problems(cfg: RunConfig) -> list[str]:
    """What LoRA (`learner.lora`) cannot be combined with."""
    lora = cfg.learner.lora
    if not lora.is_enabled:
        return []
    problems = []
    if cfg.learner.backend == "megatron" and lora.dropout > 0:
        problems.append(
            f"learner.lora.dropout = {lora.dropout} needs learner.backend = 'torch': the "
            f"megatron backend's adapters have no dropout (its masks would differ between "
            f"tensor-parallel ranks)"
        )
    if cfg.engine.backend == "sglang" and cfg.learner.megatron.pipeline_parallel_size > 1:
        problems.append(
            "learner.lora with engine.backend = 'sglang' needs "
            "learner.megatron.pipeline_parallel_size = 1: SGLang loads each version's adapter "
            "as one peft directory, written by the first stage's publisher"
        )
    return problems


def _update_interval_problems(cfg: RunConfig) -> list[str]:
    """`weights.update_interval` = N against the staleness bound eta.

    Admission lets the groups of learner step k start only while the engines serve a
    version >= k - eta (`streamrl.queues.admission`). With a push every N versions the
    engines serve floor(k / N) * N, which is k - (N - 1) just before a push: the learner
    at version k = m N + eta + 1 (< (m + 1) N when N > eta + 1) would wait for groups that
    can start only once version (m + 1) N is served, and that version is the learner's
    next push, after the step it waits to take. So N <= eta + 1, and then every trained
    token is within eta versions of the learner, as with N = 1. The modes without a
    publisher (`rollout_only`, `train_only`) push nothing and take any N."""
    interval = cfg.weights.update_interval
    if interval == 1 or cfg.train.mode not in ("async", "sync"):
        return []
    if cfg.train.mode == "sync":
        return [
            f"weights.update_interval = {interval} with train.mode = 'sync': a synchronous "
            f"step trains on the version the engines serve, so every version is pushed; set "
            f"weights.update_interval = 1, or train.mode = 'async' with buffer.max_staleness "
            f">= {interval - 1}"
        ]
    eta = cfg.buffer.start_staleness  # an auto bound never goes below interval - 1 after
    if interval <= eta + 1:
        return []
    key = "buffer.auto.start" if cfg.buffer.is_auto else "buffer.max_staleness"
    return [
        f"weights.update_interval = {interval} is more than {key} + 1 = "
        f"{eta + 1}: the learner would reach a version {eta + 1} ahead of the one the engines "
        f"serve before the next push, and wait for groups that admission starts only once a "
        f"newer version is served (the run stops making progress); set {key} "
        f">= {interval - 1} or weights.update_interval <= {eta + 1}"
    ]


BUILTIN_FILTERS = ("zero_std", "truncated")
"""The names `buffer.filters` accepts besides `module:function` (streamrl.queues.filters)."""


def _recipe_problems(cfg: RunConfig) -> list[str]:
    """The LR schedule, the critic, dynamic sampling and the debug modes."""
    problems = []
    learner, rollout, train = cfg.learner, cfg.rollout, cfg.train
    if learner.min_lr > learner.lr:
        problems.append(
            f"learner.min_lr = {learner.min_lr} must be at most learner.lr = {learner.lr}"
        )
    schedule = cfg.lr_schedule
    if schedule["decay_style"] != "constant" and schedule["decay_steps"] < 1:
        problems.append(
            f"learner.lr_decay_style = {learner.lr_decay_style!r} has no steps to decay over: "
            f"learner.lr_warmup_steps = {learner.lr_warmup_steps} covers all "
            f"{cfg.total_optimizer_steps} optimizer steps of the run; set learner.lr_decay_steps"
        )
    if rollout.over_sampling_batch_size and rollout.over_sampling_batch_size < rollout.batch_size:
        problems.append(
            f"rollout.over_sampling_batch_size = {rollout.over_sampling_batch_size} must be 0 "
            f"or at least rollout.batch_size = {rollout.batch_size}"
        )
    for index, name in enumerate(cfg.buffer.filters):
        module, sep, function = name.partition(":")
        if name not in BUILTIN_FILTERS and not (sep and module and function):
            problems.append(
                f"buffer.filters[{index}] = {name!r} is neither a built-in filter "
                f"({', '.join(BUILTIN_FILTERS)}) nor 'module:function'"
            )
    if train.mode == "train_only" and not train.load_rollouts:
        problems.append(
            "train.mode = 'train_only' needs train.load_rollouts (a rollouts/ directory)"
        )
    if train.load_rollouts and train.mode != "train_only":
        problems.append(
            f"train.load_rollouts is read only with train.mode = 'train_only' (train.mode = "
            f"{train.mode!r})"
        )
    return problems


def _ray_problems(cfg: RunConfig) -> list[str]:
    """Keys whose meaning assumes one machine, refused when Ray places the components."""
    problems = []
    if cfg.cluster.engine_gpus:
        problems.append(
            "cluster.engine_gpus must be empty with cluster.launcher = 'ray': Ray assigns each "
            "engine engine.tp_size GPUs from its bundle"
        )
    if cfg.weights.transport == "ipc":
        problems.append(
            "weights.transport = 'ipc' needs the engines on the learner's GPU, which "
            "cluster.launcher = 'ray' does not place them on: use 'nccl', 'gloo' or 'auto'"
        )
    return problems


def _ipc_problems(cfg: RunConfig) -> list[str]:
    """Weights by reference need every engine on the learner's (single) device."""
    problems = []
    if cfg.learner.num_gpus > 1:
        problems.append("weights.transport = 'ipc' needs learner.num_gpus = 1")
    devices = (cfg.engine.device, cfg.learner.device)
    if cfg.engine.backend == "embedded" and "auto" not in devices and len(set(devices)) > 1:
        problems.append(
            f"weights.transport = 'ipc' needs the engines on the learner's device "
            f"(engine.device = {devices[0]!r}, learner.device = {devices[1]!r})"
        )
    learner_gpu = (cfg.cluster.learner_gpus or [0])[0]
    engines = cfg.engine_gpu_ids
    if engines and engines != {learner_gpu}:
        problems.append(
            f"weights.transport = 'ipc' needs every engine on the learner's GPU: the engines "
            f"would use GPU(s) {sorted(engines)} (cluster.engine_gpus = "
            f"{cfg.cluster.engine_gpus}, engine.num_engines = {cfg.engine.num_engines}, "
            f"engine.tp_size = {cfg.engine.tp_size}), the learner GPU {learner_gpu}"
        )
    return problems
