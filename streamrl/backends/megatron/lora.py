"""LoRA on megatron-core's tensor-parallel linears, sharded so that TP = N trains like TP = 1.

An adapter belongs to one Hugging Face linear (`q_proj`, ..., `down_proj`); Megatron fuses
some of them (q/k/v into `linear_qkv`, gate/up into `linear_fc1`), so an adapted Megatron
linear holds one (A, B) pair per targeted HF part. The adapters are parameters of a
`LoraAdapters` module attached to the linear (`<linear>.lora`, so the base's parameter
names do not change) and run from a forward hook: output += s * B(A(x)) per part.

Sharding (s = alpha / rank; x the linear's input, [seq, batch, in]):

| linear | A [rank, in] | B [out, rank] | communication (TP > 1) |
| --- | --- | --- | --- |
| column-parallel (`linear_qkv`, `linear_fc1`) | replicated | rows sharded like the base's rows | u = A x; copy-to-TP (backward all-reduces du) before B |
| row-parallel (`linear_proj`, `linear_fc2`) | columns sharded like the base's | replicated | p = A_local x_local; all-reduce p (the partial sums) before B |

With sequence parallelism the column case first all-gathers x over the sequence (backward:
reduce-scatter), so A's gradient is a partial sum and A is marked `sequence_parallel`;
the row case reduce-scatters p over the sequence, so B is the partial one. Megatron's
`finalize_model_grads` sums such gradients over TP, as it does for norms. Sharded
parameters carry Megatron's `tensor_model_parallel` attributes, so the grad norm counts
every element once.

A base row of a fused linear keeps, on every TP rank, the HF row it had at TP = 1
(`convert.shard` of row indices), so B's local rows are read off that map and B's shards
gather back by concatenation. A starts as torch's default for linears (uniform within
1/sqrt(in)) from a generator seeded by the run seed and the adapter's HF module name, the
same at every TP and PP layout; B starts at zero.
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from streamrl.backends.megatron import convert, rules
from streamrl.backends.megatron.shapes import ModelShape

COLUMN_KINDS = (rules.QKV, rules.GATE_UP, rules.GATE_UP_FUSED, rules.COLUMN)
ADAPTED_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
"""The Megatron linears of a dense decoder layer (local names) that can hold adapters."""


def check_supported(shape: ModelShape) -> None:
    """ValueError unless `shape` is a dense model whose linears the adapters can hook."""
    problems = [
        what
        for what, present in (
            ("mixture-of-experts layers", shape.moe is not None),
            ("multi-head latent attention", shape.mla is not None),
            ("post-norms after attention and the MLP", shape.post_norms),
        )
        if present
    ]
    if problems:
        raise ValueError(
            f"learner.lora with learner.backend = 'megatron' supports dense Llama/Qwen-style "
            f"models; {shape.model_type} has {' and '.join(problems)} (use learner.backend = "
            f"'torch', or full fine-tuning)"
        )


def hf_module(hf_weight_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `model.layers.3.self_attn.q_proj`."""
    return hf_weight_name.removesuffix(".weight")


def _part_size(shape: ModelShape, module: str) -> tuple[int, int]:
    """(out, in) of one HF linear of a dense decoder layer."""
    short = module.rsplit(".", 1)[-1]
    attention = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    sizes = {
        "q_proj": (attention, shape.hidden_size),
        "k_proj": (kv, shape.hidden_size),
        "v_proj": (kv, shape.hidden_size),
        "o_proj": (shape.hidden_size, attention),
        "gate_proj": (shape.ffn_hidden_size, shape.hidden_size),
        "up_proj": (shape.ffn_hidden_size, shape.hidden_size),
        "gate_up_proj": (2 * shape.ffn_hidden_size, shape.hidden_size),
        "down_proj": (shape.hidden_size, shape.ffn_hidden_size),
    }
    return sizes[short]


@dataclass(frozen=True)
class AdapterPlan:
    """Where the adapters of one Megatron linear live on this TP rank.

    `modules[i]` is part i's HF module; column style: `rows[i]` the part's HF rows this rank
    holds (in order), `order` for each local output row of the base its position in the
    parts' concatenated local outputs (-1: a row of a part without an adapter)."""

    megatron: str
    kind: str
    modules: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]
    rows: tuple[tuple[int, ...], ...] = ()
    order: tuple[int, ...] = ()

    @property
    def is_column(self) -> bool:
        return self.kind in COLUMN_KINDS


