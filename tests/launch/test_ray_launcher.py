"""`cluster.launcher = "ray"`: bundles from a config, the ProcessHost actor on a real local Ray
instance, and `streamrl run` end to end with engines and rollout placed by Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import wait_until
from run_helpers import (
    FLEET,
    check_finished_run,
    config,
    engine_zero,
    events,
    is_gone,
    start_run,
    step_records,
    streamrl_run,
    wait_for,
    write_config,
)

from streamrl.config import ConfigError

ray = pytest.importorskip("ray")

from streamrl.launch.placement import (  # noqa: E402 - after the skip
    engines_use_gpus,
    gpus_for_own_instance,
    placement_bundles,
)
from streamrl.launch.ray.hosts import LOST_EXIT_CODE, ProcessHost, RayProcess  # noqa: E402

# One xdist group for every module that starts Ray (tests/conftest.py says why).
pytestmark = [pytest.mark.timeout(150), pytest.mark.xdist_group("ray")]

RAY = '[cluster]\nlauncher = "ray"\n'


def ray_daemon_pids() -> set[int]:
    """Pids of Ray's per-node daemons (raylet, GCS) on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "/raylet" in cmdline.split("\0")[0] or "gcs_server" in cmdline.split("\0")[0]:
            pids.add(int(entry.name))
    return pids


def placed_pids(placed: dict) -> list[int]:
    """Every process a Ray run placed (its `ray.json`) and the actors that host them."""
    pids = [process["pid"] for process in placed["processes"].values()]
    return pids + [node["actor_pid"] for node in placed["nodes"].values()]


def wait_all_gone(pids: list[int], *, timeout_s: float, daemons_before: set[int] | None = None):
    """Wait until every pid is gone and, given the Ray daemons from before the run, until the
    run's own Ray instance has stopped too."""
    wait_until(
        lambda: all(is_gone(pid) for pid in pids),
        what="every placed process to be gone",
        timeout_s=timeout_s,
    )
    if daemons_before is not None:
        wait_until(
            lambda: ray_daemon_pids() <= daemons_before,
            what="the run's Ray instance to stop",
            timeout_s=60,
        )


# ---------------------------------------------------------------- placement and config


def test_each_engine_gets_a_bundle_of_tp_size_gpus_and_the_rollout_one_cpu():
    cfg = config(
        model={"path": "/models/qwen"},
        engine={"backend": "sglang", "num_engines": 2, "tp_size": 4},
        cluster={"launcher": "ray"},
    )
    assert engines_use_gpus(cfg, cluster_has_gpus=False)  # SGLang always runs on GPUs
    assert placement_bundles(cfg, engines_on_gpu=True) == {
        "engine-0": {"GPU": 4.0, "CPU": 1.0},
        "engine-1": {"GPU": 4.0, "CPU": 1.0},
        "rollout": {"CPU": 1.0},
    }


def test_cpu_engines_take_one_cpu_and_attached_engines_take_no_bundle():
    auto = config(engine={"num_engines": 3}, cluster={"launcher": "ray"})
    assert not engines_use_gpus(auto, cluster_has_gpus=False)
    assert engines_use_gpus(auto, cluster_has_gpus=True)
    cpu = config(engine={"device": "cpu"}, cluster={"launcher": "ray"})
    assert not engines_use_gpus(cpu, cluster_has_gpus=True)
    assert placement_bundles(auto, engines_on_gpu=False) == {
        "engine-0": {"CPU": 1.0},
        "engine-1": {"CPU": 1.0},
        "engine-2": {"CPU": 1.0},
        "rollout": {"CPU": 1.0},
    }
    attached = config(engine={"urls": ["http://10.0.0.2:30000"]}, cluster={"launcher": "ray"})
    assert placement_bundles(attached, engines_on_gpu=True) == {"rollout": {"CPU": 1.0}}


@pytest.mark.parametrize(
    ("cluster", "weights", "key"),
    [
        ({"launcher": "slurm"}, {}, "cluster.launcher"),
        ({"launcher": "ray", "ray_placement_strategy": "EVENLY"}, {}, "ray_placement_strategy"),
        ({"launcher": "ray", "engine_gpus": [1]}, {}, "cluster.engine_gpus"),
        ({"launcher": "ray"}, {"transport": "ipc"}, "weights.transport = 'ipc'"),
    ],
)
def test_bad_ray_settings_are_refused_naming_the_key(cluster, weights, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(cluster=cluster, weights=weights)


@pytest.mark.parametrize(
    ("visible", "learner", "expected"),
    [(None, [0], "1,2,3"), ("4,5,6,7", [1], "4,6,7"), (None, [0, 1], "1,2,3")],
)
def test_a_ray_instance_of_the_runs_own_is_not_given_learner_rank_0s_gpu(
    monkeypatch, visible, learner, expected
):
    import torch  # stand-in device counts: this machine has no GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = config(cluster={"launcher": "ray", "learner_gpus": learner},
                 learner={"num_gpus": len(learner), "backend": "megatron"})  # fmt: skip
    assert gpus_for_own_instance(cfg) == expected  # ranks > 0 take GPUs Ray gives them
    assert gpus_for_own_instance(config(cluster={"launcher": "ray"},
                                        learner={"device": "cpu"})) is None  # fmt: skip


