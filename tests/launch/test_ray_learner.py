"""Megatron learner ranks placed by Ray: bundles and rank order from a config, placement on a
simulated multi-node cluster (`ray.cluster_utils.Cluster`, several raylets on this machine),
and `streamrl run` at DP 2 with one rank per node: completion, a killed rank, a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from engine_helpers import wait_until
from run_helpers import (
    check_finished_run,
    config,
    events,
    is_gone,
    start_run,
    step_records,
    streamrl_run,
    wait_for,
    write_config,
)

from streamrl.launch.placement import (
    learner_bundles,
    num_pinned_ranks,
    num_placed_ranks,
    rank_order,
    split_tp_groups,
)

ray = pytest.importorskip("ray")

# One xdist group for every module that starts Ray (tests/conftest.py says why).
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("ray")]

WORKTREE = Path(__file__).resolve().parents[2]

DP2_ON_RAY = """
[cluster]
launcher = "ray"
ray_address = "{address}"
ray_engine_resources = {{engine_node = 1}}
ray_learner_resources = {{learner_node = 1}}
"""
"""Engines on the node with `engine_node`, learner ranks > 0 on nodes with `learner_node`
(rank 0 is `streamrl run`, on the head node it connects to); `launcher = "local"` runs the
same file on one machine, the `ray_*` keys unread."""


def megatron_dp2_config(tmp_path: Path, address: str, *, steps: int, save_interval: int = 0):
    path = write_config(
        tmp_path, steps=steps, eta=1, save_interval=save_interval,
        extra=DP2_ON_RAY.format(address=address), megatron="",
    )  # fmt: skip
    return path


NO_DASHBOARD = {"include_dashboard": False}
"""A test cluster's head without the dashboard's web server, which the tests do not read: it
doubles the CPU of a two-node start (5.0-5.2 s against 2.3), and its port (8265) is the
machine's: a head fails to start while another Ray instance holds it. (Ray still starts a
minimal dashboard process, which binds no such port.)"""

WORKER_ENV = {"NCCL_SOCKET_IFNAME": "streamrl-test0"}
"""Set at the worker's `ray start` (what the runbook says to do on each node); gloo ignores it."""


class TwoNodes:
    """A simulated two-node cluster. Head: the driver (rank 0), the engine and the rollout;
    worker: learner rank 1 (resource `learner_node`, environment `WORKER_ENV`)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"engine_node": 2}, **NO_DASHBOARD})  # fmt: skip
        self.worker = self._add_worker()

    @property
    def address(self) -> str:
        return self.cluster.address

    def _add_worker(self):
        worker = self.cluster.add_node(
            num_cpus=1, resources={"learner_node": 1}, env_vars=WORKER_ENV
        )
        self.cluster.wait_for_nodes()
        return worker

    def replace_worker(self) -> None:
        """The worker node removed and a new one of the same shape added in its place."""
        self.cluster.remove_node(self.worker)
        self.worker = self._add_worker()


@pytest.fixture(scope="module")
def two_nodes():
    """One two-node cluster for the module's runs on Ray (each run leaves it as it found it:
    the test checks that every placed process is gone), started once."""
    nodes = TwoNodes()
    try:
        yield nodes
    finally:
        nodes.cluster.shutdown()


def rank_nodes(out: Path) -> list[dict]:
    """The last `ranks_started` event: each rank's pid and Ray node."""
    started = [e for e in events(out) if e.get("event") == "ranks_started"]
    return started[-1]["ranks"]


def streamrl_processes(marker: str) -> list[str]:
    """Command lines on this machine that mention `marker` (the test's tmp dir)."""
    lines = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True)
    return [line for line in lines.stdout.splitlines() if marker in line and "ps -ww" not in line]


def placed_pids(out: Path) -> list[int]:
    placed = json.loads((out / "ray.json").read_text())
    pids = [p["pid"] for p in placed["processes"].values()]
    return pids + [n["actor_pid"] for n in placed["nodes"].values()]


# ---------------------------------------------------------------- bundles and rank order


