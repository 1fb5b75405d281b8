"""One pipeline stage's full tensors under HF names, gathered from its TP and EP shards.

Who takes part (rank = tp + TP * (dp + DP * pp); experts are laid out
`tp-ep-dp-pp`, so DP rank d is EP rank d % EP of expert-data-parallel replica
d // EP):

- tensors other than routed experts: the TP ranks of DP replica 0 gather them
  to the stage publisher (TP rank 0 of DP replica 0), as for a dense model;
- routed experts: every rank of expert-data-parallel replica 0 (DP ranks
  0..EP-1) gathers its local experts over the expert tensor-and-model-parallel
  group (expert-TP x EP) to the publisher, one local expert index at a time;
  the publisher merges each EP rank's TP shards into that rank's global
  experts (`local_experts.j` of EP rank r is expert r * E/EP + j).

Every participating rank walks the same rules in the same order (the Megatron
names of local experts are the same on every EP rank), so the collectives
match. Other ranks return at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from streamrl.backends.megatron import convert, parallel, rules
from streamrl.backends.megatron.shapes import ModelShape


def _expert_group_order(layout: parallel.Layout) -> tuple[dist.ProcessGroup | None, list[int]]:
    """The expert-TP x EP group and, per group member, its index ep_rank * TP + tp_rank."""
    if layout.ep_size * layout.tp_size == 1:
        return None, [0]
    from megatron.core import parallel_state

    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    order = []
    for rank in dist.get_process_group_ranks(group):
        tp_rank, ep_rank = rank % layout.tp_size, (rank // layout.tp_size) % layout.ep_size
        order.append(ep_rank * layout.tp_size + tp_rank)
    return group, order


def _gather(local: torch.Tensor, *, dst: int, group, size: int, is_dst: bool):
    shards = [torch.empty_like(local) for _ in range(size)] if is_dst else None
    dist.gather(local.contiguous(), shards, dst=dst, group=group)
    return shards


@torch.no_grad()
def stage_hf_weights(
    model: torch.nn.Module, shape: ModelShape, layout: parallel.Layout
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of this PP stage on its publisher; the other ranks yield nothing."""
    tp, ep = layout.tp_size, layout.ep_size
    if layout.dp_rank >= ep:
        return  # another data-parallel replica (of the experts too): nothing to send
    is_publisher = layout.is_stage_publisher
    publisher = layout.global_rank(tp_rank=0, dp_rank=0, pp_rank=layout.pp_rank)
    position = {"pp_rank": layout.pp_rank, "pp_size": layout.pp_size, "ep_size": ep}
    rules_by_ep = [rules.stage_rules(shape, ep_rank=r, **position) for r in range(ep)]
    expert_group, order = _expert_group_order(layout)
    tensors = convert.iter_stage_tensors(model, shape, ep_rank=layout.ep_rank, **position)
    for index, (rule, param) in enumerate(tensors):
        if not rules.is_exported(rule, shape, pp_size=layout.pp_size):
            continue
        local = param.detach()
        if rule.expert is None:
            if layout.dp_rank != 0:
                continue
            if tp == 1 or rule.kind == rules.REPLICATED:
                shards = [local]
            else:
                shards = _gather(
                    local, dst=publisher, group=parallel.tp_group(), size=tp, is_dst=is_publisher
                )
            if is_publisher:
                yield from zip(rule.hf, convert.merge(rule.kind, shards, shape), strict=True)
            continue
        if expert_group is None:
            gathered = [local]
        else:
            gathered = _gather(
                local, dst=publisher, group=expert_group, size=len(order), is_dst=is_publisher
            )
        if not is_publisher:
            continue
        by_position = [None] * len(order)
        for member, tensor in zip(order, gathered, strict=True):
            by_position[member] = tensor
        for ep_rank in range(ep):
            owner_rule = rules_by_ep[ep_rank][index]
            shards = by_position[ep_rank * tp : (ep_rank + 1) * tp]
            parts = convert.merge(owner_rule.kind, shards, shape)
            yield from zip(owner_rule.hf, parts, strict=True)
