"""A digest of a bucket's bytes, computed where the tensors are (GPU or CPU), by both ends.

The publisher digests each bucket it sends; the embedded engine digests what it
received (the same tensors, back to back, in the bucket's order) and answers with it.
A mismatch means the bytes changed on the way: the bucket is sent again.

The digest reads the bytes as 16-bit words w_j (little-endian, signed; an odd last byte
is padded with a zero) at word offsets j = 0, 1, ..., and takes two sums modulo the
Mersenne prime M = 2^61 - 1: S1 = sum w_j and S2 = sum (j + 1) w_j. A changed word
changes S1; two swapped words w_p != w_q change S2 by (w_q - w_p)(p - q), which M (a
prime larger than either factor) cannot divide. It is a checksum against corruption,
not a cryptographic hash.

Words rather than bytes halve the elements read, and every float and integer weight of
two bytes or more is a whole number of words, so a tensor is read in place.

On a GPU (with Triton) one kernel reads each word once: a program per span of 2^20 words
keeps per-lane int64 sums of w and of (local offset + 1) w, exact (a span's moment stays
below 2^54), and writes the span's two numbers. Elsewhere the words
are read in chunks, each as rows of 256: row r's sum s_r and its moment
m_r = sum c w_(r,c) are one float64 matrix product with the columns (1, c) (exact:
|m_r| < 2^31), then a chunk's sum of s_r and its local moment
sum ((256 r + 1) s_r + m_r) are exact int64 (below 2^61 for a chunk of 2^15 rows); a chunk
at word offset `base` adds base * (its sum) to S2. Every span's or chunk's two numbers stay
on the device until the end: one host synchronisation per call.

A tensor of an odd number of bytes (int8, bool) puts the words after it off the
tensors' own alignment: those tensors are joined into one copy and read from there.

Tensors that lie back to back in one storage (the views of a flattened bucket, as an engine
unpacks one) are read as one run: a kernel launch per bucket, not per tensor. On an H200,
beside 32 requests generating, an engine's digest of a 0.5B model's 290 views took 56 ms a
push one launch per view, and 5.5-12 ms read as one run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

MODULUS = (1 << 61) - 1
_ROW = 256
_CHUNK_WORDS = {"cpu": 1 << 21, "cuda": 1 << 23}
"""Words per chunk: 4 MiB on the CPU, 16 MiB on a GPU (a float64 copy of 64 MiB at a time).
At most 2^23 words (2^15 rows) keep a chunk's local moment below 2^61."""
_SPAN_WORDS = 1 << 20
"""Words per program of the GPU kernel (its local moment stays below 2^54)."""
_TILE_WORDS = 2048
"""Words a program reads at a time."""
_columns: dict[torch.device, torch.Tensor] = {}


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The digest of `tensors`' bytes back to back (C order each), as 32 hex digits."""
    bases: list[int] = []  # per piece (a span or a chunk): its first word's offset
    runs: list[torch.Tensor] = []  # per run of words: [pieces, 2] int64, [sum, local moment]
    offset = 0  # in words
    for words in _word_runs(tensors):
        if _uses_kernel(words):
            pairs = _span_sums(words)
            bases.extend(offset + i * _SPAN_WORDS for i in range(len(pairs)))
        else:
            chunk_words = _CHUNK_WORDS.get(words.device.type, _CHUNK_WORDS["cpu"])
            starts = range(0, words.numel(), chunk_words)
            pairs = torch.stack([_chunk_sums(words[i : i + chunk_words]) for i in starts])
            bases.extend(offset + start for start in starts)
        runs.append(pairs)
        offset += words.numel()
    plain = weighted = 0
    for (total, moment), base in zip(_read_back(runs), bases, strict=True):
        plain = (plain + total) % MODULUS
        weighted = (weighted + base * total + moment) % MODULUS
    return f"{plain:016x}{weighted:016x}"