def test_each_learner_rank_after_the_first_gets_a_bundle_with_the_configured_cpus_and_resources():
    cfg = config(
        learner={"backend": "megatron", "num_gpus": 4, "megatron": {"tensor_parallel_size": 2}},
        cluster={
            "launcher": "ray",
            "ray_learner_cpus_per_rank": 3,
            "ray_learner_resources": {"learner_node": 1},
        },
    )
    assert num_placed_ranks(cfg) == 3  # rank 0 is streamrl run itself
    assert learner_bundles(cfg, on_gpu=True) == [
        {"GPU": 1.0, "CPU": 3.0, "learner_node": 1.0} for _ in range(3)
    ]
    assert learner_bundles(cfg, on_gpu=False) == [{"CPU": 3.0, "learner_node": 1.0}] * 3
    assert num_pinned_ranks(cfg) == 1  # rank 1 shares rank 0's TP group, so its node
    torch_learner = config(cluster={"launcher": "ray"})
    assert learner_bundles(torch_learner, on_gpu=True) == []
    debug = config(
        learner={"backend": "megatron", "num_gpus": 2},
        train={"mode": "rollout_only"},
        cluster={"launcher": "ray"},
    )
    assert learner_bundles(debug, on_gpu=True) == []  # no learner model, no ranks


def test_ranks_are_numbered_node_by_node_with_the_drivers_node_first():
    # bundles 0..4 landed on nodes b, a, b, c, a; the driver (rank 0) is on a
    order = rank_order(["b", "a", "b", "c", "a"], driver_node="a")
    assert order == [1, 4, 0, 2, 3]  # ranks 1, 2 on a; 3, 4 on b; 5 on c
    nodes = ["a"] + [["b", "a", "b", "c", "a"][index] for index in order]
    assert nodes == ["a", "a", "a", "b", "b", "c"]
    assert split_tp_groups(nodes, tp_size=3) == ["ranks 3-5 are on nodes ['b', 'c']"]
    assert split_tp_groups(nodes, tp_size=1) == []
    assert split_tp_groups(["a", "a", "b", "b"], tp_size=2) == []


@pytest.mark.slow
def test_ray_keeps_each_tensor_parallel_group_on_one_node_or_refuses_the_placement(tmp_path):
    """TP 2 x DP 2 over three nodes: rank 1 joins rank 0 (the driver) on the head node, ranks
    2-3 share a node; STRICT_SPREAD splits ranks 2-3 and is refused naming them. (SPREAD is
    best effort: Ray sometimes keeps 2-3 together, so it cannot be the case that must fail.)"""
    from ray.cluster_utils import Cluster

    from streamrl.launch.ray.spawner import RayLaunchError, RaySpawner

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **NO_DASHBOARD})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        for strategy in ("PACK", "STRICT_SPREAD"):
            cfg = config(
                learner={
                    "backend": "megatron",
                    "num_gpus": 4,
                    "device": "cpu",
                    "megatron": {"tensor_parallel_size": 2},
                },
                engine={"device": "cpu"},
                cluster={
                    "launcher": "ray",
                    "ray_address": cluster.address,
                    "ray_learner_placement_strategy": strategy,
                },
            )
            run_dir = tmp_path / strategy
            run_dir.mkdir()
            if strategy == "STRICT_SPREAD":
                with pytest.raises(RayLaunchError, match=r"ranks 2-3 are on nodes"):
                    RaySpawner.start(cfg, run_dir)
                continue
            spawner = RaySpawner.start(cfg, run_dir)
            try:
                nodes = [rank["node_id"] for rank in spawner.learner_ranks]
            finally:
                spawner.close()
            head = nodes[0]
            assert nodes[1] == head and nodes[2] == nodes[3] != head
            recorded = json.loads((run_dir / "ray.json").read_text())
            assert [r["node_id"] for r in recorded["learner_ranks"]] == nodes
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------- streamrl run


