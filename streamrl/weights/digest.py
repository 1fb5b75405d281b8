"""A digest of a bucket's bytes, computed where the tensors are (GPU or CPU), by both ends.

The publisher digests each bucket it sends; the embedded engine digests what it
received (the same tensors, back to back, in the bucket's order) and answers with it.
A mismatch means the bytes changed on the way: the bucket is sent again.

The digest is two sums over the bytes b_i at offsets i = 0, 1, ..., modulo the Mersenne
prime M = 2^61 - 1: S1 = sum b_i and S2 = sum (i + 1) b_i. A changed byte changes S1;
two swapped bytes b_p != b_q change S2 by (b_q - b_p)(p - q), which M (a prime larger
than either factor) cannot divide. It is a checksum against corruption, not a
cryptographic hash.

The bytes are read in chunks, each as rows of 256: row r's sum s_r and its moment
m_r = sum c b_(r,c) give the chunk's sum of s_r and its local moment
sum ((256 r + 1) s_r + m_r), exactly, as int64 on the tensors' device; a chunk at offset
`base` adds base * (its sum) to S2. The rows' sums are one float64 matrix product with
the columns (1, c) on the CPU (exact: every value stays below 2^24; about five times
faster there than widening each byte), and int32 reductions on a GPU (no float64 GEMM
of two columns). Every chunk's two numbers stay on the device until the end: one host
synchronisation per call, not several per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MODULUS = (1 << 61) - 1
_ROW = 256
_CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
"""Bytes per chunk. At 64 MiB a chunk's local moment stays below 2^60 (int64 is exact)."""
_columns: dict[torch.device, torch.Tensor] = {}
_ramps: dict[torch.device, torch.Tensor] = {}


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The digest of `tensors`' bytes back to back (C order each), as 32 hex digits."""
    bases: list[int] = []
    sums: list[torch.Tensor] = []  # per chunk: [its byte sum, its local moment], int64
    offset = 0
    for tensor in tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        chunk_bytes = _CHUNK_BYTES.get(data.device.type, _CHUNK_BYTES["cpu"])
        for start in range(0, data.numel(), chunk_bytes):
            bases.append(offset + start)
            sums.append(_chunk_sums(data[start : start + chunk_bytes]))
        offset += data.numel()
    plain = weighted = 0
    by_device: dict[torch.device, list[int]] = {}
    for index, pair in enumerate(sums):
        by_device.setdefault(pair.device, []).append(index)
    host: dict[int, tuple[int, int]] = {}
    for indices in by_device.values():  # one transfer (and synchronisation) per device
        values = torch.stack([sums[i] for i in indices]).tolist()
        host.update(zip(indices, map(tuple, values), strict=True))
    for index, base in enumerate(bases):
        total, moment = host[index]
        plain = (plain + total) % MODULUS
        weighted = (weighted + base * total + moment) % MODULUS
    return f"{plain:016x}{weighted:016x}"


def _chunk_sums(chunk: torch.Tensor) -> torch.Tensor:
    """[sum b_i, sum (i + 1) b_i] over one chunk's bytes, i counted from the chunk's start,
    as an int64 tensor on the chunk's device (nothing is read back here)."""
    body = chunk.numel() - chunk.numel() % _ROW
    rows = chunk[:body].view(-1, _ROW)
    if chunk.device.type == "cpu":
        both = (rows.to(torch.float64) @ _unit_and_ramp(chunk.device)).to(torch.int64)
        row_sums, row_moments = both[:, 0], both[:, 1]
    else:
        wide = rows.to(torch.int32)
        row_sums = wide.sum(dim=1, dtype=torch.int64)
        row_moments = (wide * _ramp_int32(chunk.device)).sum(dim=1, dtype=torch.int64)
    starts = torch.arange(len(row_sums), dtype=torch.int64, device=chunk.device) * _ROW + 1
    tail = chunk[body:].to(torch.int64)  # fewer than 256 bytes
    at = torch.arange(body + 1, chunk.numel() + 1, dtype=torch.int64, device=chunk.device)
    total = row_sums.sum() + tail.sum()
    moment = (starts * row_sums).sum() + row_moments.sum() + (tail * at).sum()
    return torch.stack([total, moment])


def _unit_and_ramp(device: torch.device) -> torch.Tensor:
    """The 256 x 2 float64 columns (1, 1, ...) and (0, 1, ..., 255) on `device`."""
    columns = _columns.get(device)
    if columns is None:
        ramp = torch.arange(_ROW, dtype=torch.float64, device=device)
        columns = _columns[device] = torch.stack([torch.ones_like(ramp), ramp], dim=1)
    return columns


def _ramp_int32(device: torch.device) -> torch.Tensor:
    """(0, 1, ..., 255) as int32 on `device`."""
    ramp = _ramps.get(device)
    if ramp is None:
        ramp = _ramps[device] = torch.arange(_ROW, dtype=torch.int32, device=device)
    return ramp
