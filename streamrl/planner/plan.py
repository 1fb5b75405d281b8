"""A run config -> each GPU's expected peak, and what does not fit, by config key.

Every process on a GPU is a `Usage`: named terms in bytes (`learner.py`, `engine.py`) and
the phases that hold them at once; its peak is its largest phase. A GPU's peak is the sum
of its processes' peaks (an embedded or SGLang engine holds its memory the whole run, so
sharing the learner's GPU adds it to the learner's peak), except in colocated mode
(`cluster.colocate`), where learner and engines take turns: the GPU's peak is the larger
of its two handoff phases, `learner phase` (the learner's peak beside the engines'
released remainder) and `engine phase` (the engines serving beside what the learner keeps
while they do: `learner.offload`, and its weights for the push). `MemoryPlan.to_dict()`
is the breakdown a bench records next to measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import streamrl.planner.engine as engine_terms
import streamrl.planner.learner as learner_terms
from streamrl.backends.megatron.memory import Parallelism
from streamrl.backends.megatron.shapes import ModelShape

GB = 1e9
CUDA_CONTEXT_BYTES = 10**9
"""Per process, outside torch's allocator (CUDA context, kernels, NCCL): an estimate, to be
measured as nvidia-smi's figure less `torch.cuda.max_memory_reserved`."""

STATE_TERMS = ("weights", "gradients", "master_weights", "adam_moments", "reference_weights")
TRAIN_TERMS = ("autocast_weight_copies", "activations", "activation_gradients", "logits")

# What lowers a term: the config keys a refusal names, largest term first.
KEYS_FOR_TERM = {
    "activations": (
        "learner.micro_batch_tokens",
        "learner.gradient_checkpointing",
        "learner.megatron.recompute_layers",
    ),
    "activation_gradients": ("learner.micro_batch_tokens",),
    "logits": ("learner.micro_batch_tokens",),
    "forward_logits": ("learner.logprob_micro_batch_tokens",),
    "autocast_weight_copies": ("learner.backend",),
    "weights": ("learner.megatron.tensor_parallel_size", "learner.lora.rank"),
    "gradients": ("learner.megatron.tensor_parallel_size", "learner.lora.rank"),
    "master_weights": ("learner.num_gpus", "learner.megatron.use_distributed_optimizer"),
    "adam_moments": ("learner.num_gpus", "learner.megatron.use_distributed_optimizer"),
    "optimizer_step_temporaries": ("learner.num_gpus",),
    "reference_weights": ("algorithm.kl_loss_coef",),
    "critic_state": ("algorithm.advantage_estimator",),
    "weight_push_bucket": ("weights.bucket_bytes",),
    "weight_staging": ("weights.transport", "learner.megatron.pipeline_parallel_size"),
    "kv_cache": ("engine.max_batch_size", "engine.max_seq_len"),
    "kv_pool": ("engine.mem_fraction_static",),
    "static_pool": ("engine.mem_fraction_static",),
}

LEARNER_PHASE = "learner phase"
ENGINE_PHASE = "engine phase"
SERVING = "while engines serve"
"""The learner's phase in colocated mode: what it keeps while the engines hold the GPU."""
RELEASED = "released"
"""An engine's phase in colocated mode: what stays after `/release_memory_occupation`."""


@dataclass
class Usage:
    """One process's memory on one GPU."""

    role: str  # "learner" or "engine"
    description: str
    terms: dict[str, int]
    phases: dict[str, tuple[str, ...]]
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> int:
        return sum(self.terms.get(term, 0) for term in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role, "description": self.description, "terms": dict(self.terms),
            "phases": {name: self.phase_bytes(name) for name in self.phases},
            "peak_phase": self.peak_phase, "peak_bytes": self.peak_bytes, "notes": self.notes,
        }  # fmt: skip


@dataclass
class GpuPlan:
    """The processes of one GPU (local launcher: a CUDA device; Ray: a GPU of that role)."""

    name: str
    usages: list[Usage]
    is_colocated: bool = False
    """`cluster.colocate`: its learner and engines take turns (see the module docstring)."""

    @property
    def handoff_phases(self) -> dict[str, int]:
        """Colocated learner and engines on this GPU: the bytes of each handoff phase, the
        learner's and the engines'; empty when they do not take turns here."""
        roles = {usage.role for usage in self.usages}
        if not self.is_colocated or roles != {"learner", "engine"}:
            return {}
        learner = [u for u in self.usages if u.role == "learner"]
        engines = [u for u in self.usages if u.role == "engine"]
        return {
            LEARNER_PHASE: sum(u.peak_bytes for u in learner)
            + sum(u.phase_bytes(RELEASED) for u in engines),
            ENGINE_PHASE: sum(u.phase_bytes(SERVING) for u in learner)
            + sum(u.phase_bytes("serve") for u in engines),
        }

    @property
    def peak_bytes(self) -> int:
        phases = self.handoff_phases
        if phases:
            return max(phases.values())
        return sum(usage.peak_bytes for usage in self.usages)


