"""The per-row work of `logprobs` on CUDA as two hand-written Triton kernels.

`logprobs` reduces each row of the [rows, V_local] logits to four float32 scalars
(`_row_stats`) and, in the backward, recomputes the row's probabilities to write the
logits' gradient (`_row_grads`). torch.compile'd with dynamic shapes, on an H200 at
Qwen2-1.5B's vocabulary (V = 151,936, 32,768 rows, ~10 GB of bf16 logits) the reduction
took 9.7 ms (about 1 TB/s) and the gradient kernel 25.6 ms (about 0.8 TB/s for 20 GB read
and written), where HBM would allow about 3 and 6 ms: with symbolic shapes inductor
indexes each element through 64-bit divisions and remainders.

Here `row_stats` is one program per row that walks the row in blocks of columns with an
online maximum (the running sums are moved to each new maximum, as in online softmax),
and `row_grads` one program per row and block of columns, as `swiglu`'s kernels are: the
same formulas as `_row_stats` and `_row_grads`, in float32, the gradient rounded once to
the logits' dtype. On that H200 and those logits (torch 2.11, Triton 3.6) they took 2.8 ms
(3.6 TB/s; 3.05 ms with entropy) and 5.0 ms (4.0 TB/s), where a device-to-device copy moved
4.3 TB/s and the torch.compile'd pair took 10.4 and 22.5 ms; the blocks and warps are the
best of a sweep there. `logprobs` uses them where a start-up check (`agrees`) finds them
right on the device, the torch.compile'd functions elsewhere.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

STATS_BLOCK = 4096  # columns per step of a row_stats program (4 warps)
GRADS_BLOCK = 2048  # columns per row_grads program (4 warps)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats(
        x_ptr, index_ptr, out_ptr, rows, width, row_stride, scale,
        NEED_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per row, with x = logits * scale: m = max x, s = sum e^(x - m) and
        # w = sum e^(x - m)(x - m), kept for the maximum m of the blocks seen so far. When it
        # moves to m' > m: s' = s e^(m - m'), w' = e^(m - m') (w + (m - m') s).
        row = tl.program_id(0).to(tl.int64)
        start = x_ptr + row * row_stride
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        x = tl.load(start + columns, mask=inside, other=float("-inf")).to(tl.float32) * scale
        m = tl.max(x, axis=0)
        shifted = tl.where(inside, x - m, 0.0)
        e = tl.where(inside, tl.exp(shifted), 0.0)
        s = tl.sum(e, axis=0)
        w = tl.sum(e * shifted, axis=0) if NEED_ENTROPY else 0.0
        for block_start in range(BLOCK, width, BLOCK):
            inside = block_start + columns < width
            at = start + block_start + columns
            x = tl.load(at, mask=inside, other=float("-inf")).to(tl.float32) * scale
            new_m = tl.maximum(m, tl.max(x, axis=0))
            move = m - new_m  # <= 0
            rescale = tl.exp(move)
            shifted = tl.where(inside, x - new_m, 0.0)
            e = tl.where(inside, tl.exp(shifted), 0.0)
            if NEED_ENTROPY:
                w = rescale * (w + move * s) + tl.sum(e * shifted, axis=0)
            s = rescale * s + tl.sum(e, axis=0)
            m = new_m
        target = tl.load(index_ptr + row)
        picked = tl.load(start + target).to(tl.float32) * scale - m
        tl.store(out_ptr + row, m)
        tl.store(out_ptr + rows + row, picked)
        tl.store(out_ptr + 2 * rows + row, s)
        tl.store(out_ptr + 3 * rows + row, w)

    @triton.jit
    def grads(
        x_ptr, index_ptr, log_norm_ptr, grad_logprobs_ptr, target_grad_ptr, entropy_ptr,
        grad_entropy_ptr, grad_ptr, width, row_stride, scale,
        HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # log p = x - log_norm; g = -p grad_lp - p (log p + H) grad_H + [i = y] target_grad,
        # times scale (the derivative of x = logits * scale).
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        x = tl.load(x_ptr + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
        logp = x * scale - tl.load(log_norm_ptr + row)
        p = tl.exp(logp)
        g = p * -tl.load(grad_logprobs_ptr + row)
        if HAS_ENTROPY:
            g -= p * (logp + tl.load(entropy_ptr + row)) * tl.load(grad_entropy_ptr + row)
        target = tl.load(index_ptr + row)
        g = tl.where(columns == target, g + tl.load(target_grad_ptr + row), g) * scale
        to = grad_ptr + row * width + columns
        tl.store(to, g.to(grad_ptr.dtype.element_ty), mask=inside)

    return stats, grads


def _rows_of(logits2d: torch.Tensor) -> torch.Tensor:
    """The logits as the kernels read them: rows at any stride, columns packed."""
    return logits2d if logits2d.stride(-1) == 1 else logits2d.contiguous()


def _per_row(values: torch.Tensor) -> torch.Tensor:
    """A [rows] float32 vector with stride 1 (a loss's gradient may be expanded: stride 0)."""
    return values.to(torch.float32).contiguous()


def row_stats(
    logits2d: torch.Tensor, index: torch.Tensor, scale: float, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs._row_stats`: per row of [rows, V_local] logits, with x = logits * scale and
    m = max x, (m, x_index - m, sum e^(x - m), sum e^(x - m)(x - m)), float32 [rows] each
    (the last zeros without ``need_entropy``)."""
    logits2d = _rows_of(logits2d)
    rows, width = logits2d.shape
    out = logits2d.new_empty((4, rows), dtype=torch.float32)
    if rows:
        _kernels()[0][(rows,)](
            logits2d, index.contiguous(), out, rows, width, logits2d.stride(0), float(scale),
            NEED_ENTROPY=need_entropy, BLOCK=STATS_BLOCK, num_warps=4,
        )  # fmt: skip
    row_max, picked, sum_exp, weighted = out.unbind(0)
    return row_max, picked, sum_exp, weighted


def row_grads(
    logits2d: torch.Tensor,
    index: torch.Tensor,
    log_norm: torch.Tensor,
    grad_logprobs: torch.Tensor,
    target_grad: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """`logprobs._row_grads`: d loss / d logits of [rows, V_local] logits, in their dtype
    (contiguous), from the per-row float32 scalars; ``grad_entropy`` None when the entropy
    feeds no gradient."""
    logits2d = _rows_of(logits2d)
    rows, width = logits2d.shape
    grad = torch.empty((rows, width), dtype=logits2d.dtype, device=logits2d.device)
    has_entropy = grad_entropy is not None
    log_norm = _per_row(log_norm)
    entropy = _per_row(entropy) if has_entropy else log_norm  # unread without entropy
    grad_entropy = _per_row(grad_entropy) if has_entropy else log_norm
    if rows and width:
        _kernels()[1][(rows, -(-width // GRADS_BLOCK))](
            logits2d, index.contiguous(), log_norm, _per_row(grad_logprobs),
            _per_row(target_grad), entropy, grad_entropy, grad, width, logits2d.stride(0),
            float(scale), HAS_ENTROPY=has_entropy, BLOCK=GRADS_BLOCK, num_warps=4,
        )  # fmt: skip
    return grad


def disagreement(device: torch.device | str, stats, grads) -> str | None:
    """What the kernels get wrong on ``device`` against the plain float32 functions ``stats``
    and ``grads`` (`logprobs._row_stats` and `_row_grads`, handed in because `logprobs`
    imports this module) on bf16 rows (a width that is no multiple of either block, rows at
    a stride wider than the row, scale != 1, targets at both ends), or None where they
    agree: the statistics to float32 rounding of the size of their terms (sums of 5,000 in
    another order, the hardware's exp), the gradient within a bf16 ulp of the size of its
    terms."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    rows, width, scale = 16, 5000, 1 / 0.7
    wide = (3 * torch.randn(rows, width + 24, device=device, generator=generator)).bfloat16()
    logits = wide[:, :width]
    index = torch.randint(0, width, (rows,), device=device, generator=generator)
    index[0], index[1] = 0, width - 1
    per_row = torch.randn(4, rows, device=device, generator=generator)
    for need_entropy in (False, True):
        got = row_stats(logits, index, scale, need_entropy)
        want = stats(logits, index, scale, need_entropy)
        shifted = logits.float() * scale - want[0][:, None]
        spread = (shifted.exp() * shifted.abs()).sum(-1)
        sizes = (want[0].abs(), want[0].abs() + want[1].abs(), want[2], spread)
        names = ("max", "picked", "sum", "weighted")
        for name, ours, theirs, size in zip(names, got, want, sizes, strict=True):
            if not ((ours - theirs).abs() <= 2.0**-16 * size).all():
                return f"row_stats' {name} (entropy {need_entropy})"
    log_norm = want[0] + want[2].log()
    entropy = log_norm - want[0] - want[3] / want[2]
    grad_logprobs, target_grad, grad_entropy = per_row[0], per_row[1], per_row[2]
    for with_entropy in (False, True):
        gH = grad_entropy if with_entropy else None
        got = row_grads(logits, index, log_norm, grad_logprobs, target_grad, entropy, gH, scale)
        x = logits.float() * scale
        logp = x - log_norm[:, None]
        p = logp.exp()
        want = grads(
            logits.float(), index, log_norm, grad_logprobs, target_grad, entropy, gH, scale
        )
        size = p * grad_logprobs.abs()[:, None]
        if with_entropy:
            size += p * (logp.abs() + entropy.abs()[:, None]) * grad_entropy.abs()[:, None]
        size.scatter_add_(1, index[:, None], target_grad.abs()[:, None])
        if (
            got.dtype != logits.dtype
            or not ((got.float() - want).abs() <= 2.0**-7 * scale * size + 1e-30).all()
        ):
            return f"row_grads (entropy {with_entropy})"
    return None


@functools.cache
def agrees(device: torch.device, stats, grads) -> bool:
    """Whether the kernels compute the row statistics and gradients of ``stats`` and
    ``grads`` on ``device`` (`disagreement`, checked once per process). `logprobs` uses
    them only where they do: a wrong gradient would train on without an error."""
    try:
        wrong = disagreement(device, stats, grads)
    except Exception as error:  # a Triton that cannot build them here: torch.compile serves
        logger.warning("the Triton logprob kernels failed on %s (%r): compiling", device, error)
        return False
    if wrong is None:
        logger.info("the Triton logprob kernels agree with the float32 formulas on %s", device)
    else:
        logger.warning("the Triton logprob kernels disagree on %s (%s): compiling", device, wrong)
    return wrong is None
