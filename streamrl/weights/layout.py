"""Which ranks engines take in the weight-update group (the trainer is rank 0).

An SGLang engine with tensor parallelism T joins the weight-update group as T
ranks, `rank_offset + tp_rank` for tp_rank in 0..T-1 (SGLang's model runner;
the embedded engine is one rank). The trainer is rank 0. For engines with GPU
counts g_0, g_1, ...:

    world_size     = 1 + g_0 + g_1 + ...
    rank_offset[i] = 1 + g_0 + ... + g_{i-1}

SGLang adds neither `pp_rank` nor `dp_rank` to that rank, so a server with
`pp_size` > 1, or `dp_size` > 1 without DP attention, would give two GPUs the
same rank: `engine_gpu_count` refuses such servers.

A learner with pipeline parallelism publishes from every stage: each stage's
publisher is rank 0 of its own group (its own `group_name` and port) over the
same engines, with this same layout; every engine then holds one group per
stage and loads each stage's layers from that stage's group.

Nothing here touches the network: `streamrl.fleet.client.engine_gpu_counts` asks the
engines for their `/server_info`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class WeightGroupLayout(NamedTuple):
    """Ranks of one weight-update group: the trainer is rank 0."""

    world_size: int
    """1 + the GPUs of every engine."""
    rank_offsets: tuple[int, ...]
    """Engine i's first rank: 1 + the GPUs of engines 0..i-1."""


def weight_group_layout(engine_gpu_counts: Sequence[int]) -> WeightGroupLayout:
    """World size and per-engine rank offsets for engines with these GPU counts, in order."""
    offsets = []
    next_rank = 1
    for index, count in enumerate(engine_gpu_counts):
        if count < 1:
            raise ValueError(f"engine {index} has {count} GPUs; every engine has at least one")
        offsets.append(next_rank)
        next_rank += count
    return WeightGroupLayout(world_size=next_rank, rank_offsets=tuple(offsets))


def engine_gpu_count(server_info: dict[str, Any]) -> int:
    """How many ranks an engine takes in the weight-update group, from its `/server_info`.

    `tp_size` (1 when absent, as for servers that do not report it); a ValueError for
    layouts where SGLang would give two GPUs one rank (pp_size > 1, or dp_size > 1 without
    `enable_dp_attention`)."""
    tp_size = int(server_info.get("tp_size") or 1)
    pp_size = int(server_info.get("pp_size") or 1)
    dp_size = int(server_info.get("dp_size") or 1)
    where = f"engine on port {server_info.get('port', '?')}"
    if pp_size > 1:
        raise ValueError(
            f"{where} runs pp_size = {pp_size}: SGLang joins weight-update groups as "
            f"rank_offset + tp_rank only, so its pipeline stages would share ranks; "
            f"run one engine per pipeline stage's GPUs with pp_size 1"
        )
    if dp_size > 1 and not server_info.get("enable_dp_attention"):
        raise ValueError(
            f"{where} runs dp_size = {dp_size} without --enable-dp-attention: its data-parallel "
            f"replicas would share weight-group ranks; run one engine per replica instead"
        )
    return tp_size
