"""MegatronBackend: the LearnerBackend on megatron-core (TP, PP, DP; CPU gloo or CUDA NCCL).

Every learner rank builds one `MegatronBackend` and calls the same methods in
the same order; rank 0 (`is_data_rank`) passes the real micro-batches, the
others pass `[]` (see `batches.py` for how data travels).

One training call (`train_mini_batch`):

    rank 0 micro-batches ──broadcast──► every rank keeps micro-batch i if i % dp == dp_rank
    forward_backward_func (no pipelining / 1F1B)  ── per micro-batch on the last stage:
        vocab-parallel logprobs (+ entropy) ─► loss_fn(mb, logprobs, entropy)
        loss × num_local_micro_batches × dp_size      (see `train_mini_batch`)
    finalize_model_grads (DDP all-reduce, tied-embedding sync)
        ─► every param group's lr = streamrl.schedules.lr_at(updates so far) ─► optimizer.step()
    metrics: summed on the last stage, all-reduced over DP, sent to rank 0

Gradient scale: the loop's losses are already divided by mini-batch totals,
so the wanted gradient is the plain SUM over all micro-batches of all DP
replicas. Megatron divides each returned loss by the local number of
micro-batches and DDP averages over DP ranks; `train_mini_batch` multiplies
both back, so the result is exactly that sum.

Learning rate: streamrl's schedule (`streamrl.schedules`, the torch backend's too), set
on the optimizer's param groups before each step; Megatron's OptimizerParamScheduler is
not used (its warmup ramps by n / W from 0, ours by (n + 1) / W). The count of updates is
saved with the optimizer (`optimizer/schedule.json`), so a resume continues the schedule.

Weights out (`hf_weights`): each pipeline stage has its own publisher (TP rank
0 of DP replica 0) that yields that stage's tensors under HF names with global
layer indices, i.e. one weight-update group per PP stage, as SGLang expects.

The schedule itself, the micro-batches each DP replica runs and the results brought back
to rank 0 are `schedule.py`'s (`self.schedule`); checkpoints are `checkpoint.py`'s.

The critic (`algorithm.advantage_estimator = "gae"`): `self.critic`, a value model in
the same layout that runs through the same `Schedule` with its own DDP and optimizer
(`critic.py`); saved under the checkpoint's `critic/`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from streamrl.backends import flash
from streamrl.backends.base import LossFn, MicroBatch
from streamrl.backends.megatron import (
    checkpoint,
    convert,
    export,
    packing,
    parallel,
    rope,
    routing,
    speed,
    swiglu,
)
from streamrl.backends.megatron import lora as megatron_lora
from streamrl.backends.megatron.cpu_shims import cpu_redirect
from streamrl.backends.megatron.logprobs import token_logprobs_and_entropy
from streamrl.backends.megatron.model import (
    build_gpt_model,
    learner_shape,
)
from streamrl.backends.megatron.schedule import Schedule
from streamrl.backends.offload import HostOffload, optimizer_tensors
from streamrl.backends.staging import StagingPool
from streamrl.weights import adapters


class MegatronBackend:
    """megatron-core GPTModel + DDP + Megatron optimizer behind the LearnerBackend protocol.

    Contract: torch.distributed is initialised on every learner rank before
    construction (`launch.init_distributed`), world size = TP * PP * DP, and on
    CUDA each rank's device is set. `seed` seeds Megatron's RNG and a
    `random:` model (pass the run's `model.seed` so engines build the same one).
    `critic_path` is the model a critic starts from (None: no critic; `critic.py`),
    trained at peak `critic_lr` (0: `cfg.lr`) on the policy's schedule shape.
    """

    def __init__(
        self,
        model_path: str,
        cfg: Any,
        *,
        algorithm_cfg: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        need_reference: bool = False,
        reference_path: str | None = None,
        lr_schedule: dict[str, Any] | None = None,
        critic_path: str | None = None,
        critic_lr: float = 0.0,
        seed: int = 0,
    ) -> None:
        from transformers import AutoConfig

        from streamrl.schedules import lr_at

        self.cfg = cfg
        schedule = lr_schedule or {
            "lr": cfg.lr, "warmup_steps": 0, "decay_style": "constant", "decay_steps": 0,
            "min_lr": 0.0,
        }  # fmt: skip
        lr_at(0, **schedule)  # checked once, here
        self._lr_at = functools.partial(lr_at, **schedule)
        self.num_updates = 0
        """Optimizer steps taken (the schedule's position; saved and restored)."""
        self.algorithm_cfg = algorithm_cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.dtype = dtype
        mcfg = cfg.megatron
        self.compiled = speed.use_compile(mcfg.compile, self.device)
        """torch.compile'd log-softmax, SwiGLU and RoPE kernels (`learner.megatron.compile`);
        on CUDA with Triton, SwiGLU and RoPE by hand-written kernels (`swiglu.py`, `rope.py`)."""
        on_triton = self.compiled and self.device.type == "cuda" and speed.triton_available()
        speed.compiled_rope(self.compiled, kernels=on_triton and rope.agrees(self.device))
        speed.compiled_expert_bias(self.compiled)
        swiglu.use(on_triton and swiglu.agrees(self.device))
        self.flash_attention = flash.choose(cfg.flash_attention, self.device)
        """The attention kernels `learner.flash_attention` chose (`flash.kernel`)."""
        self.layout = parallel.initialize_parallel(
            tp_size=mcfg.tensor_parallel_size,
            pp_size=mcfg.pipeline_parallel_size,
            seed=seed,
            ep_size=mcfg.expert_model_parallel_size,
        )
        self.schedule = Schedule(
            self.layout, device=self.device, attention=mcfg.attention,
            context=self.megatron_context, is_data_rank=self.is_data_rank,
        )  # fmt: skip
        self.model_path = model_path
        self.model_dir, self._model_dir_holder = convert.resolve_model_dir(model_path, seed=seed)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.shape = learner_shape(self.hf_config, mcfg)
        self.vocab_start = self.layout.tp_rank * (self.shape.vocab_size // self.layout.tp_size)
        self.routing_replay = bool(getattr(algorithm_cfg, "routing_replay", False))
        if self.routing_replay and cfg.gradient_checkpointing and self.layout.pp_size > 1:
            raise ValueError(
                "algorithm.routing_replay with learner.gradient_checkpointing needs "
                "pipeline_parallel_size = 1 (a recompute would replay a later micro-batch)"
            )
        if cfg.pack_sequences:
            packing.check_supported(
                self.shape, gradient_checkpointing=cfg.gradient_checkpointing,
                pp_size=self.layout.pp_size,
            )  # fmt: skip
        self.lora = cfg.lora if cfg.lora.is_enabled else None
        if self.lora is not None:
            megatron_lora.check_supported(self.shape)
        self.need_reference = need_reference
        hf_state = convert.HFCheckpoint(self.model_dir)
        with self.megatron_context():
            self.model = self._build_model(hf_state)
            self.adapters = self._install_adapters(seed) if self.lora is not None else []
            self.ddp, self.optimizer = self.wrap_for_training(self.model)
            self.reference = None
            if need_reference and self.lora is None:  # with LoRA: the base, adapters off
                self.reference = self._build_reference(hf_state, reference_path, seed=seed)
        del hf_state
        self.host_offload = HostOffload(self.device)
        """What `offload_to_host` moved out (`learner.offload` with `cluster.colocate`)."""
        self.staging_pool = StagingPool()
        """The host buffers a checkpoint's copy reuses, the critic's too
        (`streamrl.backends.staging`)."""
        self.critic = None
        if critic_path is not None:
            from streamrl.backends.megatron.critic import MegatronCritic

            scale = (critic_lr or cfg.lr) / schedule["lr"]
            self.critic = MegatronCritic(
                self, critic_path, lr_at=lambda step: self._lr_at(step) * scale, seed=seed
            )

    # ------------------------------------------------------------ roles

    @property
    def is_publisher(self) -> bool:
        """True on each PP stage's publisher (TP rank 0 of DP replica 0); rank 0 is stage 0's."""
        return self.layout.is_stage_publisher

    @property
    def is_data_rank(self) -> bool:
        """True on global rank 0: the rank that talks to the buffer and passes micro-batches."""
        return self.layout.rank == 0

    # ------------------------------------------------------------ build

    def megatron_context(self) -> contextlib.AbstractContextManager:
        """Where Megatron calls run: with its CUDA-only calls redirected on CPU."""
        return cpu_redirect() if self.device.type == "cpu" else contextlib.nullcontext()

    def _build_model(self, hf_state: convert.HFCheckpoint) -> torch.nn.Module:
        layout, mcfg = self.layout, self.cfg.megatron
        model = build_gpt_model(
            self.hf_config,
            tp_size=layout.tp_size,
            pp_size=layout.pp_size,
            pp_rank=layout.pp_rank,
            dtype=self.dtype,
            device=self.device,
            attention=mcfg.attention,
            sequence_parallel=mcfg.sequence_parallel,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
            options=mcfg,
            allow_transformer_engine=not self.cfg.lora.is_enabled and not self.cfg.pack_sequences,
            compiled=self.compiled,
        )
        convert.load_into_model(model, hf_state, self.shape, **layout.shard)
        routing.install(model, self.shape, replay=self.routing_replay)
        return model

    def _install_adapters(self, seed: int) -> list[megatron_lora.LoraAdapters]:
        """Freeze the base and attach fresh adapters to this stage's planned linears."""
        layout = self.layout
        plans = megatron_lora.adapter_plans(
            self.shape, tuple(self.lora.target_modules), tp_rank=layout.tp_rank,
            tp_size=layout.tp_size, pp_rank=layout.pp_rank, pp_size=layout.pp_size,
        )  # fmt: skip
        return megatron_lora.install(
            self.model, plans, rank=self.lora.rank, scaling=self.adapter_spec.scaling,
            tp_rank=layout.tp_rank, tp_size=layout.tp_size,
            sequence_parallel=self.model.config.sequence_parallel, seed=seed,
        )  # fmt: skip

    @property
    def adapter_spec(self) -> adapters.AdapterSpec:
        """`learner.lora` as peft's adapter config over this model."""
        lora = self.lora
        return adapters.AdapterSpec(
            rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
            target_modules=tuple(lora.target_modules), base_model=self.model_path,
        )  # fmt: skip

    def _build_reference(
        self, hf_state: convert.HFCheckpoint, reference_path: str | None, *, seed: int
    ) -> torch.nn.Module:
        """The frozen KL reference, from `reference_path` (the run's initial model on a
        resume) or, when that is None, from the policy's own weights."""
        holder = None
        if reference_path is not None and reference_path != str(self.model_dir):
            reference_dir, holder = convert.resolve_model_dir(reference_path, seed=seed)
            hf_state = convert.HFCheckpoint(reference_dir)
        model = self._build_model(hf_state).eval().requires_grad_(False)
        del holder
        return model

    def wrap_for_training(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """(Megatron DDP, Megatron Adam optimizer) around `model`, the policy or the critic,
        with the learner's optimizer settings (the rate is set before each step). On CUDA the
        Adam is torch's fused one; the gradient norm runs on foreach kernels (`speed.py`)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg, distributed = self.cfg, self.cfg.megatron.use_distributed_optimizer
        ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=distributed,
            ),
            module=model,
        )
        model.config.no_sync_func = ddp.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                min_lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.adam_beta1,
                adam_beta2=cfg.adam_beta2,
                adam_eps=cfg.adam_eps,
                clip_grad=cfg.grad_clip,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=distributed,
            ),
            [ddp],
            use_gloo_process_groups=False,  # none are created (parallel.initialize_parallel)
        )
        speed.install_foreach_grad_norm()
        if self.device.type == "cuda":
            speed.use_fused_adam(optimizer)
        return ddp, optimizer

    # ------------------------------------------------------------ colocated mode

    def offload_to_host(self, part: str) -> float:
        """Free this rank's device for colocated engines (`learner.offload`): `optimizer`
        moves Adam's moments and the fp32 main weights (or the distributed optimizer's
        shards of them) to host memory and drops DDP's gradient buffers (zeroed before every
        step); `parameters` moves the model's weights (DDP's parameter buffers where it keeps
        them) and the frozen reference's. Calls add up until `reload_from_host`. Seconds."""
        inner = [
            o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        ]
        model_params = list(self.model.parameters())
        if part == "parameters":
            if self.reference is not None:
                model_params += list(self.reference.parameters())
            return self.host_offload.offload(model_params, [])
        model_storages = {p.untyped_storage()._cdata for p in model_params}
        main_params = [
            p
            for optimizer in inner
            for group in optimizer.param_groups
            for p in group["params"]
            if p.untyped_storage()._cdata not in model_storages
        ]
        kept = [t for optimizer in inner for t in optimizer_tensors(optimizer)] + main_params
        grads = [getattr(p, "main_grad", None) for p in model_params]
        grads += [p.grad for p in model_params + main_params]
        return self.host_offload.offload(kept, grads)

    def reload_from_host(self) -> float:
        """Bring back what `offload_to_host` moved out (gradient buffers zeroed). Seconds."""
        return self.host_offload.reload()

    # ------------------------------------------------------------ forward

    def _logprobs(
        self,
        micro_batch: MicroBatch,
        logits: torch.Tensor,
        *,
        temperature: float,
        need_entropy: bool,
    ):
        return token_logprobs_and_entropy(
            logits,
            micro_batch.input_ids,
            scored_mask(micro_batch),
            vocab_start=self.vocab_start,
            temperature=temperature,
            group=parallel.tp_group() if self.layout.tp_size > 1 else None,
            need_entropy=need_entropy,
            compiled=self.compiled,
        )

    # ------------------------------------------------------------ LearnerBackend

    @torch.no_grad()
    def compute_logprobs(
        self, micro_batches: list[MicroBatch], *, temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        """[B, T] float32 CPU log-probabilities per micro-batch, on rank 0 (others get [])."""
        if reference and not self.need_reference:
            raise RuntimeError(
                "compute_logprobs(reference=True) but the backend was built without need_reference"
            )
        everything, mine, work = self.schedule.local_work(micro_batches)
        if not everything:
            return []

        def loss_for(micro_batch, weight, logits):
            logprobs, _ = self._logprobs(
                micro_batch, logits, temperature=temperature, need_entropy=False
            )
            return logits.new_zeros(()), {"logprobs": logprobs}

        model, adapters_off = self.ddp, contextlib.nullcontext()
        if reference and self.lora is not None:
            adapters_off = megatron_lora.disabled(self.adapters)
        elif reference:
            model = self.reference
        was_training = model.training
        model.eval()
        try:
            with self.megatron_context(), adapters_off:
                store = self.schedule.run(model, work, loss_for, forward_only=True)
        finally:
            model.train(was_training)
        local = [item["logprobs"].float() for item in store][: len(mine)]
        return self.schedule.collect_on_rank0(everything, mine, local)

    def train_mini_batch(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        need_entropy: bool,
    ) -> dict[str, float]:
        """One optimizer step over rank 0's micro-batches; metrics complete on rank 0."""
        everything, _, work = self.schedule.local_work(micro_batches)
        if not everything:
            return {}
        scale = len(work) * self.layout.dp_size

        def loss_for(micro_batch, weight, logits):
            logprobs, entropy = self._logprobs(
                micro_batch, logits, temperature=temperature, need_entropy=need_entropy
            )
            loss, metrics = loss_fn(micro_batch, logprobs, entropy)
            metrics = {name: value.detach().float() * weight for name, value in metrics.items()}
            # Undo Megatron's 1/num_microbatches and DDP's 1/dp average: the gradient is the sum.
            return loss * (weight * scale), metrics

        control = routing.control_of(self.model)
        if control is not None:
            control.reset()
        lr = self._lr_at(self.num_updates)
        metrics = self.schedule.train(self.ddp, self.optimizer, work, loss_for, lr=lr)
        self.num_updates += 1
        if control is not None:
            metrics.update(control.collect(self.device))
        return metrics

    # ------------------------------------------------------------ weights out

    @torch.no_grad()
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This PP stage's full tensors under HF names (global layer indices), on its publisher.

        Every rank must exhaust the iterator (TP ranks of DP replica 0, and with
        expert parallelism the EP ranks holding the other experts, take part in
        gathers and yield nothing; other replicas return at once: `export.py`).
        Tensors are in the training dtype on the learner device; treat them as
        read-only and consume them before the next training step. With LoRA only this
        stage's adapters, as the wire carries them (`streamrl.weights.adapters`)."""
        if self.lora is None:
            yield from export.stage_hf_weights(self.model, self.shape, self.layout)
            return
        scaling = self.adapter_spec.scaling
        for module, lora_a, lora_b in self.full_adapters():
            yield module + adapters.LORA_A, lora_a
            yield module + adapters.LORA_B, lora_b * scaling

    def full_adapters(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(HF module, full A, full B unscaled) of this stage's adapters, on its publisher."""
        layout = self.layout
        if layout.dp_rank != 0:
            return
        yield from megatron_lora.full_parts(
            self.adapters,
            tp_group=parallel.tp_group() if layout.tp_size > 1 else None,
            tp_size=layout.tp_size,
            publisher=layout.global_rank(tp_rank=0, dp_rank=0, pp_rank=layout.pp_rank),
            is_publisher=self.is_publisher,
        )

    # ------------------------------------------------------------ checkpoints

    def save(self, path: Path) -> None:
        """HF safetensors (one file per PP stage + index) and per-rank optimizer state under
        `path` (`checkpoint.save_policy`); they only load back into the same layout."""
        checkpoint.save_policy(self, path)

    def stage_checkpoint(self, path: Path, *, staging: str = "host") -> Callable[[], None]:
        """Copy this rank's part of what `save` writes and return the function that writes
        it in the background (`checkpoint.stage_policy`)."""
        return checkpoint.stage_policy(self, path, staging=staging)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (`checkpoint.load_policy`)."""
        checkpoint.load_policy(self, path)


def scored_mask(micro_batch: MicroBatch) -> torch.Tensor:
    """[B, T]: the positions whose log-probability is scored: real tokens, less each sample's
    first (in a packed row the previous sample's last token sits before it, and does not
    predict it)."""
    if micro_batch.position_ids is None:
        return micro_batch.attention_mask
    return micro_batch.attention_mask * (micro_batch.position_ids != 0)
