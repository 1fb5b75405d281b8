"""SGLang engines: the launch command, the install check, and the attach path.

`engine.backend = "sglang"` starts `python -m sglang.launch_server` per engine
(through `EngineSupervisor`), unless `engine.urls` attaches to servers that already
run; then nothing is launched and nothing here needs SGLang installed.

    engine i:  CUDA_VISIBLE_DEVICES = its tp_size devices (`layout.engine_gpu_ids`),
               SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = false (`LIVENESS_ENV`)
               python -m sglang.launch_server --model-path M --host H --port P
                   --tp-size T --mem-fraction-static F --weight-version V
                   --random-seed S [--tokenizer-path K] [--dtype D]
                   [--enable-return-routed-experts] [--enable-memory-saver (cluster.colocate)]
                   [--enable-lora --max-lora-rank R --lora-target-modules M... [--lora-paths
                    streamrl-vV=DIR]]  ENGINE.EXTRA_ARGS...

Flag names are SGLang's `ServerArgs` fields (`python/sglang/srt/server_args.py`:
model_path, host, port, tp_size, mem_fraction_static, weight_version,
random_seed, tokenizer_path, dtype). `engine.extra_args` go last, verbatim; the
flags that streamrl derives from its own config keys are refused there, with
the key to set instead, and so are layouts whose weight sync cannot work
(see `streamrl.weights.layout`).

Call `check_sglang_backend(cfg)` before starting anything: it raises at once
when SGLang is missing, the GPUs do not add up, or the extra arguments clash.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from streamrl.config import ConfigError, RunConfig
from streamrl.fleet.client import adapter_name
from streamrl.placement import engine_gpu_ids
from streamrl.process import ServerArgv

LIVENESS_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
"""SGLang 0.5.17 answers `/health` as it answers `/health_generate`, with a one-token
generation, unless this is false: then `/health` says only that the server is up. A paused
engine generates nothing, so the fleet asks a paused engine `/health`
(`streamrl.fleet.supervisor`), and that must not wait at the pause's gate (the colocated 4B
run on the H200 had its paused engine restarted as hung when it did). sglang-router's own
checks of its workers ask `/health` too. `/health_generate` still generates."""

INSTALL_HINT = 'pip install "sglang[all]"  (SGLang\'s own install guide lists the CUDA builds)'
ROUTER_INSTALL_HINT = "pip install sglang-router  (or pip install 'streamrl[router]')"

# streamrl sets these from its own keys; a second value in extra_args would disagree with
# the GPU assignment, the weight-group layout or the URL the fleet polls.
_RESERVED_FLAGS = {
    "--model-path": "model.path",
    "--model": "model.path",
    "--tp-size": "engine.tp_size",
    "--tp": "engine.tp_size",
    "--tensor-parallel-size": "engine.tp_size",
    "--host": "engine.host",
    "--port": "a free port it picks per engine",
    "--mem-fraction-static": "engine.mem_fraction_static",
    "--weight-version": "the weight version the run starts at",
    "--base-gpu-id": "cluster.engine_gpus (as CUDA_VISIBLE_DEVICES)",
}
_PP_FLAGS = ("--pp-size", "--pp", "--pipeline-parallel-size")
_DP_FLAGS = ("--dp-size", "--dp", "--data-parallel-size")


class SGLangUnavailable(RuntimeError):
    """`engine.backend = "sglang"` must launch servers, but SGLang is not installed."""


def sglang_available() -> bool:
    """Whether `import sglang` can find the package in this interpreter.

    Finds it without importing it: importing SGLang pulls in its CUDA stack, which the
    launcher process must not initialise; a broken install still fails at the server's
    start, with the server's log tail in the error (`wait_http_ready`)."""
    return importlib.util.find_spec("sglang") is not None


def _router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _is_attached(cfg: RunConfig) -> bool:
    return bool(cfg.engine.urls)


def _will_start_router(cfg: RunConfig) -> bool:
    num_engines = len(cfg.engine.urls) or cfg.engine.num_engines
    return not cfg.engine.router_url and num_engines > 1


def check_sglang_backend(cfg: RunConfig) -> None:
    """Raise before anything starts if `engine.backend = "sglang"` cannot run as configured.

    No-op for the embedded backend. Attached engines (`engine.urls`) need no SGLang here;
    launched ones need the `sglang` package, enough GPUs, none of them the learner's, and
    clean `engine.extra_args`. A router started for several engines needs `sglang-router`."""
    if cfg.engine.backend != "sglang":
        return
    if _will_start_router(cfg) and not _router_available():
        raise SGLangUnavailable(
            "several engines and no engine.router_url: streamrl starts sglang-router, which is "
            f"not installed in {sys.executable}; {ROUTER_INSTALL_HINT}"
        )
    if _is_attached(cfg):
        return
    if cfg.cluster.launcher == "local":  # with Ray, the engines' GPUs are Ray's to assign
        _check_disjoint_from_learner(cfg, _engine_gpus(cfg))
    check_extra_args(cfg.engine.extra_args)
    if not sglang_available():
        raise SGLangUnavailable(
            f'engine.backend = "sglang" launches `python -m sglang.launch_server`, but the '
            f"`sglang` package is not installed in {sys.executable}: {INSTALL_HINT}; or attach "
            f'to running servers with engine.urls, or use engine.backend = "embedded"'
        )


