"""`learner.backend = "torch"`: any Hugging Face causal LM, AdamW, one process.

With `learner.lora` the model is a peft `PeftModel` (`streamrl.backends.peft_adapters`):
the base is frozen in the compute dtype, AdamW holds only the float32 adapters, the KL
reference is the base with the adapters off, checkpoints hold peft's adapter directory and
`hf_weights` yields only the adapters.

Precision: the trained weights are fp32 (the master copy) whatever `learner.dtype`
says; with `bfloat16` (the CUDA default) the forward and backward run under bf16
autocast, so an update far below bf16's resolution (1e-8 on a weight of 0.02) still
accumulates, as in Megatron's distributed optimizer. Engines get the weights cast to
the compute dtype (`hf_weights`); checkpoints keep the fp32 master weights.

The learning rate follows `streamrl.schedules.lr_at` through a `LambdaLR` stepped after
every optimizer step (its step count is saved with the optimizer). An optional frozen
reference model (in the compute dtype) serves the KL loss; an optional critic
(`streamrl.backends.critic`) the GAE estimator; gradient checkpointing when configured.

Packed rows (`learner.pack_sequences`): every model of the backend (policy, reference,
critic) attends with `streamrl.backends.documents` (SDPA on each sample of a row alone)
and gets per-sample position ids (`documents.model_inputs`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from streamrl import algorithms
from streamrl.backends import flash, peft_adapters
from streamrl.backends.base import CRITIC_DIR, LossFn, MicroBatch
from streamrl.backends.documents import model_inputs, use_document_attention
from streamrl.backends.offload import HostOffload, optimizer_tensors
from streamrl.backends.staging import StagingPool
from streamrl.config import LearnerConfig

log = logging.getLogger(__name__)


class TorchBackend:
    def __init__(
        self,
        model_path: str,
        cfg: LearnerConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        need_reference: bool = False,
        reference_path: str | None = None,
        lr_schedule: dict[str, Any] | None = None,
        critic_path: str | None = None,
        critic_lr: float = 0.0,
        seed: int = 0,
        tokenizer=None,
    ) -> None:
        """`dtype` is the compute dtype; `lr_schedule` the keyword arguments of
        `streamrl.schedules.lr_multiplier` (None: constant `cfg.lr`); `critic_path` the
        model a critic starts from (None: no critic), trained at peak `critic_lr` on the
        same schedule shape; `tokenizer` the model's, loaded already (None: loaded here;
        each checkpoint saves it)."""
        from streamrl.models import load_causal_lm, load_tokenizer
        from streamrl.schedules import lr_multiplier

        if cfg.num_threads and device.type == "cpu":
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(seed)
        self.device = device
        self.dtype = dtype
        self.lora = cfg.lora if cfg.lora.is_enabled else None
        # LoRA's frozen base needs no master copy: it is held in the compute dtype.
        self.model = load_causal_lm(
            model_path, device=str(device), dtype=dtype if self.lora else torch.float32, seed=seed
        )
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        self.model.config.use_cache = False
        if cfg.pack_sequences:
            flash.choose(cfg.flash_attention, device)
            use_document_attention(self.model)
        if self.lora is not None:
            self.model = peft_adapters.add_adapters(self.model, self.lora)
            self.adapter_spec = peft_adapters.spec_of(self.lora, model_path)
        else:
            self.model.requires_grad_(True)
        self.model.train()
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            if self.lora is not None:  # the frozen embedding's output must carry a grad
                self.model.enable_input_require_grads()
        self.reference = None
        if need_reference and self.lora is None:  # with LoRA: the base, adapters off
            self.reference = load_causal_lm(
                reference_path or model_path, device=str(device), dtype=dtype, seed=seed
            )
            self.reference.eval().requires_grad_(False)
            if cfg.pack_sequences:
                use_document_attention(self.reference)
        self.need_reference = need_reference
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_clip = cfg.grad_clip
        self.optimizer = torch.optim.AdamW(
            self.trained,
            lr=lr_schedule["lr"] if lr_schedule else cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        multiplier = lr_multiplier(**lr_schedule) if lr_schedule else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, multiplier or (lambda step: 1.0)
        )
        self.host_offload = HostOffload(device)
        """What `offload_to_host` moved out (`learner.offload` with `cluster.colocate`)."""
        self.staging_pool = StagingPool()
        """The host buffers a checkpoint's copy reuses (`streamrl.backends.staging`)."""
        self.critic = None
        if critic_path is not None:
            from streamrl.backends.critic import TorchCritic

            self.critic = TorchCritic(
                critic_path,
                device=device,
                dtype=dtype,
                lr=critic_lr or cfg.lr,
                lr_multiplier=multiplier,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                grad_clip=cfg.grad_clip,
                gradient_checkpointing=cfg.gradient_checkpointing,
                pack_sequences=cfg.pack_sequences,
                seed=seed,
            )

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 (or fp16) autocast around a forward when the compute dtype is not fp32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def is_publisher(self) -> bool:
        return True

    def _forward(self, model, micro_batch: MicroBatch, temperature: float, need_entropy: bool):
        """Per-token logprobs (and entropy) on the trained positions only (`model_inputs`:
        packed rows keep attention inside each sample).

        The output head runs only on the hidden states that predict a trained token: the
        prompt and padding are most positions of a batch, and the vocabulary is large.
        Other positions hold 0, as the LearnerBackend layout says."""
        batch = micro_batch.to(self.device)
        predicts = batch.predicted()  # position p predicts token p + 1
        with self._autocast():
            hidden = model.get_decoder()(**model_inputs(batch)).last_hidden_state
            logits = model.get_output_embeddings()(hidden[:, :-1][predicts])
        targets = batch.input_ids[:, 1:][predicts]
        logprobs = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        logprobs[:, 1:][predicts] = algorithms.logprobs_of_rows(
            logits, targets, temperature=temperature
        )
        entropy = None
        if need_entropy:  # with its gradient: an entropy bonus trains through it
            entropy = torch.zeros_like(logprobs)
            entropy[:, 1:][predicts] = algorithms.entropy_of_rows(logits, temperature=temperature)
        return batch, logprobs, entropy

    @torch.no_grad()
    def compute_logprobs(
        self, micro_batches: list[MicroBatch], *, temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        if reference and not self.need_reference:
            raise RuntimeError("no reference model: it is built only when kl_loss_coef > 0")
        model, adapters_off = self.model, contextlib.nullcontext()
        if reference and self.lora is not None:
            adapters_off = peft_adapters.base_only(self.model)
        elif reference:
            model = self.reference
        was_training = model.training
        model.eval()
        try:
            with adapters_off:
                return [
                    self._forward(model, mb, temperature, False)[1].float().cpu()
                    for mb in micro_batches
                ]
        finally:
            model.train(was_training)

    def train_mini_batch(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        need_entropy: bool,
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for micro_batch in micro_batches:
            batch, logprobs, entropy = self._forward(
                self.model, micro_batch, temperature, need_entropy
            )
            loss, metrics = loss_fn(batch, logprobs, entropy)
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, max_norm)
        sums["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate of this update
        self.optimizer.step()
        self.scheduler.step()
        sums["grad_norm"] = float(grad_norm)
        return sums

    def offload_to_host(self, part: str) -> float:
        """Free the device for colocated engines (`learner.offload`): `optimizer` moves AdamW's
        state to host memory and drops the gradients (the next step starts from none);
        `parameters` moves the model's parameters and the frozen reference's. Calls add up
        until `reload_from_host`. Seconds taken."""
        if part == "optimizer":
            self.optimizer.zero_grad(set_to_none=True)
            return self.host_offload.offload(optimizer_tensors(self.optimizer), [])
        models = [self.model] if self.reference is None else [self.model, self.reference]
        parameters = [p for m in models for p in m.parameters()]
        for parameter in parameters:
            if not parameter.untyped_storage().resizable():  # memory-mapped from the checkpoint
                parameter.data = parameter.data.clone()
        return self.host_offload.offload(parameters, [])

    def reload_from_host(self) -> float:
        """Bring back what `offload_to_host` moved out. Seconds taken."""
        return self.host_offload.reload()

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under its names (a tied head appears once, as the
        embedding; MoE experts one by one, as SGLang loads them: `models.checkpoint_views`),
        in the compute dtype: a bf16 copy of each fp32 master weight on CUDA. With LoRA only
        the adapters, as the wire carries them (`streamrl.weights.adapters`)."""
        from streamrl.models import checkpoint_views

        if self.lora is not None:
            yield from peft_adapters.wire_tensors(self.model, self.dtype)
            return

        # Built once: a dict of the parameters per parameter cost 170 ms a snapshot at 0.5B.
        distinct = dict(self.model.named_parameters())
        tied = {
            name
            for name, _ in self.model.named_parameters(remove_duplicate=False)
            if name not in distinct
        }
        for name, tensor in checkpoint_views(self.model).items():
            if name not in tied:
                yield name, tensor.detach().to(self.dtype)

    def save(self, path: Path) -> None:
        """`path` becomes a Hugging Face model directory (fp32 master weights; with LoRA,
        peft's adapter directory instead) plus `optimizer.pt` (optimizer and LR schedule)
        and, with a critic, `critic/`."""
        self.stage_checkpoint(path)()

    def stage_checkpoint(self, path: Path, *, staging: str = "host") -> Callable[[], None]:
        """Copy what `save` writes (`streamrl.backends.staging`) and return the function
        that writes the copy under `path`, which may run in another thread while training
        goes on."""
        from streamrl.backends import staging as staging_

        if self.lora is not None:
            from peft import get_peft_model_state_dict

            weights = get_peft_model_state_dict(self.model)
        else:
            weights = self.model.state_dict()
        staged = staging_.stage(
            {
                "weights": weights,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            },
            to=staging,
            pool=self.staging_pool,
        )
        write_critic = None
        if self.critic is not None:
            write_critic = self.critic.stage_checkpoint(
                path / CRITIC_DIR, staging=staging, pool=self.staging_pool
            )
        if staging == staging_.Staging.RESERVE:  # the buffers are in the pool: nothing to write
            return lambda: None

        def write() -> None:
            from transformers.utils import logging as hf_logging

            from streamrl.weights import adapters

            hf_logging.disable_progress_bar()
            path.mkdir(parents=True, exist_ok=True)
            with staged.host() as state:
                if self.lora is not None:
                    adapters.write_peft_adapter(path, state["weights"], self.adapter_spec)
                else:
                    self.model.save_pretrained(
                        path, state_dict=state["weights"], safe_serialization=True
                    )
                torch.save(
                    {"optimizer": state["optimizer"], "scheduler": state["scheduler"]},
                    path / "optimizer.pt",
                )
            self.tokenizer.save_pretrained(path)
            if write_critic is not None:
                write_critic()

        return write

    def load(self, path: Path) -> None:
        if self.lora is not None:
            peft_adapters.load_adapter(self.model, path, self.adapter_spec)
        else:
            self._load_weights(path)
        state = torch.load(path / "optimizer.pt", map_location=self.device)
        if "optimizer" not in state:  # written before the LR schedule was saved with it
            state = {"optimizer": state, "scheduler": None}
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            self.critic.load(path / CRITIC_DIR)

    def _load_weights(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file, device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
