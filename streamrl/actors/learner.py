"""The learner loop: the always-running consumer of the intake.

    for each step:   groups = await intake.take(B, version)    # waits only when the buffer is short
                     metrics = train_step(groups)               # in a worker thread
                     version += 1
                     await publisher.publish(version)           # snapshot; broadcast runs behind
                     record metrics; checkpoint every train.save_interval steps

What unblocks the wait: the rollout stream delivering groups, which it may
start only with admission credits; credits come back as the buffer drains
(`take`) and as the publisher lands new versions on the engines (the
publisher's `on_published` is the intake's). The loop sees only the intake,
the publisher, the backend and the metrics writer.

The debug modes of `train.mode` change the loop's parts, not its shape: `rollout_only`
has no backend and no publisher (each step's groups are written by the `RolloutWriter`,
and admission is told a step passed so generation goes on at the same pace, while the
policy stays version 0); `train_only` has no publisher and takes its groups from saved
files (`streamrl.queues.rollout_files.ReplayIntake`). `train.save_rollouts` adds the
writer to the other modes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from streamrl import checkpoint
from streamrl.backends.base import LearnerBackend
from streamrl.backends.step import train_step
from streamrl.config import RunConfig
from streamrl.data import DataPosition, position_after
from streamrl.metrics import MetricsWriter
from streamrl.publish.publisher import WeightPublisher
from streamrl.queues import horizon
from streamrl.queues.accounting import AccountingError
from streamrl.queues.intake import Intake
from streamrl.queues.protocol import Report
from streamrl.queues.rollout_files import RolloutWriter
from streamrl.types import Group, make_encoder

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 120.0
"""A checkpoint waits this long for the rollout's groups in flight (it holds generation
for the snapshot alone), else is written without them."""


class LearnerLoop:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        backend: LearnerBackend | None,
        intake: Intake,
        publisher: WeightPublisher | None,
        metrics: MetricsWriter,
        run_dir: Path,
        state: checkpoint.TrainState,
        pad_id: int,
        writer: RolloutWriter | None = None,
    ) -> None:
        """`backend` None: nothing is trained (`rollout_only`); `publisher` None: no engines
        take weights (`rollout_only`, `train_only`); `writer`: each step's groups are saved."""
        self.cfg = cfg
        self.backend = backend
        self.intake = intake
        self.publisher = publisher
        self.metrics = metrics
        self.run_dir = run_dir
        self.state = state
        self.pad_id = pad_id
        self.writer = writer
        self.version = state.version
        self.start_position = DataPosition(next_seq=state.next_seq, skip=list(state.skip))
        self._trained_tokens = 0

    def record_eval_reports(self) -> None:
        """Write the evaluation results that arrived since the last call to the metrics."""
        for report in self.intake.pop_eval_reports():
            self._record_eval(report)

    def _record_eval(self, report: Report) -> None:
        payload = dict(report.payload)
        name = payload.pop("dataset")
        version = int(payload.pop("version"))
        record: dict[str, Any] = {
            "kind": "eval",
            "dataset": name,
            "step": self.state.step,
            "version": version,
            "time": self.metrics.elapsed_s,
        }
        record.update({f"eval/{name}/{key}": value for key, value in payload.items()})
        self.metrics.write(record, step=version)
        log.info("eval %s at version %d: reward %.3f", name, version, payload["reward_mean"])

    # ---- the loop --------------------------------------------------------

    async def run(self) -> checkpoint.TrainState:
        batch_size = self.cfg.rollout.batch_size
        while self.state.step < self.cfg.train.steps:
            wait_started = time.perf_counter()
            groups = await self.intake.take(batch_size, self.version)
            groups.sort(key=lambda group: group.prompt_seq)  # rows in one order, run after run
            idle_s = time.perf_counter() - wait_started
            if self.writer is not None:
                await anyio.to_thread.run_sync(self.writer.write, self.state.step + 1, groups)
            step_started = time.perf_counter()
            trained_version = self.version
            if self.backend is None:  # rollout_only: the policy stays where it is
                step_metrics = {"train/trained_tokens": 0.0}
                await self.intake.on_published(self.state.step + 1)  # a step's credits
            else:
                step_metrics = await anyio.to_thread.run_sync(self._train, groups)
                self.version += 1
            train_s = time.perf_counter() - step_started
            publish = None
            if self.publisher is not None:
                publish = await self.publisher.publish(self.version)
            self.state.step += 1
            self.state.version = self.version
            self.state.samples_trained += sum(len(g.samples) for g in groups)
            self._trained_tokens += int(step_metrics["train/trained_tokens"])
            record = self._record(groups, trained_version, idle_s, train_s, step_metrics)
            record["weights/learner_stall_s"] = publish.learner_stall_s if publish else 0.0
            if self.publisher is not None:
                record["weights/digest_mismatches"] = self.publisher.num_digest_mismatches
            record["step_time_s"] = time.perf_counter() - wait_started
            if self.publisher is not None and self.publisher.records:
                last = self.publisher.records[-1].as_metrics()
                record.update({k: v for k, v in last.items() if k != "weights/learner_stall_s"})
            problems = self.intake.accounting_problems()
            record.update(self.intake.accounting_metrics())
            record["accounting/ok"] = not problems
            self.metrics.write(record, step=self.state.step)
            if problems:
                raise AccountingError(
                    f"step {self.state.step}: the group accounting does not add up "
                    f"({record['accounting/started']} started, {record['accounting/trained']} "
                    f"trained, {record['accounting/filtered']} filtered, "
                    f"{record['accounting/evicted']} evicted, {record['accounting/buffered']} "
                    f"buffered, {record['accounting/in_flight']} in flight): " + "; ".join(problems)
                )
            self.metrics.print_step(record, self.cfg.train.steps)
            self.record_eval_reports()
            interval = self.cfg.train.save_interval
            if interval and self.state.step % interval == 0 and self.backend is not None:
                await self.save()
        if self.publisher is not None:
            await self.publisher.wait_idle()
        return self.state

    def _train(self, groups: list[Group]) -> dict[str, float]:
        """One step, in a worker thread (which must be bound to the learner's GPU first)."""
        if self.backend.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.backend.device)
        return train_step(self.backend, groups, self.cfg, pad_id=self.pad_id)

    async def save(self) -> Path:
        """A checkpoint of the model, the optimizer and the run's asynchronous state: the
        intake at a cut with the rollout (buffered groups, every prompt's fate, the groups
        in flight with their tokens) and this process's random states."""
        cut = await self.intake.snapshot(self.state.step, timeout_s=SNAPSHOT_TIMEOUT_S)
        position = position_after(self.intake.done_seqs, since=self.start_position)
        self.state.next_seq, self.state.skip = position.next_seq, list(position.skip)
        files = {
            checkpoint.ASYNC_STATE_FILE: make_encoder().encode(cut),
            checkpoint.RNG_FILE: checkpoint.rng_state(),
        }
        started = time.perf_counter()
        path = await anyio.to_thread.run_sync(
            lambda: checkpoint.save(
                self.run_dir,
                self.state,
                self.backend.save,
                keep=self.cfg.train.keep_checkpoints,
                files=files,
            )
        )
        self.metrics.write(
            {
                "kind": "checkpoint",
                "step": self.state.step,
                "version": self.version,
                "time": self.metrics.elapsed_s,
                "checkpoint/snapshot_s": cut.snapshot_s,
                "checkpoint/rollout_pause_s": cut.rollout_pause_s,
                "checkpoint/write_s": time.perf_counter() - started,
                "checkpoint/bytes": checkpoint.size_bytes(path),
                "checkpoint/async_state_bytes": len(files[checkpoint.ASYNC_STATE_FILE]),
                "checkpoint/complete": cut.is_complete,
                "checkpoint/buffered_groups": len(cut.buffered),
                "checkpoint/in_flight_groups": len(cut.in_flight),
                "checkpoint/in_flight_samples": sum(len(g.samples) for g in cut.in_flight),
                "checkpoint/in_flight_tokens": sum(
                    len(s.output_ids) for g in cut.in_flight for s in g.samples
                ),
            },
            step=self.state.step,
        )
        log.info(
            "checkpoint %s (version %d): %d groups buffered, %d in flight (snapshot %.2f s)",
            path,
            self.version,
            len(cut.buffered),
            len(cut.in_flight),
            cut.snapshot_s,
        )
        return path

    def _record(
        self,
        groups: list[Group],
        trained_version: int,
        idle_s: float,
        train_s: float,
        step_metrics: dict[str, float],
    ) -> dict[str, Any]:
        rewards = np.array([s.reward for g in groups for s in g.samples], dtype=np.float64)
        staleness = [g.staleness(trained_version) for g in groups]
        stats = self.intake.buffer.stats
        elapsed = self.metrics.elapsed_s
        record: dict[str, Any] = {
            "step": self.state.step,
            "version": self.version,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": int(max(staleness)),
            "versions_spanned_max": max(g.num_versions_spanned for g in groups),
            "prompt_seqs": [g.prompt_seq for g in groups],
            "samples_trained": self.state.samples_trained,
            "groups_trained": stats.num_handed_out,
            "groups_accepted": stats.num_accepted,
            "groups_filtered": stats.num_filtered,
            "groups_evicted": stats.num_evicted,
            "groups_buffered": len(self.intake.buffer),
            **{f"filtered/{name}": count for name, count in sorted(stats.filtered.items())},
            "learner_idle_s": idle_s,
            "train_s": train_s,
            "time": elapsed,
            "unix_time": time.time(),
            "throughput/trained_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
            "response_len_generated_mean": stats.generated.mean,
            "response_len_trained_mean": stats.trained.mean,
        }
        generated = self.intake.generated_rewards.pop_mean()
        if generated is not None:  # includes groups the buffer filtered, unlike reward_mean
            record["reward_generated_mean"] = generated
        record.update(_episode_metrics(groups))
        record.update(
            horizon.step_metrics(groups, trained_version, self.intake.buffer.max_staleness)
        )
        record.update(step_metrics)
        rollout = self.intake.rollout_counters
        for key in (
            "response_tokens",
            "samples",
            "generation_failures",
            "reward_failures",
            "resumes",
            "resume_prompt_tokens",
            "inexact_version_samples",
            "resumed_samples",
            "resumed_tokens",
            "regenerated_groups",
            "groups_started",
        ):
            if key in rollout:
                record[f"rollout/{key}"] = rollout[key]
        for reason, count in rollout.get("rejected", {}).items():
            record[f"rollout/rejected/{reason}"] = count
        if "response_tokens" in rollout:
            record["throughput/generated_tokens_per_s"] = rollout["response_tokens"] / max(
                elapsed, 1e-9
            )
        return record


def _episode_metrics(groups: list[Group]) -> dict[str, Any]:
    """Aggregates of what generate functions record per sample (turns, tools, endings)."""
    samples = [s for g in groups for s in g.samples]
    turns = [s.metadata.get("num_turns", 0) for s in samples]
    record: dict[str, Any] = {
        "episode/turns_mean": float(np.mean(turns)) if turns else 0.0,
        "episode/turns_max": int(max(turns, default=0)),
    }
    for key in ("tool_calls", "tool_errors", "tool_timeouts"):
        values = [s.metadata[key] for s in samples if key in s.metadata]
        if values:
            record[f"episode/{key}"] = int(sum(values))
    reasons: dict[str, int] = {}
    for sample in samples:
        if "end_reason" in sample.metadata:
            reason = str(sample.metadata["end_reason"])
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        record[f"episode/ended_{reason}"] = count
    return record
