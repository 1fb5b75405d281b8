"""One training run for a benchmark: `streamrl run` in a child process, observed from outside.

    bench process                         child: `streamrl bench run-one CONFIG`
      write CONFIG (overrides applied)      streamrl.mains.trainer.run(cfg): engines, rollout,
      spawn child ───────────────────────►  learner; metrics.jsonl one line per step
      observe: each time a step line appears in metrics.jsonl, read every engine's
               /get_load (busy_s, uptime_s, generated_tokens) ──► EngineReading(step)
      child exits ─► summarize(run_dir, readings)

Each run is its own process so that runs cannot leak state into one another
(torch.distributed groups, CUDA memory, Megatron's globals). The observer polls
the metrics file every 0.1 s: it watches another process, which offers nothing to
wait on; a reading therefore trails its step's end by up to ~0.1 s plus one HTTP
round trip, on both edges of a window.

The measurement window (AReaL's "effective training throughput" without startup):
steps `warmup + 1 .. N`, from the end of step `warmup` to the end of step N, on the
learner's clock (`time` in metrics.jsonl). Step 1 is left out by default because
it holds the pipeline fill (the learner waits for a first full batch with nothing
to overlap) and one-off warm-up (first CUDA graphs, allocator growth).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from streamrl.bench.gpu_monitor import GpuMonitor
from streamrl.metrics import read_metrics
from streamrl.process import ChildProcess, spawn, streamrl_argv

POLL_S = 0.1
"""How often the observer looks for a new step line (see the module docstring)."""


class BenchError(RuntimeError):
    """A benchmark run that failed; the message names its log."""


@dataclass
class EngineReading:
    """Every engine's `/get_load` busy clock, read right after a step line appeared."""

    step: int
    """The newest step in metrics.jsonl when read (0: before the first step)."""
    seen_s: float
    """Bench-process monotonic time of the reading."""
    busy_s: list[float]
    uptime_s: list[float]
    generated_tokens: list[int]


@dataclass
class RunSpec:
    name: str
    config_path: Path
    run_dir: Path
    record_path: Path | None = None
    readings: list[EngineReading] = field(default_factory=list)


def write_run_config(base: Path, overrides: list[str], target: Path) -> Path:
    """Resolve `base` + `overrides` (validated) and write it to `target` as TOML."""
    from streamrl.config import dump_toml, load_config

    cfg = load_config(base, overrides)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(dump_toml(cfg))
    return target