def adapter_plans(
    shape: ModelShape,
    target_modules: tuple[str, ...],
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
) -> list[AdapterPlan]:
    """The adapted linears of one PP stage in a fixed order (the same on every rank)."""
    plans = []
    for rule in rules.stage_rules(shape, pp_rank=pp_rank, pp_size=pp_size):
        linear = rule.megatron.removesuffix(".weight")
        if not rule.megatron.endswith(".weight") or not linear.endswith(ADAPTED_LINEARS):
            continue
        modules = [hf_module(name) for name in rule.hf]
        targeted = [m for m in modules if m.rsplit(".", 1)[-1] in target_modules]
        if not targeted:
            continue
        sizes = tuple(_part_size(shape, m) for m in targeted)
        if rule.kind == rules.ROW:
            plans.append(AdapterPlan(linear, rule.kind, tuple(targeted), sizes))
            continue
        plans.append(_column_plan(rule, linear, modules, targeted, sizes, shape, tp_rank, tp_size))
    return plans


def _column_plan(rule, linear, modules, targeted, sizes, shape, tp_rank, tp_size) -> AdapterPlan:
    """Label every HF row of the fused linear with its index among the targeted parts' rows
    (-1 elsewhere), shard the labels like the weight, and read this rank's layout off them."""
    labels, offset = [], 0
    for module in modules:
        rows = _part_size(shape, module)[0]
        if module in targeted:
            labels.append(torch.arange(offset, offset + rows)[:, None])
            offset += rows
        else:
            labels.append(torch.full((rows, 1), -1, dtype=torch.int64))
    local = convert.shard(rule.kind, labels, shape, tp_rank=tp_rank, tp_size=tp_size)[:, 0]
    starts = [0]
    for out, _ in sizes:
        starts.append(starts[-1] + out)
    rows = tuple(
        tuple(int(i) - start for i in local.tolist() if start <= i < end)
        for start, end in itertools.pairwise(starts)
    )
    position, count = {}, 0
    for part, part_rows in enumerate(rows):
        for row in part_rows:
            position[starts[part] + row] = count
            count += 1
    order = tuple(position.get(int(i), -1) for i in local.tolist())
    return AdapterPlan(linear, rule.kind, tuple(targeted), sizes, rows, order)