@dataclass
class MemoryPlan:
    model: str
    num_parameters: int
    gpus: list[GpuPlan]
    gpu_bytes: float | None  # None: no size known, the plan is not checked
    gpu_bytes_source: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    processes: dict[str, Usage] = field(default_factory=dict)
    """Each process by the name a run's measured memory gives it (`learner rank 0`,
    `engine 1`): its usage on one of its GPUs."""

    def to_dict(self) -> dict[str, Any]:
        """The whole breakdown, in bytes (JSON-ready)."""
        return {
            "model": self.model, "num_parameters": self.num_parameters,
            "gpu_bytes": self.gpu_bytes, "gpu_bytes_source": self.gpu_bytes_source,
            "gpus": [
                {"gpu": gpu.name, "peak_bytes": gpu.peak_bytes,
                 "handoff_phases": gpu.handoff_phases,
                 "usages": [usage.to_dict() for usage in gpu.usages]}
                for gpu in self.gpus
            ],
            "problems": self.problems, "notes": self.notes,
        }  # fmt: skip


# ---- the learner and the engines of a config


def learner_setup(shape: ModelShape, cfg: Any, *, tokens: int) -> learner_terms.LearnerSetup:
    """`cfg.learner` (and the KL coefficient) as the learner terms read them."""
    learner, megatron = cfg.learner, cfg.learner.megatron
    is_megatron = learner.backend == "megatron"
    layout = Parallelism(
        num_gpus=learner.num_gpus,
        tp=megatron.tensor_parallel_size if is_megatron else 1,
        pp=megatron.pipeline_parallel_size if is_megatron else 1,
        ep=megatron.expert_model_parallel_size if is_megatron else 1,
    )
    # Megatron turns sequence parallelism on for MoE and MLA models at TP > 1.
    always_sp = shape.moe is not None or shape.mla is not None
    lora = learner.lora
    return learner_terms.LearnerSetup(
        backend=learner.backend, layout=layout,
        compute_bytes=4 if learner.dtype == "float32" else 2, tokens=tokens,
        recompute=learner.gradient_checkpointing,
        recompute_layers=megatron.recompute_layers if is_megatron else 0,
        reference=cfg.algorithm.kl_loss_coef > 0,
        distributed_optimizer=megatron.use_distributed_optimizer,
        sequence_parallel=layout.tp > 1 and (megatron.sequence_parallel or always_sp),
        lora_rank=lora.rank, lora_targets=tuple(lora.target_modules) if lora.rank else (),
    )  # fmt: skip


def longest_sequence(cfg: Any) -> int:
    """Prompt + response tokens of the longest sample: engine.max_seq_len, or the prompt
    limit plus max_new_tokens when that is larger."""
    sampled = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    return max(cfg.engine.max_seq_len, sampled)


def learner_usage(shape: ModelShape, cfg: Any, critic: ModelShape | None) -> Usage:
    """One learner rank: its state, one micro-batch's work, the optimizer step, a push."""
    tokens = max(cfg.learner.micro_batch_tokens, longest_sequence(cfg))
    setup = learner_setup(shape, cfg, tokens=tokens)
    terms = {
        name: getattr(learner_terms, name)(shape, setup)
        for name in (*STATE_TERMS, *TRAIN_TERMS, "optimizer_step_temporaries")
    }
    if critic is not None:  # trained in its own passes: its state only
        terms["critic_state"] = sum(
            getattr(learner_terms, name)(critic, setup) for name in STATE_TERMS[:-1]
        )
    if cfg.train.mode not in ("train_only", "rollout_only"):
        if stages_weights_on_gpu(cfg):
            terms["weight_staging"] = learner_terms.weight_staging(shape, setup)
        else:
            terms["weight_push_bucket"] = cfg.weights.bucket_bytes
    terms["cuda_context"] = CUDA_CONTEXT_BYTES
    # the staging buffers stay from the first push on (`streamrl.weights.staging`)
    state = (*STATE_TERMS, "critic_state", "weight_staging", "cuda_context")
    phases = {
        "train": (*state, *TRAIN_TERMS),
        "optimizer step": (*state, "optimizer_step_temporaries"),
        "weight push": (*state, "weight_push_bucket"),
    }
    forward_tokens = max(cfg.learner.logprob_micro_batch_tokens, longest_sequence(cfg))
    if forward_tokens > tokens:  # larger forward-only micro-batches: their logits may peak
        forward_setup = learner_setup(shape, cfg, tokens=forward_tokens)
        terms["forward_logits"] = learner_terms.forward_logits(shape, forward_setup)
        phases["log-probabilities"] = (*state, "forward_logits")
    if cfg.cluster.colocate:  # the weights are on the device for the push after a resume
        kept = ("weights", "reference_weights", "critic_state", "weight_staging", "cuda_context")
        phases[SERVING] = (
            *(state if cfg.learner.offload == "none" else kept),
            "weight_push_bucket",
        )
    layout = setup.layout
    parallel = (
        f"TP {layout.tp} x PP {layout.pp} x DP {layout.dp}"
        + (f" (EP {layout.ep})" if layout.ep > 1 else "")
        if setup.backend == "megatron"
        else "one GPU"
    )
    description = (
        f"learner ({setup.backend}, {parallel}, {'bf16' if setup.compute_bytes == 2 else 'fp32'}, "
        f"{tokens} tokens per micro-batch, "
        f"{_recompute_words(setup)})"
    )
    return Usage("learner", description, terms, phases)


