"""A digest of a bucket's bytes, computed where the tensors are (GPU or CPU), by both ends.

The publisher digests each bucket it sends; the embedded engine digests what it
received (the same tensors, back to back, in the bucket's order) and answers with it.
A mismatch means the bytes changed on the way: the bucket is sent again.

The digest is two sums over the bytes b_i at offsets i = 0, 1, ..., modulo the Mersenne
prime M = 2^61 - 1: S1 = sum b_i and S2 = sum (i + 1) b_i. A changed byte changes S1;
two swapped bytes b_p != b_q change S2 by (b_q - b_p)(p - q), which M (a prime larger
than either factor) cannot divide. It is a checksum against corruption, not a
cryptographic hash.

The bytes are read as rows of 256: one matrix product with the columns (1, c) gives each
row r its sum s_r and its moment m_r = sum c b_(r,c), and the offset 256 r + c of a byte
puts sum (i + 1) b_i = sum ((base + 256 r + 1) s_r + m_r). The product runs in float64
(exact: every value stays below 2^24; TF32, which a trainer may switch on, never
applies to it), in chunks of 4 MiB; that is about five times faster on the CPU than
widening every byte to int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MODULUS = (1 << 61) - 1
_ROW = 256
_CHUNK_BYTES = 4 << 20
_columns: dict[torch.device, torch.Tensor] = {}


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The digest of `tensors`' bytes back to back (C order each), as 32 hex digits."""
    plain = weighted = 0
    offset = 0
    for tensor in tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        for start in range(0, data.numel(), _CHUNK_BYTES):
            total, moment = _sums(data[start : start + _CHUNK_BYTES], offset + start)
            plain = (plain + total) % MODULUS
            weighted = (weighted + moment) % MODULUS
        offset += data.numel()
    return f"{plain:016x}{weighted:016x}"


def _sums(chunk: torch.Tensor, base: int) -> tuple[int, int]:
    """sum b_i and sum (base + i + 1) b_i over one chunk's bytes (exact Python ints)."""
    body = chunk.numel() - chunk.numel() % _ROW
    rows = (chunk[:body].view(-1, _ROW).to(torch.float64) @ _unit_and_ramp(chunk.device)).to(
        torch.int64
    )
    sums, moments = rows[:, 0], rows[:, 1]
    starts = torch.arange(len(sums), dtype=torch.int64, device=chunk.device) * _ROW + 1
    total = int(sums.sum())
    moment = base * total + int((starts * sums).sum()) + int(moments.sum())
    tail = chunk[body:].to(torch.int64)  # fewer than 256 bytes
    at = torch.arange(base + body + 1, base + chunk.numel() + 1, device=chunk.device)
    return total + int(tail.sum()), moment + int((tail * at).sum())


def _unit_and_ramp(device: torch.device) -> torch.Tensor:
    """The 256 x 2 float64 columns (1, 1, ...) and (0, 1, ..., 255) on `device`."""
    columns = _columns.get(device)
    if columns is None:
        ramp = torch.arange(_ROW, dtype=torch.float64, device=device)
        columns = _columns[device] = torch.stack([torch.ones_like(ramp), ramp], dim=1)
    return columns
