"""The command line of each engine a run starts: the embedded engine or an SGLang server.

`engine_argv_factory(cfg, model_path, version)` returns the `(index, host, port) ->
(argv, env)` function the engine supervisor calls for every start and restart;
`CUDA_VISIBLE_DEVICES` pins each engine to its GPUs (`streamrl.placement`).
"""

from __future__ import annotations

from streamrl.config import RunConfig
from streamrl.engine.options import SHARED_WITH_CONFIG, EngineOptions
from streamrl.process import ServerArgv, streamrl_argv


def embedded_options(
    cfg: RunConfig,
    *,
    model_path: str,
    version: int,
    index: int,
    host: str,
    port: int,
    lora_adapter: str = "",
) -> EngineOptions:
    """The options of embedded engine `index`: `[engine]`'s keys of the same names, and
    the run's model, seed (+ index, so engines sample differently), start version and the
    LoRA adapter merged at start (a resumed LoRA run's checkpoint)."""
    return EngineOptions(
        model=model_path,
        tokenizer=cfg.model.tokenizer,
        host=host,
        port=port,
        seed=cfg.model.seed + index,
        weight_version=str(version),
        lora_adapter=lora_adapter,
        **{name: getattr(cfg.engine, name) for name in SHARED_WITH_CONFIG},
    )


def engine_argv_factory(
    cfg: RunConfig, model_path: str, version: int, *, lora_adapter: str = ""
) -> ServerArgv:
    """(index, host, port) -> (argv, env) for each engine of `engine.backend`; `lora_adapter`
    is a peft directory that carries `version` on top of `model_path` (a resumed LoRA run)."""
    if cfg.engine.backend == "sglang":
        from streamrl.fleet.sglang import sglang_argv_factory

        return sglang_argv_factory(cfg, model_path, version, lora_adapter=lora_adapter)
    gpus = list(cfg.cluster.engine_gpus)

    def embedded(index: int, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        options = embedded_options(
            cfg, model_path=model_path, version=version, index=index, host=host, port=port,
            lora_adapter=lora_adapter,
        )  # fmt: skip
        argv = streamrl_argv("--log-level", cfg.logging.level, "engine", "serve")
        env = {"CUDA_VISIBLE_DEVICES": str(gpus[index % len(gpus)])} if gpus else {}
        return argv + options.to_argv(), env

    return embedded
