"""The rollout process of a run: `streamrl _rollout --run-dir DIR`.

    rollout process (one anyio task group)
      StreamSender ──ZeroMQ──► the trainer's Intake      credits in, groups out, acks in
      RolloutWorker            prompts ─► generate fn ─► reward ─► Group ─► sender
      Evaluator                every eval.interval versions, through the same engines
      counters report          every 2 s, to the learner's metrics
      agent API gateway        when the generate function uses one (streamrl.agents.gateway)

The trainer writes the resolved `config.toml` and `rollout.json` (a
`RolloutSpec`: where the buffer and the engines are, where the data resumes)
into the run directory and starts this process through its spawner
(`start_rollout`); it runs until the trainer's receiver says stop, or SIGTERM.
The first process of a run starts early (`spawn_rollout`), while the engines load:
it loads its tokenizer, then waits for `rollout.json`, which the trainer writes once
the stream's receiver and the engines are up.

An error that a restart would hit again (`fatal_of`: every sample failing, a
malformed data line, a generate or reward function that does not import) is sent
to the trainer as a `Fatal` frame on the stream, and the process exits with 1
once the trainer has it: the trainer stops the run with it instead of restarting
this process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from streamrl import logs
from streamrl.config import ConfigError, RunConfig, load_config
from streamrl.config.sections import EMPTYING_PAUSES
from streamrl.process import ProcessHandle, Spawner, no_full_collections, streamrl_argv
from streamrl.queues.accounting import DataPosition
from streamrl.queues.protocol import Fatal
from streamrl.types import PartialGroup, make_decoder

if TYPE_CHECKING:
    from streamrl.actors.failures import Failure

log = logging.getLogger(__name__)

SPEC_FILE = "rollout.json"


class RolloutSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the rollout process needs beyond the config, decided when the run starts."""

    buffer_address: str
    """The trainer's stream receiver (`tcp://host:port`)."""
    engine_urls: list[str]
    router_url: str = ""
    """sglang-router in front of the engines; empty without one."""
    model_path: str
    """The model the engines serve (its tokenizer renders the prompts)."""
    position: DataPosition = msgspec.field(default_factory=DataPosition)
    """Where the prompt stream resumes."""
    start_version: int = 0
    resume_file: str = ""
    """msgpack list of `PartialGroup`s a checkpoint saved in flight, started before any new
    prompt; empty for none."""
    vocab_size: int = 0
    """The model's embedding rows (its config's `vocab_size`, `model_limits`); 0: the
    rollout reads the config itself (transformers' config code imports torch)."""
    max_position_embeddings: int = 0
    """The model's context length (`model_limits`); read with `vocab_size`."""


def write_spec(run_dir: Path, spec: RolloutSpec) -> Path:
    """Write `rollout.json` whole (a waiting process never reads half of it)."""
    path = run_dir / SPEC_FILE
    staging = path.with_suffix(".json.partial")
    staging.write_bytes(msgspec.json.format(msgspec.json.encode(spec)) + b"\n")
    staging.replace(path)
    return path


def read_spec(run_dir: Path) -> RolloutSpec:
    return msgspec.json.decode((run_dir / SPEC_FILE).read_bytes(), type=RolloutSpec)


def read_resume(spec: RolloutSpec) -> list[PartialGroup]:
    """The groups to continue first (`RolloutSpec.resume_file`)."""
    if not spec.resume_file:
        return []
    return make_decoder(list[PartialGroup]).decode(Path(spec.resume_file).read_bytes())


def start_rollout(
    spawner: Spawner, run_dir: Path, spec: RolloutSpec, *, log_level: str, tokenizer_class: str = ""
) -> ProcessHandle:
    """Write the spec and start the rollout process through `spawner` (log: logs/rollout.log);
    `tokenizer_class` as for `spawn_rollout`."""
    write_spec(run_dir, spec)
    return _spawn(
        spawner, run_dir, tokenizer=spec.model_path, tokenizer_class=tokenizer_class,
        log_level=log_level,
    )  # fmt: skip


def spawn_rollout(
    spawner: Spawner, run_dir: Path, *, tokenizer: str, log_level: str, tokenizer_class: str = ""
):
    """Start the rollout process before its spec exists: it loads `tokenizer` (the model
    path, unless `model.tokenizer` names another) and waits for `write_spec`. A spec left
    by an earlier start is removed first. `tokenizer_class`: the class name of the tokenizer
    the process loads (`resolved_tokenizer`), or empty (it resolves the class itself)."""
    (run_dir / SPEC_FILE).unlink(missing_ok=True)
    return _spawn(
        spawner, run_dir, tokenizer=tokenizer, tokenizer_class=tokenizer_class, log_level=log_level
    )


def _spawn(
    spawner: Spawner, run_dir: Path, *, tokenizer: str, tokenizer_class: str, log_level: str
):
    argv = ["--log-level", log_level, "_rollout", "--run-dir", str(run_dir)]
    argv += ["--tokenizer", tokenizer]
    if tokenizer_class:
        argv += ["--tokenizer-class", tokenizer_class]
    return spawner.spawn("rollout", streamrl_argv(*argv), log_path=run_dir / "logs" / "rollout.log")


