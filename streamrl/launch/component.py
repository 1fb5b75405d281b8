"""Entry point of child components of `streamrl run` (`streamrl _component ROLE`).

The parent writes the resolved `config.toml` and, for the rollout process,
`rollout.json` (buffer address, engine and router URLs, data position) into
the run directory; the child reads them and runs until told to stop.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import anyio

from streamrl.config import RunConfig, load_config

log = logging.getLogger(__name__)


def component_command(args) -> int:
    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.toml")
    if args.role == "rollout":
        spec = json.loads((run_dir / "rollout.json").read_text())
        anyio.run(rollout_main, cfg, spec)
        return 0
    from streamrl.learners.distributed import follower_main

    return follower_main(cfg, run_dir, args.rank)


def sampling_params(sampling) -> dict:
    """A SamplingConfig as SGLang `sampling_params`."""
    params = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


async def rollout_main(cfg: RunConfig, spec: dict) -> None:
    from streamrl.actors.evaluator import Evaluator
    from streamrl.actors.rollout import RolloutWorker
    from streamrl.data import DataPosition, PromptSource
    from streamrl.engine.client import EngineSet
    from streamrl.engine.models import load_tokenizer
    from streamrl.queues.transport import StreamSender
    from streamrl.rewards import load_reward_fn
    from streamrl.utils import import_object

    tokenizer = await anyio.to_thread.run_sync(
        load_tokenizer, cfg.model.tokenizer or spec["model_path"]
    )
    source = PromptSource.from_config(
        cfg.data, tokenizer, seed=cfg.train.seed, position=DataPosition(**spec["position"])
    )
    sender = StreamSender(
        spec["buffer_address"], sender_id="rollout-0", want=cfg.rollout.max_concurrent_groups
    )
    engines = EngineSet(spec["engine_urls"], router_url=spec["router_url"] or None)
    generate_fn = import_object(cfg.rollout.generate_fn, "rollout.generate_fn")
    worker = RolloutWorker(
        worker_id="rollout-0",
        source=source,
        sender=sender,
        engines=engines,
        tokenizer=tokenizer,
        generate_fn=generate_fn,
        reward_fn=load_reward_fn(cfg.rollout.reward_fn),
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        sampling_params=sampling_params(cfg.rollout.sampling),
        generate_kwargs=dict(cfg.rollout.generate_kwargs),
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        retry_timeout_s=cfg.rollout.retry_timeout_s,
    )
    async with engines, anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_sigterm, tg.cancel_scope)
        await tg.start(sender.run)
        tg.start_soon(worker.report_loop)
        if cfg.eval.interval and cfg.eval.datasets:
            evaluator = Evaluator(
                list(cfg.eval.datasets),
                data_cfg=cfg.data,
                interval=cfg.eval.interval,
                tokenizer=tokenizer,
                engines=engines,
                sender=sender,
                default_reward_fn=cfg.rollout.reward_fn,
                reward_timeout_s=cfg.rollout.reward_timeout_s,
                generate_fn=generate_fn,
                generate_kwargs=dict(cfg.rollout.generate_kwargs),
            )
            tg.start_soon(evaluator.run)
        await worker.run()
        log.info("rollout stopped: %s", worker.counters.as_dict())
        tg.cancel_scope.cancel()


async def _cancel_on_sigterm(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return
