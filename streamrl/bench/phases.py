"""Each pipeline stage alone: generation without training, training without generation.

Generation alone: the run's engines (`EngineSupervisor`, same config) and the real
rollout process (`streamrl _rollout`) stream groups into a sink that
applies the buffer's filters and counts, with a fixed window of groups in
flight (the most the async run's admission allows: (eta + 1) * B) and no
weight updates. Weights stay at the initial model: generation cost does not
depend on the weights' values (a random model rarely stops early, so lengths
are fixed by max_new_tokens; with a model whose lengths change as it learns,
this measures the initial lengths).

Training alone: the batches an async run trained (recorded by
`runs.record_trained_groups`) replayed through `train_step` with the configured
backend, from the initial model, in a child process of its own. It times
`train_step` only: no buffer wait, no weight snapshot or broadcast.

Both report tokens that training consumes per second (response tokens of
groups that pass the filters), so they compare directly with the runs'
effective training throughput.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import anyio

from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.bench.runs import BenchError, read_recorded_groups

WARMUP_STEPS = 1
"""Batches (or B-group stretches) left out at the start, as in the runs' window."""


def _trained_tokens(group) -> int:
    return sum(s.num_trained_tokens for s in group.samples)


# ---------------------------------------------------------------- generation alone


def generation_only(
    cfg,
    *,
    run_dir: Path,
    model_path: str,
    num_groups: int,
    window: int,
    timeout_s: float,
    gpus: GpuMonitor | None = None,
) -> dict[str, Any]:
    """Generate `num_groups` groups with `window` in flight; see the module docstring."""
    from streamrl.config import dump_toml
    from streamrl.fleet.commands import engine_argv_factory
    from streamrl.fleet.supervisor import EngineSupervisor

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    fleet = EngineSupervisor(
        cfg, run_dir=run_dir, engine_argv=engine_argv_factory(cfg, model_path, 0)
    )
    try:
        fleet.start()  # main thread: the engines die with it
        result = anyio.run(
            _generate, cfg, fleet, run_dir, model_path, num_groups, window, timeout_s
        )
    finally:
        fleet.stop()
    if gpus is not None:
        result["gpu_busy"] = gpus.busy(*result["window_monotonic"])
    return result


async def _generate(cfg, fleet, run_dir, model_path, num_groups, window, timeout_s):
    from streamrl.mains.rollout import (
        RolloutSpec,
        known_limits,
        resolved_tokenizer,
        start_rollout,
    )
    from streamrl.process import LocalSpawner
    from streamrl.queues.buffer import FILTERS
    from streamrl.queues.receiver import StreamReceiver, UnlimitedCredits

    filters = [FILTERS[name] for name in ["generation_failed", *cfg.buffer.filters]]
    skip = cfg.rollout.batch_size * WARMUP_STEPS if num_groups > 2 * cfg.rollout.batch_size else 1
    arrivals: list[tuple[float, int, bool]] = []  # (time, trainable tokens, kept)
    warm, done = anyio.Event(), anyio.Event()

    def on_group(group) -> None:
        kept = all(keep(group) for keep in filters)
        arrivals.append((time.monotonic(), _trained_tokens(group), kept))
        if len(arrivals) == skip:
            warm.set()
        if len(arrivals) >= num_groups:
            done.set()

    receiver = StreamReceiver(
        "tcp://127.0.0.1:0", credits=UnlimitedCredits(window), on_group=on_group
    )
    # What the trainer hands a run's rollout process (it then imports no torch).
    vocab_size, max_position_embeddings = known_limits(model_path)
    tokenizer = resolved_tokenizer(cfg, model_path)
    tokenizer_class = type(tokenizer).__name__ if tokenizer is not None else ""
    readings = {}
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            address = await tg.start(receiver.run)
            rollout = start_rollout(
                LocalSpawner(),
                run_dir,
                RolloutSpec(
                    buffer_address=address,
                    engine_urls=fleet.urls,
                    router_url=fleet.router_url,
                    model_path=model_path,
                    vocab_size=vocab_size,
                    max_position_embeddings=max_position_embeddings,
                ),
                log_level="warning",
                tokenizer_class=tokenizer_class,
            )
            try:
                watch = anyio.CancelScope()
                tg.start_soon(_fail_if_exits, rollout, watch)
                await warm.wait()
                readings["start"] = await _engine_loads(fleet)
                await done.wait()
                readings["end"] = await _engine_loads(fleet)
                watch.cancel()
                await receiver.stop("generation benchmark done")
            finally:
                rollout.stop(timeout_s=15)
                tg.cancel_scope.cancel()
    return _generation_result(arrivals, readings, skip=skip, window=window)