def _check_disjoint_from_learner(cfg: RunConfig, engine_gpus: list[list[int]]) -> None:
    """NCCL refuses two ranks of one group on one GPU, and the learner is rank 0 of the
    weight-update group: with NCCL its GPUs and the engines' must differ."""
    if cfg.weight_transport("cpu" if cfg.learner.device == "cpu" else "cuda") != "nccl":
        return
    learner = cfg.learner_gpu_ids
    shared = sorted(learner & {gpu for gpus in engine_gpus for gpu in gpus})
    if shared:
        raise ConfigError(
            f"GPU(s) {shared} would hold both the learner (cluster.learner_gpus, default "
            f"0..learner.num_gpus-1) and an SGLang engine (cluster.engine_gpus, default "
            f"0..num_engines*tp_size-1); the weight-update group cannot put two ranks on one "
            f"GPU: give the engines other devices, e.g. cluster.engine_gpus = "
            f"{list(range(len(learner), len(learner) + cfg.engine.num_engines * cfg.engine.tp_size))}"
            f", or share the GPU with weights.transport = 'ipc' (one learner GPU; weights by CUDA "
            f"IPC handle)"
        )


def _engine_gpus(cfg: RunConfig) -> list[list[int]]:
    engine = cfg.engine
    try:
        return engine_gpu_ids(engine.num_engines, engine.tp_size, cfg.cluster.engine_gpus)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _flag_values(args: Sequence[str]) -> dict[str, str | None]:
    """`--flag value` and `--flag=value` pairs of an argv tail (None for a bare switch)."""
    found: dict[str, str | None] = {}
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, sep, value = arg.partition("=")
        if not sep:
            following = args[index + 1] if index + 1 < len(args) else None
            value = following if following is not None and not following.startswith("--") else None
        found[name] = value
    return found


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse `engine.extra_args` that clash with streamrl's own flags or break weight sync."""
    flags = _flag_values(extra_args)
    for flag, key in _RESERVED_FLAGS.items():
        if flag in flags:
            raise ConfigError(f"engine.extra_args must not set {flag}: streamrl sets it from {key}")
    above_one = {flag: value for flag, value in flags.items() if value not in (None, "1")}
    for flag in _PP_FLAGS:
        if flag in above_one:
            raise ConfigError(
                f"engine.extra_args: {flag} {flags[flag]}: SGLang's weight-update group has one "
                f"rank per tensor-parallel GPU and none for pipeline stages; use engine.tp_size"
            )
    dp_attention = "--enable-dp-attention" in flags
    for flag in _DP_FLAGS:
        if flag in above_one and not dp_attention:
            raise ConfigError(
                f"engine.extra_args: {flag} {flags[flag]} without --enable-dp-attention: the "
                f"replicas would share weight-group ranks; raise engine.num_engines instead"
            )


def sglang_argv_factory(
    cfg: RunConfig, model_path: str, version: int, *, lora_adapter: str = ""
) -> ServerArgv:
    """(index, host, port) -> (argv, env) that start SGLang engine `index` on `host:port`.

    Validates the GPU assignment and `engine.extra_args` once, here (ConfigError). With
    `engine.urls` set the engines are attached, and calling the factory is an error. With
    `learner.lora` LoRA is on (`sglang_lora_args`), and
    `lora_adapter` (a resumed run's checkpoint) is loaded as `version`'s adapter."""
    engine = cfg.engine
    if _is_attached(cfg):

        def attached(index: int, host: str, port: int) -> tuple[list[str], dict[str, str]]:
            raise RuntimeError("engine.urls attaches to running SGLang servers: none is launched")

        return attached

    gpus = _engine_gpus(cfg)
    check_extra_args(engine.extra_args)

    def argv(index: int, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        if not 0 <= index < len(gpus):
            raise IndexError(f"engine index {index} outside engine.num_engines = {len(gpus)}")
        args = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--host", host,
            "--port", str(port),
            "--tp-size", str(engine.tp_size),
            "--mem-fraction-static", str(engine.mem_fraction_static),
            "--weight-version", str(version),
            "--random-seed", str(cfg.model.seed + index),
        ]  # fmt: skip
        if cfg.model.tokenizer:
            args += ["--tokenizer-path", cfg.model.tokenizer]
        if engine.dtype != "auto":
            args += ["--dtype", engine.dtype]
        if cfg.rollout.return_routed_experts or cfg.algorithm.routing_replay:
            args.append("--enable-return-routed-experts")
        if cfg.cluster.colocate:  # /release_memory_occupation needs it (torch_memory_saver)
            args.append("--enable-memory-saver")
        lora = cfg.learner.lora
        if lora.is_enabled:
            args += sglang_lora_args(
                lora.rank, lora.target_modules, start_adapter=lora_adapter, version=version
            )
        args += list(engine.extra_args)
        return args, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus[index])), **LIVENESS_ENV}

    return argv


def sglang_lora_args(
    rank: int, target_modules: Sequence[str], *, start_adapter: str = "", version: int = 0
) -> list[str]:
    """SGLang server flags for a LoRA run: LoRA on, its rank and modules (adapters load
    later, so SGLang cannot infer them), and the resumed run's adapter under its name
    (`streamrl.publish.adapter_files` loads each later version's)."""
    args = [
        "--enable-lora",
        "--max-lora-rank", str(rank),
        "--lora-target-modules", *target_modules,
    ]  # fmt: skip
    name = adapter_name(version)
    if start_adapter and name is not None:
        args += ["--lora-paths", f"{name}={start_adapter}"]
    return args