@pytest.mark.slow
def test_megatron_at_dp2_trains_with_one_rank_on_each_of_two_ray_nodes(two_nodes, tmp_path):
    out = tmp_path / "out"
    steps = 3
    process = start_run(megatron_dp2_config(tmp_path, two_nodes.address, steps=steps))
    try:
        wait_for(lambda: len(step_records(out)) >= 1, process, "the first step")
        environ = Path(f"/proc/{rank_nodes(out)[1]['pid']}/environ").read_bytes().split(b"\0")
        summary = check_finished_run(process, out, steps)
    finally:
        process.kill()
    assert set(summary["engine_versions"].values()) == {steps}
    ranks = rank_nodes(out)
    print("learner ranks:", json.dumps(ranks))
    print("summary:", {k: summary[k] for k in ("steps", "accounting_ok", "engine_versions")})
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["node_id"] != ranks[1]["node_id"]
    placed = json.loads((out / "ray.json").read_text())
    assert placed["learner_ranks"][1]["node_id"] == ranks[1]["node_id"]
    assert placed["nodes"]["engine-0"]["node_id"] == ranks[0]["node_id"]  # engine_node
    assert placed["learner_bundles"] == [{"CPU": 1.0, "learner_node": 1.0}]
    # The rank's environment is its node's (set at `ray start`), plus its own place.
    assert b"NCCL_SOCKET_IFNAME=streamrl-test0" in environ
    assert f"STREAMRL_NODE_IP={ranks[1]['node_ip']}".encode() in environ
    assert b"RANK=1" in environ and b"WORLD_SIZE=2" in environ
    rank1_log = (out / "logs" / "learner-rank1.log").read_text()
    assert f"learner rank 1 of 2 joined {placed['driver']['node_ip']}:" in rank1_log
    assert f"(streamrl from {WORKTREE / 'streamrl'})" in rank1_log  # this checkout's code
    assert [r["train/grad_norm"] > 0 for r in step_records(out)] == [True] * steps
    wait_until(lambda: all(is_gone(pid) for pid in placed_pids(out)), what="placed processes")
    assert streamrl_processes(str(tmp_path)) == []


@pytest.mark.slow
def test_a_killed_learner_actor_stops_the_run_naming_its_node_and_a_resume_on_another_node_completes(
    two_nodes, tmp_path
):
    out = tmp_path / "out"
    steps = 4
    config_path = megatron_dp2_config(tmp_path, two_nodes.address, steps=steps, save_interval=1)
    process = start_run(config_path)
    try:
        wait_for(lambda: (out / "checkpoints" / "step_000001").exists(), process, "a ckpt")
        placed = json.loads((out / "ray.json").read_text())
        victim = placed["nodes"]["learner-rank1"]
        os.kill(victim["actor_pid"], signal.SIGKILL)
        assert process.wait(timeout=120) == 1
        stderr = process.stderr.read()
    finally:
        process.kill()
    message = stderr[stderr.index("streamrl: learner rank 1") :]
    print(message.split("Last lines")[0])
    assert f"Ray node {victim['node_id']} at {victim['node_ip']}" in message
    latest = sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1]
    assert f"The last checkpoint is {out / 'checkpoints' / latest} (step " in message
    assert "--resume" in message
    assert "Traceback" not in stderr
    wait_until(lambda: all(is_gone(pid) for pid in placed_pids(out)), what="placed processes")
    assert streamrl_processes(str(tmp_path)) == []

    two_nodes.replace_worker()  # the resume lands on a node the first run never saw
    result = streamrl_run(config_path, "--resume", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["steps"] == steps
    assert set(summary["engine_versions"].values()) == {steps}
    ranks = rank_nodes(out)
    print("resumed:", json.dumps(ranks), {k: summary[k] for k in ("steps", "accounting_ok")})
    assert ranks[1]["node_id"] not in (victim["node_id"], ranks[0]["node_id"])
    resumed = [r["step"] for r in step_records(out)]
    assert resumed[-1] == steps and int(latest.removeprefix("step_")) + 1 in resumed
    wait_until(lambda: all(is_gone(pid) for pid in placed_pids(out)), what="placed processes")
    assert streamrl_processes(str(tmp_path)) == []


@pytest.mark.slow
def test_the_same_dp2_config_runs_with_the_local_launcher_changing_only_that_key(tmp_path):
    """The ray_* keys (a cluster address that nothing answers, custom resources) go unread."""
    config_path = megatron_dp2_config(tmp_path, "10.0.0.1:6379", steps=2)
    result = streamrl_run(config_path, "--set", "cluster.launcher=local")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and set(summary["engine_versions"].values()) == {2}
    assert not (out / "ray.json").exists()
    assert [r["rank"] for r in rank_nodes(out)] == [0, 1]
    assert (
        "learner rank 1 of 2 joined 127.0.0.1:" in (out / "logs" / "learner-rank1.log").read_text()
    )
