"""The run's Ray side: the connection, the placement groups, one `ProcessHost` per
component, and the `Spawner` interface the trainer and the engine supervisor use
(see `streamrl.launch.ray` for the picture)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from streamrl.config import ConfigError, RunConfig
from streamrl.launch.placement import (
    engines_use_gpus,
    environ_set,
    gpus_for_own_instance,
    learner_bundles,
    learner_on_gpu,
    num_pinned_ranks,
    placement_bundles,
    rank_order,
    split_tp_groups,
)
from streamrl.launch.ray.hosts import (
    CALL_TIMEOUT_S,
    REPLY_MARGIN_S,
    STOP_TIMEOUT_S,
    ProcessHost,
    RayProcess,
    kill_survivors,
    start_time,
)
from streamrl.mains.errors import RunError

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LEFTOVER_GRACE_S = 5.0
"""How long after `ray.shutdown` a process the run placed on this machine may take to exit
(actors exit with their raylet, components with their actor) before it is killed."""


class RayUnavailable(ConfigError):
    """`cluster.launcher = "ray"` but Ray cannot be imported."""


class RayLaunchError(RunError):
    """Ray could not place or start the run's components; the message says what was asked."""


def require_ray():
    """The `ray` module, or RayUnavailable naming the install command."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"cluster.launcher = 'ray' needs Ray, which cannot be imported in {sys.executable} "
            f"({exc}): pip install 'streamrl[ray]'"
        ) from None
    return ray


# ---------------------------------------------------------------- the spawner


class RaySpawner:
    """The run's Ray side: connection, placement group, one ProcessHost per component.

    Build it with `RaySpawner.start(cfg, run_dir)`; `close()` undoes all of it."""

    name = "ray"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.is_own_instance = False
        self.placement_group = None
        self.learner_group = None
        self.learner_bundles: list[dict[str, float]] = []
        self.driver: dict[str, Any] = {}
        """This process's node (learner rank 0's): node id and IP, pid."""
        self.hosts: dict[str, Any] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.processes: dict[str, dict[str, Any]] = {}
        self.bundles: dict[str, dict[str, float]] = {}
        self.strategy = ""
        self.local_processes: dict[int, int] = {}
        """With an instance of the run's own: pid -> start time of every actor and component
        process on this machine, for `close` to kill what outlives `ray.shutdown`."""

    @classmethod
    def start(cls, cfg: RunConfig, run_dir: Path) -> RaySpawner:
        """Connect (or start Ray), reserve the placement group, start the actors."""
        spawner = cls(run_dir)
        try:
            spawner._connect(cfg)
            spawner._place(cfg)
        except BaseException:
            spawner.close()
            raise
        return spawner

    def _connect(self, cfg: RunConfig) -> None:
        ray = require_ray()
        address = cfg.cluster.ray_address
        self.is_own_instance = not address
        # ray.init installs its own SIGTERM handler; the launcher's must stay (Ctrl-C/TERM
        # end the run through KeyboardInterrupt and the cleanup around it).
        is_main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        if address:
            ray.init(address=address)
        else:
            needed = [
                *placement_bundles(cfg, engines_on_gpu=False).values(),
                *learner_bundles(cfg, on_gpu=False),
            ]
            num_cpus = int(sum(bundle["CPU"] for bundle in needed))
            # The raylet takes its GPUs from CUDA_VISIBLE_DEVICES when it starts: leave rank
            # 0's out (this process trains on it), or Ray could hand it to a rank or engine.
            # Its workers run at niceness 15 unless told otherwise; the engines and the rollout
            # they start must not yield the CPU to the learner 28 to 1 (weights 36 vs 1024),
            # or on a busy machine they crawl and even stopping them runs past its timeout.
            with (
                environ_set("CUDA_VISIBLE_DEVICES", gpus_for_own_instance(cfg)),
                environ_set("RAY_worker_niceness", "0"),
            ):
                ray.init(  # "local": a new instance even when RAY_ADDRESS names a cluster
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, num_cpus),
                    include_dashboard=False,
                )
        if is_main:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    def _place(self, cfg: RunConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.driver = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }
        self._place_learner(cfg)  # first: the learner is the part that cannot shrink
        total = ray.cluster_resources()
        on_gpu = engines_use_gpus(cfg, cluster_has_gpus=total.get("GPU", 0) > 0)
        self.bundles = placement_bundles(cfg, engines_on_gpu=on_gpu)
        self.strategy = cfg.cluster.ray_placement_strategy
        wanted_gpus = sum(bundle.get("GPU", 0) for bundle in self.bundles.values())
        if self.is_own_instance and wanted_gpus > total.get("GPU", 0):
            raise RayLaunchError(
                f"the engines need {wanted_gpus:g} GPUs (engine.num_engines x engine.tp_size) "
                f"and the Ray instance started here has {total.get('GPU', 0):g}; set "
                f"engine.device = 'cpu' or join a cluster with cluster.ray_address"
            )
        self.placement_group = placement_group(
            list(self.bundles.values()), strategy=self.strategy, name=f"streamrl-{os.getpid()}"
        )
        _wait_placed(
            self.placement_group,
            list(self.bundles.values()),
            f"{self.strategy} (cluster.ray_placement_strategy)",
            cfg.engine.startup_timeout_s,
        )
        hosts = _start_hosts(self.placement_group, list(self.bundles.values()), list(self.bundles))
        found = ray.get([host.node.remote() for host in hosts], timeout=600)
        for node in found:
            self._remember_local(node["actor_pid"])
        self.hosts.update(zip(self.bundles, hosts, strict=True))
        self.nodes.update(zip(self.bundles, found, strict=True))
        self._record()

    def _place_learner(self, cfg: RunConfig) -> None:
        """Learner ranks 1..N-1: one bundle each, ranks 1..TP-1 on this node; the hosts are
        named `learner-rankR` in rank order (`rank_order`). RayLaunchError when a
        tensor-parallel group would span nodes."""
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        self.learner_bundles = learner_bundles(cfg, on_gpu=learner_on_gpu(cfg))
        if not self.learner_bundles:
            return
        wanted_gpus = sum(bundle.get("GPU", 0) for bundle in self.learner_bundles)
        has_gpus = ray.cluster_resources().get("GPU", 0)
        if self.is_own_instance and wanted_gpus > has_gpus:
            raise RayLaunchError(
                f"learner ranks 1..{len(self.learner_bundles)} need {wanted_gpus:g} GPUs "
                f"(learner.num_gpus - 1: rank 0 is this process, on its own GPU) and the Ray "
                f"instance started here has {has_gpus:g}; join a cluster with "
                f"cluster.ray_address"
            )
        pinned = num_pinned_ranks(cfg)
        selectors = [
            {NODE_ID_LABEL_KEY: self.driver["node_id"]} if index < pinned else {}
            for index in range(len(self.learner_bundles))
        ]
        strategy = cfg.cluster.ray_learner_placement_strategy
        self.learner_group = placement_group(
            self.learner_bundles,
            strategy=strategy,
            name=f"streamrl-learner-{os.getpid()}",
            bundle_label_selector=selectors if pinned else None,
        )
        _wait_placed(
            self.learner_group,
            self.learner_bundles,
            f"{strategy} (cluster.ray_learner_placement_strategy; ranks 1..{pinned} on the "
            f"node of streamrl run, {self.driver['node_ip']})"
            if pinned
            else f"{strategy} (cluster.ray_learner_placement_strategy)",
            cfg.engine.startup_timeout_s,
        )
        names = [f"learner-bundle{index}" for index in range(len(self.learner_bundles))]
        hosts = _start_hosts(self.learner_group, self.learner_bundles, names)
        found = ray.get([host.node.remote() for host in hosts], timeout=600)
        for node in found:
            self._remember_local(node["actor_pid"])
        order = rank_order([node["node_id"] for node in found], self.driver["node_id"])
        for rank, index in enumerate(order, start=1):
            self.hosts[f"learner-rank{rank}"] = hosts[index]
            self.nodes[f"learner-rank{rank}"] = {**found[index], "bundle": index}
        rank_nodes = [self.driver["node_id"]]
        rank_nodes += [found[index]["node_id"] for index in order]
        problems = split_tp_groups(rank_nodes, cfg.learner.megatron.tensor_parallel_size)
        self._record()
        if problems:
            raise RayLaunchError(
                f"Ray placed learner ranks so that a tensor-parallel group (learner.megatron."
                f"tensor_parallel_size = {cfg.learner.megatron.tensor_parallel_size}) spans "
                f"nodes: {'; '.join(problems)}. Give each node a multiple of TP learner GPUs "
                f"(ray start --num-gpus), or set cluster.ray_learner_placement_strategy = "
                f"'STRICT_PACK' when the learner fits one node"
            )
        for rank, node in enumerate(rank_nodes):
            log.info("learner rank %d on Ray node %s", rank, node)

    @property
    def learner_ranks(self) -> list[dict[str, Any]]:
        """Rank r's node (id, IP), in rank order; rank 0 is this process."""
        placed = [
            self.nodes[f"learner-rank{rank}"] for rank in range(1, len(self.learner_bundles) + 1)
        ]
        ranks = [{"node_id": self.driver["node_id"], "node_ip": self.driver["node_ip"]}]
        ranks += [{"node_id": node["node_id"], "node_ip": node["node_ip"]} for node in placed]
        return [{"rank": rank, **node} for rank, node in enumerate(ranks)]

    def _record(self) -> None:
        """`run_dir/ray.json`: strategy, bundles, and where each component's process runs."""
        state = {
            "strategy": self.strategy,
            "own_instance": self.is_own_instance,
            "driver": self.driver,
            "bundles": self.bundles,
            "learner_bundles": self.learner_bundles,
            "learner_ranks": self.learner_ranks if self.learner_bundles else [],
            "nodes": self.nodes,
            "processes": self.processes,
        }
        (self.run_dir / "ray.json").write_text(json.dumps(state, indent=2) + "\n")

    def _remember_local(self, pid: int) -> None:
        """Keep `pid` for `close` when this run's own Ray instance placed it (on this machine)."""
        started = start_time(pid) if self.is_own_instance else None
        if started is not None:
            self.local_processes[pid] = started

    # ---------------------------------------------------------------- Spawner

    def placement_here(self) -> dict[str, Any]:
        """This process's Ray node (learner rank 0's), as `RayProcess.placement` gives it."""
        return {"node_id": self.driver["node_id"], "node_ip": self.driver["node_ip"]}

    def reachable(self, host: str) -> str:
        """This machine's IP in place of a loopback address (other nodes cannot reach that)."""
        import ray

        return ray.util.get_node_ip_address() if host in LOOPBACK else host

    def address(self, name: str, host: str) -> tuple[str, int]:
        """The node IP of `name`'s actor and a port free there (`host` is for local runs)."""
        import ray

        port = ray.get(self.hosts[name].free_port.remote(), timeout=CALL_TIMEOUT_S)
        return self.nodes[name]["node_ip"], port

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RayProcess:
        import ray

        log_path = log_path.absolute() if log_path is not None else None
        node = self.nodes[name]
        try:
            pid = ray.get(
                self.hosts[name].start.remote(
                    list(argv), dict(env or {}), str(log_path) if log_path else None, os.getcwd()
                ),
                timeout=CALL_TIMEOUT_S,
            )
        except ray.exceptions.RayActorError as exc:
            raise RayLaunchError(
                f"cannot start {name}: its Ray actor on node {node['node_ip']} is gone ({exc})"
            ) from None
        self.processes[name] = {"pid": pid, "node_id": node["node_id"], "node_ip": node["node_ip"]}
        self._remember_local(pid)
        self._record()
        return RayProcess(name, self.hosts[name], pid, node, log_path)

    def close(self) -> None:
        """Stop every child, kill the actors, remove the placement groups, disconnect (and shut
        down a Ray instance this run started). Safe to call twice and after partial starts.

        Bounded: the children are stopped all at once (SIGKILL STOP_TIMEOUT_S after SIGTERM),
        actors that have not answered REPLY_MARGIN_S later are killed with their children;
        with an instance of the run's own, whatever it placed on this machine and is still
        alive LEFTOVER_GRACE_S after `ray.shutdown` is killed by pid."""
        ray = require_ray()
        if not ray.is_initialized():
            return
        hosts = list(self.hosts.values())
        self.hosts.clear()
        stops = [host.stop.remote(STOP_TIMEOUT_S) for host in hosts]
        ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S + REPLY_MARGIN_S)
        for host in hosts:
            with contextlib.suppress(ray.exceptions.RayError):  # already gone
                ray.kill(host)
        if not self.is_own_instance:  # the cluster outlives the run: give its resources back
            from ray.util.placement_group import remove_placement_group

            for group in (self.placement_group, self.learner_group):
                if group is not None:
                    remove_placement_group(group)
        self.placement_group = self.learner_group = None
        ray.shutdown()
        killed = kill_survivors(self.local_processes, grace_s=LEFTOVER_GRACE_S)
        self.local_processes.clear()
        if killed:
            log.warning("killed %d placed processes still alive after Ray shut down: pids %s",
                        len(killed), killed)  # fmt: skip


def _wait_placed(group, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> None:
    """Wait until Ray has reserved `group`; RayLaunchError with what was asked and what is free."""
    import ray

    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RayLaunchError(
            f"Ray could not place the bundles {bundles} with strategy {strategy} within "
            f"{timeout_s:.0f} s (engine.startup_timeout_s); the cluster has "
            f"{ray.cluster_resources()}, of which {ray.available_resources()} is free"
        ) from None


def _start_hosts(group, bundles: list[dict[str, float]], names: list[str]) -> list:
    """One ProcessHost actor in each bundle of `group` (not restarted: a lost one fails its
    component, which is then the supervisor's or the trainer's to handle)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(ProcessHost)
    return [
        actor.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            ),
        ).remote(name)
        for index, (name, bundle) in enumerate(zip(names, bundles, strict=True))
    ]