def test_auto_weights_use_nccl_between_gpus_that_ray_assigns():
    cfg = config(cluster={"launcher": "ray"})
    assert cfg.weight_transport("cuda") == "nccl"
    assert cfg.weight_transport("cpu") == "gloo"


def test_a_ray_run_without_ray_installed_names_the_install_command(tmp_path):
    config_path = write_config(tmp_path, steps=1, extra=RAY)
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from streamrl.cli import main; "
        f"main(['run', {str(config_path)!r}])"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_ray], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "pip install 'streamrl[ray]'" in result.stderr
    assert "cluster.launcher" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started


# ---------------------------------------------------------------- streamrl run


@pytest.mark.slow
def test_a_rollout_that_dies_under_ray_fails_the_run_with_its_log_and_no_orphans(tmp_path):
    config_path = write_config(tmp_path, steps=2, extra=RAY)
    # A generate function that does not import is an error a restart would repeat (it stops
    # the run at once, tests/runs/test_run_failures.py); this one takes the process down instead.
    # One restart under Ray, not the default three: each is another rollout process to start.
    generate = "tests.e2e_generate:exits_the_process"
    result = streamrl_run(config_path, "--set", f"rollout.generate_fn={generate}",
                          "--set", "rollout.max_restarts=1")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rollout (Ray node" in result.stderr and "exited with code" in result.stderr
    assert "(after 1 restarts, rollout.max_restarts)" in result.stderr
    assert "the rollout process ends here" in result.stderr  # the tail of its log
    placed = json.loads((tmp_path / "out" / "ray.json").read_text())
    wait_all_gone(placed_pids(placed), timeout_s=10)


@pytest.mark.slow
def test_sigterm_stops_a_ray_run_and_every_placed_process(tmp_path):
    """ray.init installs its own SIGTERM handler; the launcher's must win, so that the run
    stops its actors, placement group and Ray instance on the way out. The placed processes
    run at the trainer's niceness (Ray's default for workers is 15: on a busy machine they
    starve, and stopping them takes longer)."""
    daemons_before = ray_daemon_pids()
    out = tmp_path / "out"
    process = start_run(write_config(tmp_path, steps=50, extra=RAY))
    try:
        wait_for(lambda: len(step_records(out)) >= 1, process, "the first step")
        running = placed_pids(json.loads((out / "ray.json").read_text()))
        trainer_niceness = os.getpriority(os.PRIO_PROCESS, process.pid)
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in running] == [
            trainer_niceness
        ] * len(running)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            tail = process.stderr.read()[-6000:]
            pytest.fail(f"the run was still going 60 s after SIGTERM; its stderr ends:\n{tail}")
        assert code == 130
    finally:
        process.kill()
    assert "interrupted; every process stopped" in process.stderr.read()
    placed = json.loads((out / "ray.json").read_text())
    wait_all_gone(placed_pids(placed), timeout_s=10, daemons_before=daemons_before)


