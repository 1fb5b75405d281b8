"""How micro-batches travel from rank 0 to every learner rank, and results travel back.

Rank 0 is the only rank that holds data (it talks to the buffer). A call
such as `train_mini_batch` runs on every rank; rank 0 passes the real
micro-batches, the others pass an empty list. `broadcast_micro_batches`
then sends all of them, from rank 0, in four collectives whatever their
number: a size header, an int64 schema (dtype and shape of each tensor), the
field names (utf-8) and one byte payload with every tensor back to back. No
pickle: only tensors cross the wire.

Micro-batch i belongs to data-parallel replica `i % dp_size` (`dp_share`);
every rank of that replica (all its TP ranks and PP stages) runs it. A
replica that gets none runs a zero-weighted copy of micro-batch 0 so that
every rank still enters the gradient all-reduce.

Results (per-token log-probabilities, loss metrics) live on the last
pipeline stage; `send_to` / `recv_from` bring them back to rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from streamrl.backends.base import MicroBatch

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_TENSOR_FIELDS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "behaviour_logprobs",
    "advantages",
    "proximal_logprobs",
    "reference_logprobs",
    "position_ids",
)
_LIST_FIELDS = ("sample_indices", "sample_rows", "sample_columns")


def flatten(micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
    """Every field of a micro-batch as a named tensor (scalars and index lists included)."""
    out = {
        name: getattr(micro_batch, name)
        for name in _TENSOR_FIELDS
        if getattr(micro_batch, name) is not None
    }
    for name in _LIST_FIELDS:
        out[name] = torch.tensor(getattr(micro_batch, name), dtype=torch.int64)
    out["num_tokens_in_mini_batch"] = torch.tensor(
        float(micro_batch.num_tokens_in_mini_batch), dtype=torch.float64
    )
    out["num_sequences_in_mini_batch"] = torch.tensor(
        int(micro_batch.num_sequences_in_mini_batch), dtype=torch.int64
    )
    out.update({f"extras.{key}": value for key, value in micro_batch.extras.items()})
    return out


def unflatten(tensors: dict[str, torch.Tensor]) -> MicroBatch:
    """Inverse of `flatten`."""
    fields = {name: tensors.get(name) for name in _TENSOR_FIELDS}
    return MicroBatch(
        **fields,
        **{name: tensors[name].tolist() for name in _LIST_FIELDS},
        num_tokens_in_mini_batch=float(tensors["num_tokens_in_mini_batch"]),
        num_sequences_in_mini_batch=int(tensors["num_sequences_in_mini_batch"]),
        extras={
            name.removeprefix("extras."): value
            for name, value in tensors.items()
            if name.startswith("extras.")
        },
    )


def broadcast_named_tensors(
    groups: list[dict[str, torch.Tensor]] | None,
    *,
    device: torch.device,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Broadcast a list of {name: tensor} dicts from global rank `src` (others pass None).

    Returns the same list, tensors on `device`, on every rank of `group`."""
    is_src = dist.get_rank() == src
    if is_src:
        schema, names, chunks = [len(groups)], [], []
        for named in groups:
            schema.append(len(named))
            for name, tensor in named.items():
                tensor = tensor.detach().contiguous()
                schema += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
                names.append(name)
                chunks.append(tensor.reshape(-1).view(torch.uint8).to(device))
        name_bytes = torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8, device=device)
        schema_t = torch.tensor(schema, dtype=torch.int64, device=device)
        payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
        sizes = torch.tensor(
            [schema_t.numel(), name_bytes.numel(), payload.numel()],
            dtype=torch.int64,
            device=device,
        )
    else:
        sizes = torch.empty(3, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=src, group=group)
    if not is_src:
        schema_t = torch.empty(int(sizes[0]), dtype=torch.int64, device=device)
        name_bytes = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
        payload = torch.empty(int(sizes[2]), dtype=torch.uint8, device=device)
    dist.broadcast(schema_t, src=src, group=group)
    if name_bytes.numel():
        dist.broadcast(name_bytes, src=src, group=group)
    if payload.numel():
        dist.broadcast(payload, src=src, group=group)
    if is_src:
        return [{k: v.to(device) for k, v in named.items()} for named in groups]
    return _parse(schema_t.tolist(), bytes(name_bytes.tolist()).decode().split("\n"), payload)


def _parse(
    schema: list[int], names: list[str], payload: torch.Tensor
) -> list[dict[str, torch.Tensor]]:
    groups, cursor, offset, name_index = [], 1, 0, 0
    for _ in range(schema[0]):
        count = schema[cursor]
        cursor += 1
        named = {}
        for _ in range(count):
            dtype, ndim = _DTYPES[schema[cursor]], schema[cursor + 1]
            shape = schema[cursor + 2 : cursor + 2 + ndim]
            cursor += 2 + ndim
            numel = 1
            for dim in shape:
                numel *= dim
            num_bytes = numel * torch.empty(0, dtype=dtype).element_size()
            raw = payload[offset : offset + num_bytes].clone()
            named[names[name_index]] = raw.view(dtype).reshape(shape)
            offset += num_bytes
            name_index += 1
        groups.append(named)
    return groups


def broadcast_micro_batches(
    micro_batches: list[MicroBatch], *, device: torch.device
) -> list[MicroBatch]:
    """All of rank 0's micro-batches on every rank (world group), tensors on `device`."""
    if dist.get_world_size() == 1:
        return [mb.to(device) for mb in micro_batches]
    flat = [flatten(mb) for mb in micro_batches] if dist.get_rank() == 0 else None
    return [unflatten(named) for named in broadcast_named_tensors(flat, device=device)]


def dp_share(num_micro_batches: int, *, dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the micro-batches data-parallel replica `dp_rank` runs (i % dp_size)."""
    return list(range(dp_rank, num_micro_batches, dp_size))


def send_to(tensor: torch.Tensor, dst: int) -> None:
    dist.send(tensor.contiguous(), dst=dst)


def recv_from(
    shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device
) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=src)
    return buffer
