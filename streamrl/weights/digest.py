"""A digest of a bucket's bytes, computed where the tensors are (GPU or CPU), by both ends.

The publisher digests each bucket it sends; the embedded engine digests what it
received (the same tensors, back to back, in the bucket's order) and answers with it.
A mismatch means the bytes changed on the way: the bucket is sent again.

The digest is two sums over the bytes b_i at offsets i, modulo the Mersenne prime
M = 2^61 - 1: S1 = sum b_i and S2 = sum b_i * (i mod 65521 + 1). S2 catches moved or
swapped bytes, S1 changed ones; any single changed byte changes both. It is a
checksum against corruption, not a cryptographic hash. On the device it costs a few
elementwise kernels per 8 MiB chunk (int64 products stay below 2^47 per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MODULUS = (1 << 61) - 1
_PERIOD = 65521
_CHUNK_BYTES = 8 << 20


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The digest of `tensors`' bytes back to back (C order each), as 32 hex digits."""
    plain = weighted = 0
    offset = 0
    for tensor in tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        for start in range(0, data.numel(), _CHUNK_BYTES):
            chunk = data[start : start + _CHUNK_BYTES].to(torch.int64)
            positions = torch.arange(
                offset + start, offset + start + chunk.numel(), device=chunk.device
            )
            weights = positions % _PERIOD + 1
            plain = (plain + int(chunk.sum())) % MODULUS
            weighted = (weighted + int((chunk * weights).sum())) % MODULUS
        offset += data.numel()
    return f"{plain:016x}{weighted:016x}"
