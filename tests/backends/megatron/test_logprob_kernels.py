"""The Triton kernels of `streamrl.backends.megatron.logprob_kernels` compute what `logprobs`'
plain functions compute (on CUDA, and under Triton's interpreter on CPU wherever Triton is
installed), and `logprobs` takes them only for logits on CUDA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrl.backends.megatron import logprob_kernels, speed
from streamrl.backends.megatron import logprobs as megatron_logprobs


def _assert_kernels_compute_the_plain_functions(device: str, dtype: torch.dtype) -> None:
    """Both kernels against `_row_stats` and `_row_grads` (the gradient's reference in float32,
    unrounded) on rows narrower than a block and spanning several, packed and at a stride wider
    than the row, targets at both ends, scale 1 and 1 / 0.7, with and without entropy. Bounds
    are relative to the size of each value's terms: float32 rounding (sums in another order,
    the hardware's exp, a multiply-add fused or not) for the statistics and a float32
    gradient, one ulp for a bf16 gradient (whichever way the conversion rounds: the
    interpreter truncates)."""
    generator = torch.Generator(device=device).manual_seed(0)
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-16
    for width, padding, scale in ((1, 0, 1.0), (300, 0, 1 / 0.7), (9001, 37, 1 / 0.7)):
        rows = 3
        wide = 4 * torch.randn(rows, width + padding, device=device, generator=generator)
        logits = wide.to(dtype)[:, :width]  # rows at stride width + padding
        index = torch.randint(0, width, (rows,), device=device, generator=generator)
        index[0], index[-1] = 0, width - 1
        per_row = torch.randn(3, rows, device=device, generator=generator)
        x = logits.float() * scale
        for need_entropy in (False, True):
            got = logprob_kernels.row_stats(logits, index, scale, need_entropy)
            want = megatron_logprobs._row_stats(logits, index, scale, need_entropy)
            row_max, picked, sum_exp, weighted = want
            shifted = x - row_max[:, None]
            spread = (shifted.exp() * shifted.abs()).sum(-1)
            sizes = (row_max.abs(), row_max.abs() + picked.abs(), sum_exp, spread)
            for ours, theirs, size in zip(got, want, sizes, strict=True):
                assert ours.dtype == torch.float32 and ours.shape == (rows,)
                assert ((ours - theirs).abs() <= 2.0**-16 * size).all()
            assert torch.equal(got[0], row_max)  # the maximum is exact
            if not need_entropy:
                assert torch.equal(got[3], torch.zeros_like(got[3]))
        log_norm = row_max + sum_exp.log()
        entropy = log_norm - row_max - weighted / sum_exp
        logp = x - log_norm[:, None]
        p = logp.exp()
        for with_entropy in (False, True):
            grad_logprobs = per_row[0, :1].expand(rows) if with_entropy else per_row[0]
            grad_entropy = per_row[2] if with_entropy else None
            args = (index, log_norm, grad_logprobs, per_row[1], entropy, grad_entropy, scale)
            got = logprob_kernels.row_grads(logits, *args)
            want = megatron_logprobs._row_grads(logits.float(), *args)
            size = p * grad_logprobs.abs()[:, None]
            if with_entropy:
                size += p * (logp.abs() + entropy.abs()[:, None]) * grad_entropy.abs()[:, None]
            size.scatter_add_(1, index[:, None], per_row[1].abs()[:, None])
            assert got.dtype == dtype and got.shape == (rows, width) and got.is_contiguous()
            assert ((got.float() - want).abs() <= step * scale * size).all()
            assert (want != 0).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_logprob_kernels_compute_the_plain_functions_on_cuda(dtype):
    if not speed.triton_available():
        pytest.skip("Triton is not installed")
    device = torch.device("cuda", torch.cuda.current_device())
    _assert_kernels_compute_the_plain_functions("cuda", dtype)
    plain = (megatron_logprobs._row_stats, megatron_logprobs._row_grads)
    assert logprob_kernels.agrees(device, *plain)  # the start-up check
    assert megatron_logprobs._kernels(True, device) == (
        logprob_kernels.row_stats,
        logprob_kernels.row_grads,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("need_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_logprobs_on_cuda_equal_the_plain_path_with_their_gradients(dtype, need_entropy):
    """`vocab_parallel_logprobs_and_entropy` forward and backward through the Triton kernels
    (compiled=True on CUDA) against the plain path's (chunked: a chunk of 5 rows)."""
    if not speed.triton_available():
        pytest.skip("Triton is not installed")
    generator = torch.Generator(device="cuda").manual_seed(1)
    batch, seq, vocab = 3, 50, 10_007
    logits = (4 * torch.randn(batch, seq, vocab, device="cuda", generator=generator)).to(dtype)
    targets = torch.randint(0, vocab, (batch, seq), device="cuda", generator=generator)
    weights = torch.randn(2, batch, seq, device="cuda", generator=generator)
    results = []
    for compiled in (False, True):
        leaf = logits.clone().requires_grad_(True)
        logprobs, entropy = megatron_logprobs.vocab_parallel_logprobs_and_entropy(
            leaf, targets, vocab_start=0, temperature=0.7, need_entropy=need_entropy,
            compiled=compiled,
        )  # fmt: skip
        loss = (logprobs * weights[0]).sum()
        if need_entropy:
            loss = loss + (entropy * weights[1]).sum()
        loss.backward()
        results.append((logprobs, entropy, leaf.grad))
    (plain_lp, plain_entropy, plain_grad), (lp, entropy, grad) = results
    torch.testing.assert_close(lp, plain_lp, rtol=1e-5, atol=1e-4)
    if need_entropy:
        torch.testing.assert_close(entropy, plain_entropy, rtol=1e-5, atol=1e-4)
    assert grad.dtype == dtype and plain_grad.abs().max() > 0.1
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad, plain_grad, rtol=step, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_logprob_kernels_compute_the_plain_functions_under_the_interpreter():
    """The kernels' arithmetic on CPU through Triton's interpreter. TRITON_INTERPRET is read
    when a kernel is defined, so the check runs in a process of its own that has it from the
    start (this process may hold kernels built for a GPU)."""
    here = Path(__file__).parent
    check = (
        "import torch, test_logprob_kernels as t\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    t._assert_kernels_compute_the_plain_functions('cpu', dtype)\n"
        "plain = (t.megatron_logprobs._row_stats, t.megatron_logprobs._row_grads)\n"
        "assert t.logprob_kernels.disagreement('cpu', *plain) is None\n"
    )
    paths = [str(here), *(path for path in sys.path if path)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    if "only 0-dimensional arrays can be converted" in done.stderr:  # seen with Triton 3.6
        pytest.skip("this Triton's interpreter cannot loop to a run-time bound with this NumPy")
    assert done.returncode == 0, done.stderr[-4000:]


def test_logprobs_take_the_triton_kernels_for_cuda_logits_only(monkeypatch):
    """Compiled, CPU logits get the torch.compile'd functions even where Triton would serve
    (it has no CPU path); CUDA logits get the Triton kernels where the start-up check passes,
    the torch.compile'd functions where it fails; not compiled, the plain ones everywhere."""
    agrees = {"cuda": True}
    monkeypatch.setattr(speed, "triton_available", lambda: True)
    monkeypatch.setattr(logprob_kernels, "agrees", lambda device, *plain: agrees[device.type])
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    plain = (megatron_logprobs._row_stats, megatron_logprobs._row_grads)
    triton = (logprob_kernels.row_stats, logprob_kernels.row_grads)
    assert megatron_logprobs._kernels(False, cpu) == plain
    assert megatron_logprobs._kernels(False, cuda) == plain
    compiled = megatron_logprobs._kernels(True, cpu)
    assert compiled == (megatron_logprobs._COMPILED["stats"], megatron_logprobs._COMPILED["grads"])
    assert all(callable(kernel) for kernel in compiled) and compiled != plain
    assert megatron_logprobs._kernels(True, cuda) == triton
    agrees["cuda"] = False
    assert megatron_logprobs._kernels(True, cuda) == compiled