def run_observed(
    spec: RunSpec, *, timeout_s: float, log_level: str = "warning", gpus: GpuMonitor | None = None
) -> dict[str, Any]:
    """Run `spec` to completion in a child process; returns `summarize(...)` of it, with each
    GPU's busy share over the window when `gpus` watches them. A run directory left by an
    earlier bench in the same `--work-dir` is replaced (the bench owns it)."""
    if (spec.run_dir / "metrics.jsonl").exists():
        print(f"  replacing the earlier run in {spec.run_dir}", file=sys.stderr)
        shutil.rmtree(spec.run_dir)
    argv = streamrl_argv("--log-level", log_level, "bench", "run-one", str(spec.config_path))
    if spec.record_path is not None:
        argv += ["--record", str(spec.record_path)]
    log_path = spec.config_path.with_suffix(".log")
    child = spawn(f"run-{spec.name}", argv, log_path=log_path)
    try:
        code = anyio.run(_watch, spec, child, timeout_s)
    finally:
        child.stop(timeout_s=30)
    if code != 0:
        raise BenchError(
            f"run {spec.name} exited with code {code}; last lines of {log_path}:\n"
            f"{child.log_tail(40)}"
        )
    result = {"name": spec.name, **summarize(spec.run_dir, spec.readings)}
    if gpus is not None:
        span = _window_span(spec.readings, result["warmup_steps"], result["steps"])
        result["gpu_busy"] = gpus.busy(*span) if span else {}
    (spec.run_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


async def _watch(spec: RunSpec, child: ChildProcess, timeout_s: float) -> int | None:
    code: int | None = None
    with anyio.move_on_after(timeout_s) as deadline:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_observe, spec)
            code = await anyio.to_thread.run_sync(child.popen.wait, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
    if deadline.cancelled_caught:
        raise BenchError(f"run {spec.name} did not finish within {timeout_s:.0f} s")
    return code


async def _observe(spec: RunSpec) -> None:
    """Append an EngineReading to `spec.readings` at start and after every new step line."""
    metrics_path = spec.run_dir / "metrics.jsonl"
    engines_path = spec.run_dir / "engines.json"
    offset, pending, last_step = 0, b"", -1
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            await anyio.sleep(POLL_S)
            if not engines_path.exists():
                continue
            step = last_step
            if metrics_path.exists():
                with open(metrics_path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    record = json.loads(line) if line.strip() else {}
                    if "kind" not in record and "step" in record:
                        step = int(record["step"])
            if step == last_step and last_step >= 0:
                continue
            reading = await _read_engines(client, engines_path, max(step, 0))
            if reading is not None:
                spec.readings.append(reading)
                last_step = max(step, 0)


async def _read_engines(
    client: httpx.AsyncClient, engines_path: Path, step: int
) -> EngineReading | None:
    try:
        urls = [row["url"] for row in json.loads(engines_path.read_text())["engines"]]
    except (json.JSONDecodeError, KeyError, OSError):
        return None  # being rewritten
    seen_s = time.monotonic()
    busy, uptime, tokens = [], [], []
    for url in urls:
        try:
            load = (await client.get(f"{url}/get_load")).json()[0]
        except (httpx.HTTPError, ValueError, IndexError, KeyError):
            return None
        if "busy_s" not in load:
            return None  # not the embedded engine (SGLang has no busy clock)
        busy.append(float(load["busy_s"]))
        uptime.append(float(load["uptime_s"]))
        tokens.append(int(load["generated_tokens"]))
    return EngineReading(step, seen_s, busy, uptime, tokens)


# ---------------------------------------------------------------- summary


CURVE_DIAGNOSTICS = {
    "mismatch_kl": "train/mismatch_kl",
    "importance_ess": "train/importance_ess",
    "importance_ratio_std": "train/importance_ratio_std",
    "clip_fraction": "train/clip_fraction",
    "bound": "staleness/bound",
    "auto_change": "staleness/auto_change",
    "auto_reason": "staleness/auto_reason",
}
"""Per-step metrics each point of a run's reward curve carries (None where a run has none):
the off-policy diagnostics and the staleness bound in force (`streamrl.actors.auto_staleness`)."""


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "kind" not in r]


def _eval_rewards(record: dict[str, Any]) -> dict[str, float]:
    """An eval record's `eval/<dataset>/reward_mean` values, keyed by dataset."""
    return {
        key.split("/")[1]: value
        for key, value in record.items()
        if key.startswith("eval/") and key.endswith("/reward_mean")
    }


def summarize(
    run_dir: Path, readings: list[EngineReading], *, warmup_steps: int = 1
) -> dict[str, Any]:
    """Window metrics of a finished run (see the module docstring for the window)."""
    steps = step_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    warmup = warmup_steps if len(steps) > warmup_steps else 0
    window = steps[warmup:]
    start_s = steps[warmup - 1]["time"] if warmup else 0.0
    start_samples = steps[warmup - 1]["samples_trained"] if warmup else 0
    window_s = max(steps[-1]["time"] - start_s, 1e-9)
    trained_tokens = sum(r["train/trained_tokens"] for r in window)
    result: dict[str, Any] = {
        "steps": len(steps),
        "warmup_steps": warmup,
        "window_s": window_s,
        "trained_tokens": trained_tokens,
        "effective_tokens_per_s": trained_tokens / window_s,
        "samples_per_s": (steps[-1]["samples_trained"] - start_samples) / window_s,
        "learner_idle_frac": sum(r["learner_idle_s"] for r in window) / window_s,
        "learner_train_frac": sum(r["train_s"] for r in window) / window_s,
        "step_time_s_mean": window_s / len(window),
        "train_s_mean": sum(r["train_s"] for r in window) / len(window),
        "weights": _mean_of(
            window,
            (
                "weights/learner_stall_s",
                "weights/engine_pause_s",
                "weights/broadcast_s",
                "weights/gb_per_s",
            ),
        ),
        "staleness_histogram": summary["buffer"]["staleness_histogram"],
        "versions_spanned_histogram": summary["buffer"]["versions_spanned_histogram"],
        "groups": {
            k: summary[k]
            for k in ("groups_started", "groups_trained", "groups_filtered", "groups_evicted")
        },
        "accounting_ok": summary["accounting_ok"],
        "reward_curve": [
            {
                "step": r["step"],
                "samples_trained": r["samples_trained"],
                "reward_mean": r["reward_mean"],
                "staleness_mean": r["staleness_mean"],
                "time_s": r["time"],
                "entropy": r.get("train/entropy"),
                **{name: r.get(key) for name, key in CURVE_DIAGNOSTICS.items()},
            }
            for r in steps
        ],
        "evals": [
            {"version": r["version"], "time_s": r["time"], **_eval_rewards(r)}
            for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("kind") == "eval"
        ],
    }
    result.update(_engine_window(readings, warmup, len(steps)))
    return result


def _mean_of(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        out[key.split("/", 1)[1]] = sum(values) / len(values) if values else 0.0
    return out


def _window_readings(
    readings: list[EngineReading], first: int, last: int
) -> tuple[EngineReading, EngineReading] | None:
    """The readings taken right after steps first and last (None when there are none)."""
    start = next((r for r in readings if r.step >= first), None)
    end = next((r for r in reversed(readings) if r.step >= last), None)
    if start is None or end is None or end is start or len(start.busy_s) != len(end.busy_s):
        return None
    return start, end


def _window_span(
    readings: list[EngineReading], first: int, last: int
) -> tuple[float, float] | None:
    """The window on this process's monotonic clock, from its edge readings."""
    edges = _window_readings(readings, first, last)
    return (edges[0].seen_s, edges[1].seen_s) if edges else None


def _engine_window(readings: list[EngineReading], first: int, last: int) -> dict[str, Any]:
    """Engine busy share and generated tokens/s between the readings at steps first and last."""
    edges = _window_readings(readings, first, last)
    if edges is None:
        return {"engine_idle_frac": None, "generated_tokens_per_s": None}
    start, end = edges
    busy = sum(end.busy_s) - sum(start.busy_s)
    uptime = sum(end.uptime_s) - sum(start.uptime_s)
    per_engine_s = uptime / len(end.uptime_s)
    tokens = sum(end.generated_tokens) - sum(start.generated_tokens)
    return {
        "engine_idle_frac": max(0.0, 1.0 - busy / uptime) if uptime > 0 else None,
        "generated_tokens_per_s": tokens / per_engine_s if per_engine_s > 0 else None,
        "engine_window_s": per_engine_s,
        "engine_readings": [asdict(r) for r in readings],
    }


# ---------------------------------------------------------------- the child


@contextlib.contextmanager
def record_trained_groups(path: Path) -> Iterator[None]:
    """Append every batch the learner trains to `path` (length-prefixed msgpack of list[Group]).

    A bench-only hook: it wraps `train_step` as the learner loop calls it, inside this
    process only. The encode and write (~1 ms per MB) fall inside the step's `train_s`."""
    import streamrl.actors.learner as learner_module
    from streamrl.types import make_encoder

    original = learner_module.train_step
    encoder = make_encoder()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:

        def recording(backend, groups, cfg, *, pad_id):
            frame = encoder.encode(groups)
            handle.write(len(frame).to_bytes(8, "little") + frame)
            handle.flush()
            return original(backend, groups, cfg, pad_id=pad_id)

        learner_module.train_step = recording
        try:
            yield
        finally:
            learner_module.train_step = original


def read_recorded_groups(path: Path) -> list[list[Any]]:
    """The batches written by `record_trained_groups`, in training order."""
    from streamrl.types import Group, make_decoder

    decoder = make_decoder(list[Group])
    data = path.read_bytes()
    batches, offset = [], 0
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset : offset + 8], "little")
        batches.append(decoder.decode(data[offset + 8 : offset + 8 + size]))
        offset += 8 + size
    return batches


def run_one_command(args: argparse.Namespace) -> int:
    """`streamrl bench run-one CONFIG [--record PATH]`: `streamrl run`, optionally recording."""
    from streamrl.config import load_config
    from streamrl.launch.run import run

    cfg = load_config(args.config)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    recorder = record_trained_groups(Path(args.record)) if args.record else contextlib.nullcontext()
    with recorder:
        try:
            summary = anyio.run(run, cfg)
        except KeyboardInterrupt:
            print("run-one: interrupted", file=sys.stderr)
            return 130
    print(f"run-one: {summary['steps']} steps in {summary['wall_s']:.1f} s", file=sys.stderr)
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
