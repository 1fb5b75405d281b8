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
"""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path

import anyio
import msgspec

from streamrl.config import RunConfig, load_config
from streamrl.data import DataPosition
from streamrl.process import ProcessHandle, Spawner, streamrl_argv
from streamrl.types import PartialGroup, make_decoder

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


def write_spec(run_dir: Path, spec: RolloutSpec) -> Path:
    path = run_dir / SPEC_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(spec)) + b"\n")
    return path


def read_spec(run_dir: Path) -> RolloutSpec:
    return msgspec.json.decode((run_dir / SPEC_FILE).read_bytes(), type=RolloutSpec)


def read_resume(spec: RolloutSpec) -> list[PartialGroup]:
    """The groups to continue first (`RolloutSpec.resume_file`)."""
    if not spec.resume_file:
        return []
    return make_decoder(list[PartialGroup]).decode(Path(spec.resume_file).read_bytes())


def start_rollout(
    spawner: Spawner, run_dir: Path, spec: RolloutSpec, *, log_level: str
) -> ProcessHandle:
    """Write the spec and start the rollout process through `spawner` (log: logs/rollout.log)."""
    write_spec(run_dir, spec)
    return spawner.spawn(
        "rollout",
        streamrl_argv("--log-level", log_level, "_rollout", "--run-dir", str(run_dir)),
        log_path=run_dir / "logs" / "rollout.log",
    )


def rollout_command(args) -> int:
    run_dir = Path(args.run_dir)
    anyio.run(rollout_main, load_config(run_dir / "config.toml"), read_spec(run_dir))
    return 0


async def rollout_main(cfg: RunConfig, spec: RolloutSpec) -> None:
    """Run the rollout worker (and the evaluator) until the receiver says stop."""
    from streamrl.actors.evaluator import Evaluator
    from streamrl.actors.rollout import RolloutWorker
    from streamrl.agents.api import VersionRule
    from streamrl.data import PromptSource
    from streamrl.fleet.engine_set import EngineSet
    from streamrl.models import load_tokenizer
    from streamrl.queues.transport import StreamSender
    from streamrl.rewards import load_reward_fn
    from streamrl.utils import import_object

    tokenizer = await anyio.to_thread.run_sync(
        load_tokenizer, cfg.model.tokenizer or spec.model_path
    )
    source = PromptSource.from_config(
        cfg.data, tokenizer, seed=cfg.train.seed, position=spec.position
    )
    sender = StreamSender(
        spec.buffer_address, sender_id="rollout-0", want=cfg.rollout.max_concurrent_groups
    )
    engines = EngineSet(spec.engine_urls, router_url=spec.router_url or None)
    engines.set_limits(await _request_limits(engines, spec.model_path))
    if cfg.learner.lora.is_enabled and cfg.engine.backend == "sglang":
        engines.route_to_adapters(lambda: sender.version)  # the adapter of each version
    generate_fn = import_object(cfg.rollout.generate_fn, "rollout.generate_fn")
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
        reward_fn=load_reward_fn(cfg.rollout.reward_fn, dict(cfg.rollout.reward_kwargs)),
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        sampling_params=cfg.rollout.sampling.to_sglang(),
        generate_kwargs=dict(cfg.rollout.generate_kwargs),
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        retry_timeout_s=cfg.rollout.retry_timeout_s,
        version_rule=VersionRule(
            single_version=cfg.pause_mode == "abort", floor=lambda: sender.version
        ),
        seed=cfg.train.seed if cfg.rollout.deterministic else None,
        resume=read_resume(spec),
        return_routed_experts=cfg.rollout.return_routed_experts or cfg.algorithm.routing_replay,
    )
    async with engines, _gateway(cfg, generate_fn), anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_sigterm, tg.cancel_scope)
        await tg.start(sender.run)
        tg.start_soon(worker.report_loop)
        tg.start_soon(worker.snapshot_loop)
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
        tg.cancel_scope.cancel()


async def _request_limits(engines, model_path: str):
    """What the engines accept (`streamrl.fleet.limits`): the model's embedding rows and the
    smallest context length an engine reports."""
    from streamrl.models import model_config

    config = await anyio.to_thread.run_sync(model_config, model_path)
    model_max = int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1)
    return await engines.read_limits(vocab_size=int(config.vocab_size), model_max=model_max)


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
