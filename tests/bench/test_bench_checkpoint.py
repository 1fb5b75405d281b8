"""`streamrl bench checkpoint`: what it reads from a run's checkpoint records."""

from __future__ import annotations

from streamrl.bench.checkpoint import checkpoint_records, summarize_records
from streamrl.metrics import MetricsWriter


def test_the_learners_stall_and_the_background_write_are_read_from_each_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, progress=False)
    for step, stall_s, write_s in ((3, 0.02, 0.5), (6, 0.04, 0.7)):
        writer.write({"step": step, "version": step, "step_time_s": 0.1}, step=step)
        record = {
            "kind": "checkpoint",
            "step": step,
            "checkpoint/snapshot_s": 0.003,
            "checkpoint/rollout_pause_s": 0.002,
            "checkpoint/staging_s": stall_s / 2,
            "checkpoint/wait_previous_s": 0.0,
            "checkpoint/stall_s": stall_s,
            "checkpoint/write_s": write_s,
            "checkpoint/bytes": 100,
            "checkpoint/complete": True,
        }
        writer.write(record, step=step)
    writer.close()
    records = checkpoint_records(tmp_path)
    assert [(r["step"], r["stall_s"], r["write_s"]) for r in records] == [
        (3, 0.02, 0.5),
        (6, 0.04, 0.7),
    ]
    summary = summarize_records(records)
    assert summary["stall_s"] == {"median": 0.03, "max": 0.04}
    assert summary["staging_s"]["max"] == 0.02 and summary["write_s"]["median"] == 0.6
    assert summary["count"] == summary["complete"] == 2