async def _fail_if_exits(child, scope: anyio.CancelScope) -> None:
    with scope:
        await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    if not scope.cancel_called:
        raise BenchError(f"the rollout process exited during generation:\n{child.log_tail()}")


async def _engine_loads(fleet) -> dict[str, float]:
    loads = [await engine.client.load() for engine in fleet.engines]
    return {
        "busy_s": sum(load["busy_s"] for load in loads),
        "uptime_s": sum(load["uptime_s"] for load in loads),
        "generated_tokens": sum(load["generated_tokens"] for load in loads),
        "num_engines": len(loads),
    }


def _generation_result(arrivals, readings, *, skip: int, window: int) -> dict[str, Any]:
    """Throughput from the arrival of group `skip` to the last one."""
    start_s = arrivals[skip - 1][0]
    measured = arrivals[skip:]
    window_s = max(arrivals[-1][0] - start_s, 1e-9)
    kept_tokens = sum(tokens for _, tokens, kept in measured if kept)
    start, end = readings["start"], readings["end"]
    uptime = end["uptime_s"] - start["uptime_s"]
    per_engine_s = uptime / end["num_engines"]
    return {
        "groups": len(arrivals),
        "groups_kept": sum(kept for _, _, kept in arrivals),
        "window_groups": window,
        "warmup_groups": skip,
        "window_s": window_s,
        "window_monotonic": [start_s, arrivals[-1][0]],
        "trainable_tokens_per_s": kept_tokens / window_s,
        "groups_per_s": len(measured) / window_s,
        "engine_idle_frac": max(0.0, 1.0 - (end["busy_s"] - start["busy_s"]) / uptime)
        if uptime > 0
        else None,
        "generated_tokens_per_s": (end["generated_tokens"] - start["generated_tokens"])
        / per_engine_s
        if per_engine_s > 0
        else None,
    }


# ---------------------------------------------------------------- training alone


def replay_command(args: argparse.Namespace) -> int:
    """`streamrl bench replay CONFIG --groups PATH --model DIR --out JSON` (a child process)."""
    from streamrl.config import load_config

    cfg = load_config(args.config)
    result = replay(cfg, model_path=args.model, groups_path=Path(args.groups))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"replay: {result['trained_tokens_per_s']:,.0f} trained tokens/s over "
        f"{result['batches_timed']} batches"
    )
    return 0


def replay(cfg, *, model_path: str, groups_path: Path) -> dict[str, Any]:
    """Train on the recorded batches from `model_path`; time each `train_step`."""
    import torch

    from streamrl.backends.build import build_backend, learner_devices, pad_token_id
    from streamrl.backends.step import train_step

    batches = read_recorded_groups(groups_path)
    if not batches:
        raise BenchError(f"{groups_path}: no recorded batches")
    if cfg.learner.num_gpus > 1:
        raise BenchError("training alone replays on one learner process (learner.num_gpus = 1)")
    device, dtype = learner_devices(cfg)
    if cfg.learner.backend == "megatron":
        from streamrl.backends.rendezvous import init_distributed
        from streamrl.process import free_port

        init_distributed(rank=0, world_size=1, master_port=free_port(), device=device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = build_backend(cfg, model_path, device, dtype)
    pad_id = pad_token_id(backend)
    times, tokens, started_at = [], [], []
    for groups in batches:
        started_at.append(time.monotonic())
        metrics = train_step(backend, groups, cfg, pad_id=pad_id)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.monotonic() - started_at[-1])
        tokens.append(metrics["train/trained_tokens"])
    ended_at = time.monotonic()
    if cfg.learner.backend == "megatron":
        from streamrl.backends.rendezvous import shutdown

        shutdown()
    skip = WARMUP_STEPS if len(batches) > WARMUP_STEPS else 0
    return {
        "batches": len(batches),
        "batches_timed": len(batches) - skip,
        "train_s": times,
        "trained_tokens_per_s": sum(tokens[skip:]) / max(sum(times[skip:]), 1e-9),
        "train_s_mean": sum(times[skip:]) / max(len(times) - skip, 1),
        # Timed batches on CLOCK_MONOTONIC, which the parent's GPU monitor reads too.
        "window_monotonic": [started_at[skip], ended_at],
    }
