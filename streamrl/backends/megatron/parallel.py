"""Process groups: torch.distributed plus Megatron's parallel_state, on gloo or NCCL.

Contract with `launch.py`: before `MegatronBackend` is built, every rank has
called `torch.distributed.init_process_group` (gloo on CPU, NCCL on CUDA, with
`torch.cuda.set_device(local_rank)` done first on CUDA). `initialize_parallel`
then carves the world into tensor (TP), pipeline (PP) and data (DP) parallel
groups with Megatron's default order `tp-cp-ep-dp-pp`: TP ranks are adjacent
(rank = tp + TP * (dp + DP * pp)).

`Layout` answers "who am I" without importing parallel_state elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the (tp, dp, pp) grid."""

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_stage_publisher(self) -> bool:
        """TP rank 0 of DP replica 0: gathers and yields this PP stage's full tensors."""
        return self.tp_rank == 0 and self.dp_rank == 0

    @property
    def shard(self) -> dict[str, int]:
        """This rank's shard coordinates, as `convert`'s functions take them."""
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
        }

    def global_rank(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank of grid point (tp, dp, pp) under Megatron's `tp-cp-ep-dp-pp` order."""
        return tp_rank + self.tp_size * (dp_rank + self.dp_size * pp_rank)


def initialize_parallel(*, tp_size: int, pp_size: int, seed: int, ep_size: int = 1) -> Layout:
    """Build Megatron's process groups over the already initialised default group.

    Expert parallelism (`ep_size`) splits the data-parallel ranks of each
    (TP, PP) position: experts are placed over `tp-ep-dp-pp` with expert-TP =
    TP, so EP must divide DP. Idempotent for the same sizes (tests build several
    backends in one process)."""
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start ranks with "
            "streamrl.backends.rendezvous (or init_process_group yourself) first"
        )
    world_size = dist.get_world_size()
    if world_size % (tp_size * pp_size):
        raise ValueError(
            f"learner world size {world_size} is not a multiple of "
            f"tensor_parallel_size * pipeline_parallel_size = {tp_size * pp_size}"
        )
    if (world_size // (tp_size * pp_size)) % ep_size:
        raise ValueError(
            f"learner.megatron.expert_model_parallel_size = {ep_size} does not divide the "
            f"data-parallel size {world_size // (tp_size * pp_size)} "
            f"(num_gpus / (tensor_parallel_size * pipeline_parallel_size))"
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tp_size
            and parallel_state.get_pipeline_model_parallel_world_size() == pp_size
            and parallel_state.get_expert_model_parallel_world_size() == ep_size
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=tp_size,
            # No gloo duplicates of the groups: only Megatron's dp-zero optimizer
            # checkpoint format uses them, and CPU and GPU then build the same groups.
            create_gloo_process_groups=False,
        )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from streamrl.backends.megatron.cpu_shims import install_cpu_rng_tracker

        install_cpu_rng_tracker()
    return current_layout()


def current_layout() -> Layout:
    """This rank's Layout from the initialised parallel_state."""
    from megatron.core import parallel_state as ps

    return Layout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def dp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def pp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def ep_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def expert_tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_group()