class LoraAdapters(torch.nn.Module):
    """The (A, B) pairs of one Megatron linear on this rank (see the module docstring)."""

    def __init__(
        self,
        plan: AdapterPlan,
        *,
        rank: int,
        scaling: float,
        tp_rank: int,
        tp_size: int,
        sequence_parallel: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.plan, self.scaling, self.enabled = plan, scaling, True
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.lora_a, self.lora_b = torch.nn.ParameterList(), torch.nn.ParameterList()
        for part, (out, in_features) in enumerate(plan.sizes):
            if plan.is_column:
                a_shape, b_shape = (rank, in_features), (len(plan.rows[part]), rank)
            else:
                a_shape, b_shape = (rank, in_features // tp_size), (out, rank)
            a = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
            sharded, dim = (b, 0) if plan.is_column else (a, 1)
            if tp_size > 1:
                set_tensor_model_parallel_attributes(sharded, True, dim, 1)
                if self.sequence_parallel:  # the replicated one's gradient is a partial sum
                    (a if plan.is_column else b).sequence_parallel = True
            self.lora_a.append(a)
            self.lora_b.append(b)
        if plan.is_column:  # a row without an adapter reads the zero column after the parts
            zero = sum(len(rows) for rows in plan.rows)
            order = torch.tensor([i if i >= 0 else zero for i in plan.order], dtype=torch.int64)
            self.register_buffer("order", order.to(device), persistent=False)

    # -------------------------------------------------------------- full tensors

    @torch.no_grad()
    def load_full(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set every part from its full (unsharded) HF-shaped (A, B) (B unscaled, as peft's)."""
        for part, (a, b) in enumerate(parts):
            if self.plan.is_column:
                self.lora_a[part].copy_(a)
                self.lora_b[part].copy_(b[list(self.plan.rows[part])])
            else:
                self.lora_a[part].copy_(a.chunk(self.tp_size, dim=1)[self.tp_rank])
                self.lora_b[part].copy_(b)

    @torch.no_grad()
    def init_fresh(self, generator: torch.Generator) -> None:
        """A uniform within 1/sqrt(in) (drawn whole, then sharded), B zero."""
        parts = []
        for out, in_features in self.plan.sizes:
            bound = in_features**-0.5
            a = torch.rand(self.lora_a[0].shape[0], in_features, generator=generator) * 2 - 1
            parts.append((a * bound, torch.zeros(out, a.shape[0])))
        self.load_full(parts)

    # -------------------------------------------------------------- forward

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """s * B(A(x)) in the layout of the base linear's output on this rank."""
        from megatron.core.tensor_parallel import mappings

        if self.plan.is_column:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x)
            outputs = []
            for a, b in zip(self.lora_a, self.lora_b, strict=True):
                u = torch.nn.functional.linear(x, a)
                if self.tp_size > 1 and not self.sequence_parallel:
                    u = mappings.copy_to_tensor_model_parallel_region(u)
                outputs.append(torch.nn.functional.linear(u, b))
            joined = torch.cat([*outputs, outputs[0].new_zeros((*x.shape[:-1], 1))], dim=-1)
            return joined.index_select(-1, self.order) * self.scaling
        (a,), (b,) = self.lora_a, self.lora_b
        partial = torch.nn.functional.linear(x, a)
        if self.sequence_parallel:
            partial = mappings.reduce_scatter_to_sequence_parallel_region(partial)
        elif self.tp_size > 1:
            partial = mappings.reduce_from_tensor_model_parallel_region(partial)
        return torch.nn.functional.linear(partial, b) * self.scaling


def _add_delta(linear: torch.nn.Module, inputs: tuple, output):
    """Forward hook of an adapted linear: (output + delta, bias)."""
    adapters: LoraAdapters = linear.lora
    if not adapters.enabled:
        return output
    result, bias = output
    return result + adapters.delta(inputs[0]).to(result.dtype), bias


def install(
    model: torch.nn.Module,
    plans: list[AdapterPlan],
    *,
    rank: int,
    scaling: float,
    tp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    seed: int,
) -> list[LoraAdapters]:
    """Freeze `model`, attach fresh adapters to the planned linears (in plan order)."""
    model.requires_grad_(False)
    modules = dict(model.named_modules())
    reference = next(model.parameters())
    attached = []
    for plan in plans:
        linear = modules[plan.megatron]
        adapters = LoraAdapters(
            plan, rank=rank, scaling=scaling, tp_rank=tp_rank, tp_size=tp_size,
            sequence_parallel=sequence_parallel, dtype=reference.dtype, device=reference.device,
        )  # fmt: skip
        # Seeded by the HF module's name: the same A at every TP and PP layout.
        stream = zlib.crc32(plan.modules[0].encode())
        adapters.init_fresh(torch.Generator().manual_seed(seed * 1_000_003 + stream))
        linear.lora = adapters
        linear.register_forward_hook(_add_delta)
        attached.append(adapters)
    return attached


@contextlib.contextmanager
def disabled(adapters: list[LoraAdapters]) -> Iterator[None]:
    """Within: every adapted linear runs its frozen base alone (the KL reference)."""
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


# ------------------------------------------------------------------ full tensors out


def _gathered(local: torch.Tensor, *, dim: int, group, size: int, dst: int, is_dst: bool):
    import torch.distributed as dist

    shards = [torch.empty_like(local) for _ in range(size)] if is_dst else None
    dist.gather(local.detach().contiguous(), shards, dst=dst, group=group)
    return torch.cat(shards, dim=dim) if is_dst else None


def full_parts(
    adapters: list[LoraAdapters], *, tp_group, tp_size: int, publisher: int, is_publisher: bool
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module, full A, full B unscaled) of every adapter of this stage, on its publisher
    (the other TP ranks of the replica take part in the gathers and yield nothing)."""
    for adapter in adapters:
        for part, module in enumerate(adapter.plan.modules):
            a, b = adapter.lora_a[part].detach(), adapter.lora_b[part].detach()
            if tp_size > 1 and adapter.plan.is_column:
                kwargs = {"group": tp_group, "size": tp_size, "dst": publisher}
                b = _gathered(b, dim=0, is_dst=is_publisher, **kwargs)
            elif tp_size > 1:
                kwargs = {"group": tp_group, "size": tp_size, "dst": publisher}
                a = _gathered(a, dim=1, is_dst=is_publisher, **kwargs)
            if is_publisher:
                yield module, a, b
