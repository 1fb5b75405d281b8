"""Running megatron-core's forward(-backward) schedule over a step's micro-batches, on every
learner rank: which micro-batches this DP replica runs (`local_work`), the schedule itself
(`run`, `train`), and the results brought back to rank 0 (`collect_on_rank0`,
`reduce_metrics`). The policy (`backend.py`) and its critic (`critic.py`) both run through
one `Schedule`, each with its own model, DDP and optimizer.

Gradient scale: the loop's losses are already divided by mini-batch totals, so the wanted
gradient is the plain SUM over all micro-batches of all DP replicas. Megatron divides each
returned loss by the local number of micro-batches and DDP averages over DP ranks; the
callers' `loss_for` multiplies both back (`MegatronBackend.train_mini_batch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from streamrl.backends.base import MicroBatch
from streamrl.backends.megatron import batches, packing, parallel, routing
from streamrl.backends.megatron.model import padded_for_sequence_parallel
from streamrl.backends.megatron.parallel import Layout

LossFor = Callable[[MicroBatch, float, torch.Tensor], tuple[torch.Tensor, dict]]
"""(micro-batch, its weight, the model's output) -> (loss, metric tensors)."""


class Schedule:
    """One rank's side of every schedule run: its place (`layout`), its device, the
    attention kind (the unfused "local" attention takes an explicit mask; packed rows give
    SDPA their document ids, `packing.py`) and the
    context Megatron's calls run in (`cpu_shims.cpu_redirect` on CPU)."""

    def __init__(
        self,
        layout: Layout,
        *,
        device: torch.device,
        attention: str,
        context: Callable[[], contextlib.AbstractContextManager],
        is_data_rank: bool,
    ) -> None:
        self.layout = layout
        self.device = device
        self.attention = attention
        self.context = context
        self.is_data_rank = is_data_rank

    def local_work(
        self, micro_batches: list[MicroBatch]
    ) -> tuple[list[MicroBatch], list[int], list[tuple[MicroBatch, float]]]:
        """All micro-batches (from rank 0), this DP replica's indices, and its (mb, weight) work."""
        everything = batches.broadcast_micro_batches(
            micro_batches if self.is_data_rank else [], device=self.device
        )
        mine = batches.dp_share(
            len(everything), dp_rank=self.layout.dp_rank, dp_size=self.layout.dp_size
        )
        work = [(everything[i], 1.0) for i in mine]
        if everything and not work:  # fewer micro-batches than replicas: run a zero-weight copy
            work = [(everything[0], 0.0)]
        if self.layout.ep_size > 1:  # EP ranks dispatch tokens together: same number of passes
            per_replica = -(-len(everything) // self.layout.dp_size)
            work += [(everything[0], 0.0)] * (per_replica - len(work))
        return everything, mine, work

    def run(
        self,
        model: torch.nn.Module,
        work: list[tuple[MicroBatch, float]],
        loss_for: LossFor,
        *,
        forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """Megatron's forward(-backward) schedule over (micro-batch, weight) pairs.

        Returns the loss functions' metric dicts (last PP stage only; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        config = model.config  # the policy's, its reference's or the critic's

        def forward_step(data_iterator, model):
            micro_batch, weight = next(data_iterator)
            input_ids = padded_for_sequence_parallel(micro_batch.input_ids, config)
            control = routing.control_of(model)
            if control is not None:  # the rollout's experts, for replay and agreement
                control.prepare(micro_batch, input_ids.shape[1], config, count=weight > 0)
            positions, attention_mask = self._positions_and_mask(micro_batch, input_ids)
            rope = packing.positions_of(model)
            if rope is not None:  # packed rows: RoPE by each sample's own positions
                rope.positions = positions.t() if micro_batch.is_packed else None
            output = model(input_ids, positions, attention_mask)
            length = micro_batch.input_ids.shape[1]  # the loss sees the unpadded positions
            return output, lambda logits: loss_for(micro_batch, weight, logits[:, :length])

        first = work[0][0].input_ids
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(work),
            model=[model],
            num_microbatches=len(work),
            seq_length=max(
                padded_for_sequence_parallel(mb.input_ids, config).shape[1] for mb, _ in work
            ),
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )

    def _positions_and_mask(
        self, micro_batch: MicroBatch, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids [B, S] and the core attention's mask argument for `input_ids` (the
        micro-batch's, padded for sequence parallelism). Right-padded rows: positions are
        columns; SDPA takes no mask, Megatron's unfused attention a causal one (True =
        masked). Packed rows: each sample's own positions; SDPA takes the document ids,
        the unfused attention the dense mask they make (`packing`)."""
        seq_len = input_ids.shape[1]
        if not micro_batch.is_packed:
            positions = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
            if self.attention != "local":
                return positions, None
            ones = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=self.device)
            return positions, ones.triu(diagonal=1)
        positions = packing.padded_positions(micro_batch.position_ids, seq_len)
        documents = packing.document_ids(positions)
        if self.attention != "local":
            return positions, documents
        return positions, packing.masked_positions(documents)

    def collect_on_rank0(
        self, everything: list[MicroBatch], mine: list[int], local: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Per-micro-batch results from each DP replica's last stage (TP rank 0) to rank 0."""
        layout = self.layout
        if layout.world_size == 1:
            return [t.cpu() for t in local]

        def owner(index: int) -> int:
            dp_rank = index % layout.dp_size
            return layout.global_rank(tp_rank=0, dp_rank=dp_rank, pp_rank=layout.pp_size - 1)

        if layout.rank == 0:
            results = []
            for index, micro_batch in enumerate(everything):
                if owner(index) == 0:
                    results.append(local[mine.index(index)].cpu())
                else:
                    shape = tuple(micro_batch.input_ids.shape)
                    results.append(
                        batches.recv_from(shape, torch.float32, owner(index), self.device).cpu()
                    )
            return results
        if layout.tp_rank == 0 and layout.is_last_stage:
            for tensor in local:
                batches.send_to(tensor, dst=0)
        return []

    def train(
        self,
        ddp: Any,
        optimizer: Any,
        work: list[tuple[MicroBatch, float]],
        loss_for: LossFor,
        *,
        lr: float,
    ) -> dict[str, float]:
        """Forward and backward `work` through `ddp`, then one step of `optimizer` at `lr`
        (the policy's, or the critic's); the reduced metrics plus `grad_norm` and `lr`."""
        ddp.train()
        for group in optimizer.param_groups:
            group["lr"] = lr
        with self.context():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            store = self.run(ddp, work, loss_for, forward_only=False)
            succeeded, grad_norm, _ = optimizer.step()
        if not succeeded:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        metrics = self.reduce_metrics(store)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = lr
        return metrics

    def reduce_metrics(self, store: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum over micro-batches and DP replicas; deliver to rank 0 (first PP stage)."""
        layout = self.layout
        names = sorted(store[0]) if store else []
        summed = None
        if layout.is_last_stage and names:
            summed = torch.stack([sum(item[name] for item in store) for name in names]).to(
                self.device
            )
            if layout.dp_size > 1:
                dist.all_reduce(summed, group=parallel.dp_group())
        if layout.pp_size > 1 and layout.tp_rank == 0 and layout.dp_rank == 0:
            source = layout.global_rank(tp_rank=0, dp_rank=0, pp_rank=layout.pp_size - 1)
            payload = (
                [{name: summed[i] for i, name in enumerate(names)}]
                if layout.rank == source
                else None
            )
            (received,) = batches.broadcast_named_tensors(
                payload, device=self.device, src=source, group=parallel.pp_group()
            )
            return {name: float(value) for name, value in received.items()}
        if summed is None:
            return {}
        return {name: float(value) for name, value in zip(names, summed.tolist(), strict=True)}