def resolved_tokenizer(cfg: RunConfig, model_path: str):
    """The tokenizer the rollout process loads for `model_path` (the one `model.tokenizer`
    names, if any), loaded here by `AutoTokenizer`: the process then loads its class
    directly (`load_tokenizer`'s `resolved_class`). None when it does not load here: the
    process resolves it, and reports what fails, itself."""
    from streamrl.models import load_tokenizer

    try:
        return load_tokenizer(cfg.model.tokenizer or model_path)
    except Exception:
        return None


def model_limits(model_path: str) -> tuple[int, int]:
    """The model's embedding rows and context length (2**31 - 1 when its config names none):
    what `RolloutSpec.vocab_size` and `max_position_embeddings` carry."""
    from streamrl.models import model_config

    config = model_config(model_path)
    return int(config.vocab_size), int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1)


def known_limits(model_path: str) -> tuple[int, int]:
    """`model_limits` read by the trainer for the spec; (0, 0) when they do not read here: the
    rollout process reads them, and reports what fails, itself."""
    try:
        return model_limits(model_path)
    except Exception:
        return 0, 0


FATAL_ACK_TIMEOUT_S = 30.0
"""How long a `Fatal` waits for the trainer's answer; without one the process exits anyway
(and is restarted, as any process that died)."""


SPEC_POLL_S = 0.02

FINISH_EVAL_S = 20.0
"""When told to stop, the rollout waits this long for an evaluation under way (usually the
run's last version) to be reported; the trainer waits 30 s for the rollout to exit."""


def rollout_command(args) -> int:
    from streamrl.models import load_tokenizer

    parent = os.getppid()
    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.toml")
    with no_full_collections():  # importing transformers: objects for the process's life
        tokenizer = load_tokenizer(
            cfg.model.tokenizer or args.tokenizer, resolved_class=args.tokenizer_class
        )
    if not (run_dir / SPEC_FILE).exists():
        log.info("tokenizer loaded; waiting for %s", run_dir / SPEC_FILE)
    while not (run_dir / SPEC_FILE).exists():
        if os.getppid() != parent:
            log.error("the process that started this rollout exited before writing its spec")
            return 1
        time.sleep(SPEC_POLL_S)
    return anyio.run(rollout_main, cfg, read_spec(run_dir), tokenizer)


async def rollout_main(cfg: RunConfig, spec: RolloutSpec, tokenizer) -> int:
    """Run the rollout worker (and the evaluator) until the receiver says stop: 0; or
    until an error a restart cannot fix, sent to the trainer first: 1."""
    from streamrl.queues.sender import StreamSender

    sender = StreamSender(
        spec.buffer_address, sender_id="rollout-0", want=cfg.rollout.max_concurrent_groups
    )
    code = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_sigterm, tg.cancel_scope)
        await tg.start(sender.run)  # first: a bad data file is reported on the stream too
        try:
            await _serve(cfg, spec, sender, tokenizer)
        except Exception as exc:
            fatal = fatal_of(exc, cfg)
            if fatal is None:
                raise
            logs.report_pending()  # the failures folded in the log, counted
            log.error("%s\n%s", fatal.reason, fatal.traceback or fatal.error)
            if not await sender.send_fatal(fatal, timeout_s=FATAL_ACK_TIMEOUT_S):
                log.error(
                    "the trainer did not take the fatal error within %g s", FATAL_ACK_TIMEOUT_S
                )
            code = 1
        tg.cancel_scope.cancel()
    return code