def stages_weights_on_gpu(cfg: Any) -> bool:
    """Whether a push stages the published tensors on the learner's GPU: NCCL and CUDA IPC
    (`publish.factory`) carry tensors from there; gloo stages in host memory, and LoRA adapters
    reach SGLang as files."""
    if cfg.learner.lora.is_enabled and cfg.engine.backend == "sglang":
        return False
    return cfg.stages_weights_on_device("cuda")


def _recompute_words(setup: learner_terms.LearnerSetup) -> str:
    if not setup.recompute:
        return "no recompute"
    if setup.recompute_layers:
        return f"recompute of {setup.recompute_layers} layers a stage"
    return "recompute"


def embedded_engine_usage(shape: ModelShape, cfg: Any) -> Usage:
    engine = cfg.engine
    compute_bytes = 4 if engine.dtype == "float32" else 2
    compact = engine_terms.is_compact(shape, engine.runner)
    terms = {
        "weights": engine_terms.weights(shape, tp_size=1, weight_bytes=compute_bytes),
        "kv_cache": engine_terms.embedded_kv_cache(
            shape, max_batch_size=engine.max_batch_size, max_seq_len=engine.max_seq_len,
            compute_bytes=compute_bytes, compact=compact,
        ),
        "prefill_activations": engine_terms.prefill_activations(
            shape, tokens=engine_terms.EMBEDDED_PREFILL_TOKENS, compute_bytes=compute_bytes
        ),
        "decode_logits": engine_terms.decode_logits(shape, max_batch_size=engine.max_batch_size),
        "cuda_context": CUDA_CONTEXT_BYTES,
    }  # fmt: skip
    phases = {"serve": tuple(terms), **_released(cfg)}
    runner = "compact" if compact else "transformers"
    description = (
        f"embedded engine ({runner} runner, batch {engine.max_batch_size} x "
        f"{engine.max_seq_len} tokens)"
    )
    return Usage("engine", description, terms, phases)


def sglang_engine_usage(shape: ModelShape, cfg: Any, gpu_bytes: float | None) -> Usage:
    engine = cfg.engine
    weight_bytes = 1 if "fp8" in " ".join(engine.extra_args) else 2
    weights = engine_terms.weights(shape, tp_size=engine.tp_size, weight_bytes=weight_bytes)
    terms = {"weights": weights}
    notes = []
    if gpu_bytes is not None:
        pool = engine_terms.sglang_kv_pool(
            shape, gpu_bytes=gpu_bytes, mem_fraction_static=engine.mem_fraction_static,
            weight_bytes=weights,
        )  # fmt: skip
        per_token = engine_terms.kv_bytes_per_token(shape, tp_size=engine.tp_size, compute_bytes=2)
        max_total_tokens = _flag_int(engine.extra_args, "--max-total-tokens")
        if max_total_tokens and pool > 0:  # SGLang takes the smaller of the two
            pool = min(pool, int(max_total_tokens * per_token))
        terms["kv_pool"] = pool
        if pool > 0:
            num_tokens = int(pool / per_token)
            notes.append(
                f"KV pool {num_tokens:,} tokens ({num_tokens // engine.max_seq_len} sequences "
                f"of engine.max_seq_len = {engine.max_seq_len})"
            )
    terms["runtime"] = engine_terms.SGLANG_RUNTIME_BYTES
    terms["cuda_context"] = CUDA_CONTEXT_BYTES
    description = (
        f"sglang engine (TP {engine.tp_size}, mem_fraction_static {engine.mem_fraction_static})"
    )
    return Usage("engine", description, terms, {"serve": tuple(terms), **_released(cfg)}, notes)


def _released(cfg: Any) -> dict[str, tuple[str, ...]]:
    """The `released` phase of a colocated engine: its CUDA context only (SGLang 0.5.17 on
    the H200 held 1.9 GB in all after a release of every tag: docs/memory.md)."""
    return {RELEASED: ("cuda_context",)} if cfg.cluster.colocate else {}


def _flag_int(args: list[str], flag: str) -> int | None:
    """The integer value of `flag` in an argv tail (`--flag N` or `--flag=N`), or None."""
    for index, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name != flag:
            continue
        if not sep and index + 1 < len(args):
            value = args[index + 1]
        try:
            return int(value)
        except ValueError:
            return None
    return None