def _read_back(runs: list[torch.Tensor]) -> list[list[int]]:
    """Every run's pairs as Python ints, in stream order: one transfer (and host
    synchronisation) per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, pairs in enumerate(runs):
        by_device.setdefault(pairs.device, []).append(index)
    host: dict[int, list[list[int]]] = {}
    for indices in by_device.values():
        values = torch.cat([runs[i] for i in indices]).tolist()
        for i in indices:
            host[i], values = values[: len(runs[i])], values[len(runs[i]) :]
    return [pair for index in range(len(runs)) for pair in host[index]]


def _word_runs(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The bytes of `tensors`, back to back, as int16 word tensors: each tensor in place
    while the stream stays on a word boundary; from a tensor of an odd byte count on, one
    joined copy until a tensor ends on a word boundary again (or the stream ends, padded
    with a zero byte)."""
    pending: list[torch.Tensor] = []
    for data in _byte_runs(tensors):
        if not pending and data.numel() % 2 == 0:
            yield data.view(torch.int16)
            continue
        pending.append(data)
        if sum(part.numel() for part in pending) % 2 == 0:
            yield torch.cat(pending).view(torch.int16)
            pending = []
    if pending:
        last = torch.zeros(1, dtype=torch.uint8, device=pending[-1].device)
        yield torch.cat([*pending, last]).view(torch.int16)


def _byte_runs(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The bytes of `tensors` as flat uint8 tensors, in order, each stretch of tensors that
    follow one another in one storage as a single view over the stretch (empty tensors,
    which add no bytes, left out)."""
    run: torch.Tensor | None = None
    for tensor in tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if data.numel() == 0:
            continue
        if run is not None and _follows(run, data):
            run = run.as_strided((run.numel() + data.numel(),), (1,))
            continue
        if run is not None:
            yield run
        run = data
    if run is not None:
        yield run


def _follows(run: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether `data`'s bytes start where `run`'s end, in the same storage."""
    if data.device != run.device:
        return False
    same = data.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()
    return same and data.data_ptr() == run.data_ptr() + run.numel()


def _chunk_sums(words: torch.Tensor) -> torch.Tensor:
    """[sum w_j, sum (j + 1) w_j] over one chunk's words, j counted from the chunk's start,
    as an int64 tensor on the chunk's device (nothing is read back here)."""
    body = words.numel() - words.numel() % _ROW
    rows = words[:body].view(-1, _ROW)
    both = (rows.to(torch.float64) @ _unit_and_ramp(words.device)).to(torch.int64)
    row_sums, row_moments = both[:, 0], both[:, 1]
    starts = torch.arange(len(row_sums), dtype=torch.int64, device=words.device) * _ROW + 1
    tail = words[body:].to(torch.int64)  # fewer than 256 words
    at = torch.arange(body + 1, words.numel() + 1, dtype=torch.int64, device=words.device)
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


def _uses_kernel(words: torch.Tensor) -> bool:
    return words.device.type == "cuda" and _span_kernel() is not None


def _span_sums(words: torch.Tensor) -> torch.Tensor:
    """[spans, 2] int64 on the words' GPU: per span of `_SPAN_WORDS` words, [sum w_j,
    sum (j + 1) w_j] with j counted from the span's start; one kernel launch."""
    spans = max(1, -(-words.numel() // _SPAN_WORDS))
    out = torch.empty((spans, 2), dtype=torch.int64, device=words.device)
    device = torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext()
    with device:
        _span_kernel()[(spans,)](words, out, words.numel(), _SPAN_WORDS, _TILE_WORDS)
    return out


def build_kernel(device: torch.device | str) -> bool:
    """Compile the GPU kernel for `device` now, for both of Triton's specialisations of a word
    count (a multiple of 16 and not), so that a run's first digest does not: the first
    compile on a machine took 2.7 s on an H200, in a thread that holds the GIL beside
    training or generation. False where no kernel serves (the CPU, or no Triton)."""
    device = torch.device(device)
    if device.type != "cuda" or _span_kernel() is None:
        return False
    for count in (_TILE_WORDS, _TILE_WORDS + 1):
        _span_sums(torch.zeros(count, dtype=torch.int16, device=device))
    torch.cuda.synchronize(device)
    return True


_kernel: list = []


def _span_kernel():
    """The Triton kernel of `_span_sums`, or None where Triton is missing (torch then does it)."""
    if not _kernel:
        _kernel.append(_build_span_kernel())
    return _kernel[0]


def _build_span_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def span_sums(words, out, n, SPAN: tl.constexpr, TILE: tl.constexpr):
        span = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, TILE).to(tl.int64)
        total = tl.zeros([TILE], dtype=tl.int64)
        moment = tl.zeros([TILE], dtype=tl.int64)
        for start in range(0, SPAN, TILE):
            local = start + lanes
            at = span * SPAN + local
            word = tl.load(words + at, mask=at < n, other=0).to(tl.int64)
            total += word
            moment += (local + 1) * word
        tl.store(out + span * 2, tl.sum(total, axis=0))
        tl.store(out + span * 2 + 1, tl.sum(moment, axis=0))

    return span_sums