async def _serve(cfg: RunConfig, spec: RolloutSpec, sender, tokenizer) -> None:
    from streamrl.actors.evaluator import Evaluator
    from streamrl.actors.rollout import RolloutWorker
    from streamrl.agents.api import VersionRule
    from streamrl.data.source import PromptSource
    from streamrl.fleet.engine_set import EngineSet
    from streamrl.rewards import load_reward_fn
    from streamrl.utils import import_object

    source = PromptSource.from_config(
        cfg.data, tokenizer, seed=cfg.train.seed, position=spec.position
    )
    try:
        generate_fn = import_object(cfg.rollout.generate_fn, "rollout.generate_fn")
        reward_fn = load_reward_fn(cfg.rollout.reward_fn, dict(cfg.rollout.reward_kwargs))
    except ValueError as exc:  # the message names the key
        raise ConfigError(str(exc)) from exc
    engines = EngineSet(spec.engine_urls, router_url=spec.router_url or None)
    engines.set_limits(await _request_limits(engines, spec))
    if cfg.learner.lora.is_enabled and cfg.engine.backend == "sglang":
        engines.route_to_adapters(lambda: sender.version)  # the adapter of each version
    configure = getattr(generate_fn, "configure", None)
    if configure is not None:  # a generate function that reads the run config (compat.slime)
        configure(cfg)
    worker = RolloutWorker(
        worker_id="rollout-0",
        source=source,
        sender=sender,
        engines=engines,
        tokenizer=tokenizer,
        generate_fn=generate_fn,
        reward_fn=reward_fn,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        sampling_params=cfg.rollout.sampling.to_sglang(),
        generate_kwargs=dict(cfg.rollout.generate_kwargs),
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        retry_timeout_s=cfg.rollout.retry_timeout_s,
        version_rule=VersionRule(
            single_version=cfg.pause_mode in EMPTYING_PAUSES, floor=lambda: sender.version
        ),
        seed=cfg.train.seed if cfg.rollout.deterministic else None,
        resume=read_resume(spec),
        return_routed_experts=cfg.rollout.return_routed_experts or cfg.algorithm.routing_replay,
        max_consecutive_failures=cfg.rollout.max_consecutive_failures,
    )
    async with engines, _gateway(cfg, generate_fn), anyio.create_task_group() as tg:
        tg.start_soon(worker.report_loop)
        tg.start_soon(worker.in_flight_loop)
        if cfg.eval.interval and cfg.eval.datasets:
            evaluator = Evaluator(
                list(cfg.eval.datasets),
                data_cfg=cfg.data,
                interval=cfg.eval.interval,
                tokenizer=tokenizer,
                engines=engines,
                sender=sender,
                default_reward_fn=cfg.rollout.reward_fn,
                default_reward_kwargs=dict(cfg.rollout.reward_kwargs),
                reward_timeout_s=cfg.rollout.reward_timeout_s,
                generate_fn=generate_fn,
                generate_kwargs=dict(cfg.rollout.generate_kwargs),
            )
            tg.start_soon(evaluator.run)
        await worker.run()
        log.info("rollout stopped: %s", worker.counters.as_dict())
        if cfg.eval.interval and cfg.eval.datasets:
            with anyio.move_on_after(FINISH_EVAL_S):
                await evaluator.finish_current()
        tg.cancel_scope.cancel()


def fatal_of(exc: BaseException, cfg: RunConfig) -> Fatal | None:
    """`exc` (or the first error in its group) as a `Fatal` when a restart would hit it
    again; None for any other error (the process dies and the trainer restarts it)."""
    from streamrl.actors.failures import SystematicFailure
    from streamrl.data.rows import DataError

    for error in _leaves(exc):
        if isinstance(error, SystematicFailure):
            first = error.first
            return Fatal(
                reason=str(error),
                error=first.error,
                look_at=_look_at(cfg, first),
                traceback=first.traceback,
            )
        if isinstance(error, DataError):
            return Fatal(
                reason=f"bad prompt data: {error}",
                error=f"DataError: {error}",
                look_at='data.path, eval.datasets (data.on_bad_line = "skip" skips and '
                "counts malformed lines)",
            )
        if isinstance(error, ConfigError):
            return Fatal(reason=str(error), error=f"ConfigError: {error}")
    return None


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _look_at(cfg: RunConfig, failure: Failure) -> str:
    """The config keys (and logs) where a systematic `failure` is likely caused."""
    from streamrl.actors.failures import Stage
    from streamrl.utils import import_object

    rollout = cfg.rollout
    if failure.stage is Stage.REWARD:
        return f"rollout.reward_fn = {rollout.reward_fn!r} (a timeout: rollout.reward_timeout_s)"
    keys = [f"rollout.generate_fn = {rollout.generate_fn!r}"]
    if getattr(import_object(rollout.generate_fn, "rollout.generate_fn"), "uses_gateway", False):
        keys.append("the agent behind the gateway (rollout.generate_kwargs, rollout.gateway)")
    error_type = failure.error.partition(":")[0]
    if error_type == "TemplateError":
        keys.append("the tokenizer's chat template (model.tokenizer)")
    elif error_type == "RequestRejected":
        keys.append("rollout.sampling.max_new_tokens, data.max_prompt_tokens, engine.max_seq_len")
    elif error_type in ("EngineError", "EngineSetError"):
        keys.append("the engines' logs (logs/engine_*.log)")
    return "; ".join(keys)


async def _request_limits(engines, spec: RolloutSpec):
    """What the engines accept (`streamrl.fleet.limits`): the model's embedding rows and the
    smallest context length an engine reports."""
    if spec.vocab_size:
        vocab_size, model_max = spec.vocab_size, spec.max_position_embeddings
    else:
        vocab_size, model_max = await anyio.to_thread.run_sync(model_limits, spec.model_path)
    return await engines.read_limits(vocab_size=vocab_size, model_max=model_max)


def _gateway(cfg: RunConfig, generate_fn) -> contextlib.AbstractAsyncContextManager:
    """One agent API gateway for the process when the generate function uses it."""
    if not getattr(generate_fn, "uses_gateway", False):
        return contextlib.nullcontext()
    from streamrl.agents.gateway import serving

    return serving(host=cfg.rollout.gateway.host, port=cfg.rollout.gateway.port)


async def _cancel_on_sigterm(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return
