"""The learner backend a RunConfig names, its device and dtype, and its padding id."""

from __future__ import annotations

import torch

from streamrl.config import RunConfig


def learner_devices(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    from streamrl.models.devices import resolve_device, resolve_dtype

    device = resolve_device(cfg.learner.device)
    if device.type == "cuda" and cfg.cluster.learner_gpus:
        device = torch.device("cuda", cfg.cluster.learner_gpus[0])
    return device, resolve_dtype(cfg.learner.dtype, device)


def build_backend(
    cfg: RunConfig,
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    reference_path: str | None = None,
    tokenizer=None,
):
    """The learner backend named by `learner.backend`, loaded from `model_path`; its KL
    reference (with `algorithm.kl_loss_coef` > 0) from `reference_path` (None: `model_path`).
    A resumed run passes its initial model there, so the reference never drifts. With
    `algorithm.advantage_estimator = "gae"` either backend gets a critic that starts from
    `learner.critic.path`, or the reference path (the initial model); a resume then
    restores it from the checkpoint. `tokenizer`: `model_path`'s, where the caller loaded it
    already (the torch backend saves it with each checkpoint; None: it loads it)."""
    need_reference = cfg.algorithm.kl_loss_coef > 0
    critic_path = None
    if cfg.algorithm.advantage_estimator == "gae":
        critic_path = cfg.learner.critic.path or reference_path or model_path
    if cfg.learner.backend == "torch":
        from streamrl.backends.torch import TorchBackend

        return TorchBackend(
            model_path,
            cfg.learner,
            device=device,
            dtype=dtype,
            need_reference=need_reference,
            reference_path=reference_path,
            lr_schedule=cfg.lr_schedule,
            critic_path=critic_path,
            critic_lr=cfg.critic_lr,
            seed=cfg.model.seed,
            tokenizer=tokenizer,
        )
    import warnings

    from streamrl.backends.megatron.backend import MegatronBackend

    # Known, harmless notices from torch.distributed and megatron-core 0.16.1 on every step.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed")
    warnings.filterwarnings(
        "ignore", message=r"The \.grad attribute of a Tensor that is not a leaf"
    )

    return MegatronBackend(
        model_path,
        cfg.learner,
        algorithm_cfg=cfg.algorithm,
        device=str(device),
        dtype=dtype,
        need_reference=need_reference,
        reference_path=reference_path,
        lr_schedule=cfg.lr_schedule,
        critic_path=critic_path,
        critic_lr=cfg.critic_lr,
        seed=cfg.model.seed,
    )


def pad_token_id(backend) -> int:
    """The padding id for micro-batches: the tokenizer's pad token, else its EOS, else 0."""
    tokenizer = getattr(backend, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return int(pad or 0)
