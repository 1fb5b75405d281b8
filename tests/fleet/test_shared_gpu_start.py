"""SGLang engines that share a GPU start one after another (each sizes its KV pool from the
memory free when it starts), with real processes standing in for the servers."""

from __future__ import annotations

import json
import sys

from streamrl.config import config_from_dict
from streamrl.fleet.supervisor import EngineSupervisor
from streamrl.placement import engine_gpu_ids, shared_engine_gpus

# A stand-in SGLang server: records when it started, serves /health after a short load.
SERVER = """
import http.server, json, sys, time
port, record = int(sys.argv[1]), sys.argv[2]
started = time.monotonic()
time.sleep(0.3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
with open(record, "w") as f:
    json.dump({"started": started, "ready": time.monotonic()}, f)
server.serve_forever()
"""


def _config(engine_gpus: list[int]):
    return config_from_dict(
        {
            "model": {"path": "/models/m"},
            "data": {"path": "prompts.jsonl"},
            "engine": {"backend": "sglang", "num_engines": 3, "mem_fraction_static": 0.25},
            "cluster": {"engine_gpus": engine_gpus, "learner_gpus": [2]},
        }
    )


def test_only_engines_on_a_gpu_an_earlier_engine_uses_are_marked_shared():
    assert shared_engine_gpus(engine_gpu_ids(3, 1, [0, 0, 1])) == [False, True, False]
    assert shared_engine_gpus(engine_gpu_ids(2, 2, [0, 1, 1, 2])) == [False, True]
    assert shared_engine_gpus(engine_gpu_ids(2, 1)) == [False, False]


def test_sglang_engines_sharing_a_gpu_start_after_the_one_before_serves(tmp_path):
    (tmp_path / "logs").mkdir()
    records = [tmp_path / f"engine-{index}.json" for index in range(3)]

    def argv(index: int, host: str, port: int):
        return [sys.executable, "-c", SERVER, str(port), str(records[index])], {}

    supervisor = EngineSupervisor(_config([0, 0, 1]), run_dir=tmp_path, engine_argv=argv)
    try:
        supervisor.spawn()
        assert [e.process is not None for e in supervisor.engines] == [True, False, True]
        supervisor.wait_serving()
        times = [json.loads(record.read_text()) for record in records]
    finally:
        supervisor.stop()
    assert times[1]["started"] >= times[0]["ready"]  # engine 1 waited for engine 0
    assert times[2]["started"] < times[0]["ready"]  # engine 2 (GPU 1) did not