@pytest.mark.slow
def test_a_ray_run_places_engines_and_rollout_in_actors_restarts_a_killed_engine_and_leaves_nothing(
    tmp_path,
):
    """Two engines behind a router, each in its own actor; engine 0 is killed after the first
    step. (One run serves both the plain end-to-end checks and the restart: CI has 2 cores.)"""
    daemons_before = ray_daemon_pids()
    steps = 5
    config_path = write_config(tmp_path, steps=steps, eta=1, extra=RAY)
    config_path.write_text(
        config_path.read_text().replace(
            "[engine]\nnum_threads = 1\nmax_batch_size = 16\nmax_seq_len = 256\n",
            FLEET.format(timeout=5.0),
        )
    )
    out = tmp_path / "out"
    process = start_run(config_path)
    try:
        wait_for(lambda: len(step_records(out)) >= 1, process, "the first step")
        victim = engine_zero(out)
        os.kill(victim["pid"], signal.SIGKILL)
        summary = check_finished_run(process, out, steps)
    finally:
        process.kill()
    assert summary["engine_restarts"][victim["url"]] == 1
    assert (victim["url"], "down", "exited") in [
        (e.get("engine"), e["event"], e.get("reason")) for e in events(out)
    ]
    # The engine's restart must not take the rollout process with it (it once did: the
    # snapshot's abort met the restarting engine's 503).
    rollout_deaths = [e for e in events(out) if e["event"] == "rollout_restarted"]
    assert not rollout_deaths, rollout_deaths[0]["log_tail"]
    assert set(summary["engine_versions"].values()) == {steps}

    engines = json.loads((out / "engines.json").read_text())
    placed = json.loads((out / "ray.json").read_text())
    assert engines["launcher"] == "ray"
    assert placed["own_instance"] and placed["strategy"] == "PACK"
    assert placed["bundles"] == {
        "engine-0": {"CPU": 1.0},
        "engine-1": {"CPU": 1.0},
        "rollout": {"CPU": 1.0},
    }
    for index, engine in enumerate(engines["engines"]):
        name = f"engine-{index}"
        assert engine["pid"] == placed["processes"][name]["pid"]
        assert engine["node_id"] == placed["nodes"][name]["node_id"]
        assert engine["url"].startswith(f"http://{engine['node_ip']}:")
        assert (out / "logs" / f"{name}.log").exists()
    assert (out / "logs" / "rollout.log").exists()
    assert engines["router"].startswith("http://") and "127.0.0.1" not in engines["router"]
    restarted = engines["engines"][0]
    assert restarted["pid"] != victim["pid"]  # a new process ...
    assert restarted["actor_pid"] == victim["actor_pid"]  # ... started by the same actor

    pids = [*placed_pids(placed), victim["pid"]]
    assert len(pids) == 7
    wait_all_gone(pids, timeout_s=10, daemons_before=daemons_before)


@pytest.mark.slow
def test_spread_places_engine_and_rollout_on_different_ray_nodes(tmp_path):
    from ray.cluster_utils import Cluster

    # No dashboard web server: half the CPU of the start, no fixed port (8265) to collide on.
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=2)  # room for both bundles: PACK would share a node
        cluster.wait_for_nodes()
        extra = RAY + f'ray_address = "{cluster.address}"\nray_placement_strategy = "SPREAD"\n'
        result = streamrl_run(write_config(tmp_path, steps=2, extra=extra), timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        placed = json.loads((tmp_path / "out" / "ray.json").read_text())
        assert not placed["own_instance"]
        nodes = {name: node["node_id"] for name, node in placed["nodes"].items()}
        assert nodes["engine-0"] != nodes["rollout"]
        wait_all_gone(placed_pids(placed), timeout_s=30)
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------- the ProcessHost actor


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance in this process for the ProcessHost tests, the last of the module (a
    start is 3 s of CPU)."""
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def start_host(tmp_path: Path, code: str) -> RayProcess:
    host = ray.remote(ProcessHost).options(num_cpus=0).remote("probe")
    node = ray.get(host.node.remote())
    log_path = tmp_path / "probe.log"
    pid = ray.get(host.start.remote([sys.executable, "-c", code], {}, str(log_path), str(tmp_path)))
    return RayProcess("probe", host, pid, node, log_path)


def test_a_process_host_reports_exit_code_and_log_tail_and_stop_leaves_no_process(
    local_ray, tmp_path
):
    short = start_host(tmp_path, "print('hello from the node'); raise SystemExit(3)")
    assert short.wait() == 3
    assert short.poll() == 3 and not short.is_alive()
    assert "hello from the node" in short.log_tail()
    assert short.placement["node_ip"] == ray.util.get_node_ip_address()

    long = start_host(tmp_path, "import time; print('up', flush=True); time.sleep(600)")
    assert long.is_alive()
    wait_until(lambda: "up" in long.log_tail(), what="the child's first line")
    assert long.stop(timeout_s=5.0) == -signal.SIGTERM
    assert is_gone(long.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        start_host(tmp_path, "import time; time.sleep(600)").wait(timeout_s=0.2)


def test_a_killed_actor_takes_its_process_with_it(local_ray, tmp_path):
    process = start_host(tmp_path, "import time; time.sleep(600)")
    actor_pid = process.placement["actor_pid"]
    ray.kill(process._host)
    wait_until(lambda: is_gone(process.pid), what="the child of the killed actor to exit")
    # Ray's worker may end its children before it exits itself: the actor can outlive the
    # child by a moment (seen in CI), so wait for it too.
    wait_until(lambda: is_gone(actor_pid), what="the killed actor's process to exit")
    assert process.poll() == LOST_EXIT_CODE
    assert "out of reach" in process.log_tail()
