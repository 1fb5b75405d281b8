"""Turn a RunConfig into components: the learner backend, engine command lines, devices."""

from __future__ import annotations

import torch

from streamrl.config import RunConfig
from streamrl.launch.process import streamrl_argv


def learner_devices(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    from streamrl.engine.models import resolve_device, resolve_dtype

    device = resolve_device(cfg.learner.device)
    if device.type == "cuda" and cfg.cluster.learner_gpus:
        device = torch.device("cuda", cfg.cluster.learner_gpus[0])
    return device, resolve_dtype(cfg.learner.dtype, device)


def build_backend(cfg: RunConfig, model_path: str, device: torch.device, dtype: torch.dtype):
    """The learner backend named by `learner.backend`, loaded from `model_path`."""
    need_reference = cfg.algorithm.kl_loss_coef > 0
    if cfg.learner.backend == "torch":
        from streamrl.learners.torch_backend import TorchBackend

        return TorchBackend(
            model_path,
            cfg.learner,
            device=device,
            dtype=dtype,
            need_reference=need_reference,
            seed=cfg.model.seed,
        )
    import warnings

    from streamrl.learners.megatron.backend import MegatronBackend

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
        seed=cfg.model.seed,
    )


def engine_argv_factory(cfg: RunConfig, model_path: str, version: int):
    """(index, host, port) -> (argv, env) for each engine of `engine.backend`."""
    engine = cfg.engine
    gpus = list(cfg.cluster.engine_gpus)

    def embedded(index: int, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        argv = streamrl_argv(
            "--log-level",
            cfg.logging.level,
            "engine",
            "serve",
            "--model",
            model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--device",
            engine.device,
            "--dtype",
            engine.dtype,
            "--max-batch-size",
            str(engine.max_batch_size),
            "--max-seq-len",
            str(engine.max_seq_len),
            "--runner",
            engine.runner,
            "--seed",
            str(cfg.model.seed + index),
            "--weight-version",
            str(version),
            "--num-threads",
            str(engine.num_threads),
            "--compile",
            engine.compile,
        )
        if cfg.model.tokenizer:
            argv += ["--tokenizer", cfg.model.tokenizer]
        if not engine.cuda_graphs:
            argv.append("--no-cuda-graphs")
        env = {"CUDA_VISIBLE_DEVICES": str(gpus[index % len(gpus)])} if gpus else {}
        return argv, env

    if engine.backend == "sglang":
        from streamrl.engine.sglang import sglang_argv_factory

        return sglang_argv_factory(cfg, model_path, version)
    return embedded


def pad_token_id(backend) -> int:
    """The padding id for micro-batches: the tokenizer's pad token, else its EOS, else 0."""
    tokenizer = getattr(backend, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return int(pad or 0)
