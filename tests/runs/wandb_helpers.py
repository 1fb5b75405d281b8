"""Reading an offline W&B run back from its `.wandb` file (wandb has no reader for it)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK_BYTES = 32768
HEADER_BYTES = 7


def wandb_records(run_dir: Path) -> list[Any]:
    """Every protobuf `Record` of the offline run under run_dir/wandb, in order. The file is a
    LevelDB-style log: 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length,
    type: 1 whole record, 2/3 its first/middle piece, 4 its last piece, 0 padding)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, records = HEADER_BYTES, b"", []
    while position + HEADER_BYTES <= len(data):
        left = BLOCK_BYTES - position % BLOCK_BYTES
        if left < HEADER_BYTES:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER_BYTES])
        position += HEADER_BYTES
        if kind == 0:
            position += left - HEADER_BYTES
            continue
        pending += data[position : position + length]
        position += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline run, as {key: value}."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in wandb_records(run_dir)
        if record.WhichOneof("record_type") == "history"
    ]


def wandb_step_metrics(run_dir: Path) -> dict[str, str]:
    """Each metric the run defined by name, with the step metric it is plotted against
    ("" for an axis itself)."""
    return {
        record.metric.name: record.metric.step_metric
        for record in wandb_records(run_dir)
        if record.WhichOneof("record_type") == "metric" and record.metric.name
    }
