"""MoE routing on the learner: replay the rollout's expert choices, and measure agreement.

Rollout routing replay ("R3"): the engine reports, per token, the experts its
router chose (`Sample.routed_experts`, carried to the learner as
`MicroBatch.extras["routed_experts"]`, int16 `[B, T, layers * top_k]`, -1 where
unknown). Before each forward, `RoutingControl.prepare` hands every MoE layer
of this rank its slice, in Megatron's token order (`[seq, batch]` flattened;
under sequence parallelism only this TP rank's part of the sequence).

Each Megatron `TopKRouter` reads its `router_replay` attribute inside
`topk_routing_with_score_function` (megatron-core 0.16.1); a `LayerRouting`
there computes the router's own top-k as usual and then, with
`algorithm.routing_replay`, substitutes the engine's experts for every token
that has them. The routing weights are the learner's router scores *at those
experts* (gathered from the same scores, then softmax / sigmoid-normalised and
scaled as usual), so the router still gets a gradient; only the choice is the
engine's. Tokens without a report (padding, the last token, a sample without
routed experts) keep the router's own choice.

Agreement (`train/moe_router_agreement`): over reported tokens of every MoE
layer, the fraction of the engine's k experts that the learner's own router
also picked, measured in the training forward whether or not replay is on.
`train/moe_replayed_fraction` is the share of routed tokens whose experts were
replayed. Both are all-reduced over every learner rank.

Limits: with full activation recompute and PP > 1, a micro-batch's recompute
runs after later micro-batches' forwards, so replay is refused there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from streamrl.backends.megatron.shapes import ModelShape

ROUTED_EXPERTS = "routed_experts"


class LayerRouting:
    """One MoE layer's replay state, in the place of Megatron's `RouterReplay`."""

    def __init__(self, layer: int, control: RoutingControl) -> None:
        self.layer = layer  # 0-based global layer index
        self.control = control
        self.target: torch.Tensor | None = None  # [tokens, k] int64, -1 rows: no report
        self.used: torch.Tensor | None = None  # the experts of the last forward (record=True)

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        values, chosen = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        target = self.target
        if target is not None:
            if target.shape != chosen.shape:
                raise RuntimeError(
                    f"layer {self.layer}: routed experts for {tuple(target.shape)} tokens x "
                    f"top-k, the router sees {tuple(chosen.shape)}"
                )
            target = target.to(chosen.device)
            known = (target >= 0).all(dim=-1)
            self.control.count(chosen, target, known)
            if self.control.replay:
                chosen = torch.where(known[:, None], target, chosen)
                values = scores.gather(1, chosen)
        if self.control.record:
            self.used = chosen.detach().clone()
        return values, chosen


class RoutingControl:
    """Every MoE router of one model (one pipeline stage) and the statistics they gather."""

    def __init__(self, model: torch.nn.Module, shape: ModelShape, *, replay: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.shape, self.replay, self.record = shape, replay, False
        self.layers: list[LayerRouting] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                layer = LayerRouting(module.layer_number - 1, self)
                module.router_replay = layer
                self.layers.append(layer)
        self._counting = True
        self.reset()

    def reset(self) -> None:
        # matched, engine-reported (token, slot) pairs, replayed tokens, routed tokens
        self.sums = torch.zeros(4, dtype=torch.float64)

    def count(self, chosen: torch.Tensor, target: torch.Tensor, known: torch.Tensor) -> None:
        if not self._counting:
            return
        matched = (chosen[:, :, None] == target[:, None, :]).any(dim=-1) & known[:, None]
        num_known = known.sum()
        replayed = num_known if self.replay else num_known * 0
        routed = torch.full((), known.numel(), device=known.device)
        update = torch.stack([matched.sum(), num_known * target.shape[1], replayed, routed])
        if self.sums.device != update.device:  # stays on the learner's device: no sync per layer
            self.sums = self.sums.to(update.device)
        self.sums += update

    def prepare(self, micro_batch: Any, padded_length: int, config: Any, *, count: bool) -> None:
        """Give each layer its tokens' reported experts for the next forward (or none).

        `padded_length`: the sequence length the model sees (sequence-parallel padding);
        `count=False` for the zero-weight copies that only keep ranks in step."""
        self._counting = count
        routed = micro_batch.extras.get(ROUTED_EXPERTS)
        if routed is None or not self.layers:
            for layer in self.layers:
                layer.target = None
            return
        moe = self.shape.moe
        rows, length, columns = routed.shape
        if columns != self.shape.num_layers * moe.top_k:
            raise ValueError(
                f"routed experts carry {columns} ids per token; this model has "
                f"{self.shape.num_layers} layers x top-{moe.top_k} = "
                f"{self.shape.num_layers * moe.top_k} (another model's rollout?)"
            )
        table = routed.view(rows, length, self.shape.num_layers, moe.top_k).long()
        if padded_length > length:
            pad = table.new_full((rows, padded_length - length, *table.shape[2:]), -1)
            table = torch.cat([table, pad], dim=1)
        table = table.transpose(0, 1)  # [seq, batch, layers, k]: Megatron's token order
        if config.sequence_parallel:
            from megatron.core import parallel_state

            share = padded_length // config.tensor_model_parallel_size
            start = parallel_state.get_tensor_model_parallel_rank() * share
            table = table[start : start + share]
        for layer in self.layers:
            layer.target = table[:, :, layer.layer].reshape(-1, moe.top_k).contiguous()

    def collect(self, device: torch.device) -> dict[str, float]:
        """All-reduced agreement metrics since the last reset (every rank must call it)."""
        sums = self.sums.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        matched, reported, replayed, routed = sums.tolist()
        self.reset()
        if not reported:
            return {}
        return {
            "moe_router_agreement": matched / reported,
            "moe_replayed_fraction": replayed / routed if routed else 0.0,
        }


def install(model: torch.nn.Module, shape: ModelShape, *, replay: bool) -> RoutingControl | None:
    """Attach a RoutingControl to `model`'s routers (None for a dense model)."""
    if shape.moe is None:
        return None
    control = RoutingControl(model, shape, replay=replay)
    model.routing_control = control
    return control


def control_of(model: torch.nn.Module) -> RoutingControl | None:
    """The RoutingControl of a (possibly DDP-wrapped) model."""
    return getattr(getattr(model, "module", model), "routing_control", None)
