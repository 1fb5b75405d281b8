"""`cluster.launcher = "ray"`: engines, the rollout process and learner ranks placed by Ray.

    streamrl run (this process: learner rank 0, buffer, publisher, engine fleet, router)
      │  ray.init(cluster.ray_address), or a Ray instance of its own for the run
      │  learner placement group (Megatron, learner.num_gpus = N > 1), strategy
      │  cluster.ray_learner_placement_strategy: one bundle per rank 1..N-1,
      │    {"GPU": 1, "CPU": k} (or {"CPU": k} on CPU); ranks 1..TP-1 on this node
      │  engine placement group, strategy cluster.ray_placement_strategy:
      │    bundle i < num_engines   {"GPU": engine.tp_size, "CPU": 1}  (or {"CPU": 1} on CPU)
      │    last bundle              {"CPU": 1}
      ├── ProcessHost "learner-rankR" ──► `streamrl _learner`, rank R, on its node
      ├── ProcessHost "engine-i" in bundle i ──► `streamrl engine serve` / SGLang, on its node
      └── ProcessHost "rollout" in the last ──► `streamrl _rollout`, on its node

Learner ranks are numbered node by node once Ray has placed their bundles (this
node first: `streamrl.launch.placement.rank_order`), so each tensor-parallel group
is on one node and data and pipeline parallelism span nodes; a placement that
splits a TP group is refused. Their rendezvous master is rank 0: this node's IP
and a port free here.

A `ProcessHost` is a small async actor that runs one component as its child
process: the same argv as the local launcher, with `CUDA_VISIBLE_DEVICES` set
to the GPUs Ray gave the actor, the driver's working directory, and its log at
the same path on its own node. `RayProcess` is the driver's handle to it, with
`ChildProcess`'s interface, so `EngineSupervisor` and the launcher drive both alike.
An engine binds its node's IP on a port free there (chosen by its actor);
the buffer, the router and the weight-update master bind this machine's IP
instead of loopback (`RaySpawner.reachable`).

`RaySpawner.close` stops every child (all at once, bounded), kills the actors, removes
the placement groups from a cluster and disconnects; a Ray instance the run started is
shut down with it, and what it placed here is killed by pid if it outlives that.
Ray is imported in this package only (and by tests): nothing below the launcher knows it.
`hosts` holds the actor and the driver's handle to it, `spawner` the connection, the
placement groups and the `Spawner` the trainer uses.
"""
