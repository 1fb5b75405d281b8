"""`run_dir/events.jsonl`: what happened to a run's processes, one JSON object a line.

    {"time": 1718000000.0, "engine": "http://10.0.0.2:30001", "event": "down", "reason": "hung"}
    {"time": 1718000042.5, "component": "rollout", "event": "rollout_restarted", "code": -9, ...}

Three writers share this one function: the engine supervisor (an engine down, restarted,
serving again: `streamrl.fleet.supervisor`), the trainer (the rollout process restarted,
or stopped by an error a restart would repeat: `streamrl.mains.rollout_keeper`) and the
learner ranks' launcher (where each rank runs: `streamrl.mains.ranks`). People and tests
read it; nothing in a run does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


def append_event(run_dir: Path, record: dict[str, Any]) -> None:
    """Append `record` to `run_dir/events.jsonl`, stamped with the wall-clock `time` (s)."""
    with open(run_dir / EVENTS_FILE, "a") as handle:
        handle.write(json.dumps({"time": time.time(), **record}) + "\n")
