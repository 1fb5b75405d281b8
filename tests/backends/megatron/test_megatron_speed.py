"""The Megatron learner's speed-ups (`streamrl.backends.megatron.speed`) compute what the paths
they replace compute: fused Adam steps as foreach Adam, the foreach gradient norm and scaling
as megatron-core's per-tensor fallbacks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from streamrl.backends.megatron import speed
from streamrl.backends.megatron.cpu_shims import cpu_redirect

U = 2.0**-24
"""float32 unit roundoff."""


class _MegatronLike:
    """What `use_fused_adam` reads of a Megatron optimizer: the torch optimizer inside."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


def _tensors(seed: int, shapes=((7, 5), (300,), (1,), (4, 4, 4))) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_fused_adam_steps_as_megatrons_foreach_adam():
    """Three AdamW steps on the same gradients: the fused kernel evaluates the same update
    (in another operation order), so parameters agree to a few float32 roundings of the
    parameter and of the step (lr * m / (sqrt(v) + eps) <= lr * ~1) per step."""
    lr, steps = 1e-2, 3
    params = [[t.clone().requires_grad_(True) for t in _tensors(0)] for _ in range(2)]
    foreach = torch.optim.AdamW(params[0], lr=lr, weight_decay=0.1, foreach=True)
    fused = _MegatronLike(torch.optim.AdamW(params[1], lr=lr, weight_decay=0.1, foreach=True))
    assert speed.use_fused_adam(fused) == 1
    assert fused.optimizer.param_groups[0]["fused"] is True
    for step in range(steps):
        for group in params:
            for param, grad in zip(group, _tensors(step + 10), strict=True):
                param.grad = grad.clone()
        foreach.step()
        fused.optimizer.step()
    bound = steps * 8 * U * (max(float(p.abs().max()) for p in params[0]) + lr)
    for a, b in zip(*params, strict=True):
        assert (a - b).abs().max() <= bound
    with pytest.raises(RuntimeError, match="first step"):
        speed.use_fused_adam(fused)


def test_foreach_grad_norm_equals_megatrons_per_tensor_fallback():
    """The norm of all tensors: a sum of N squares in float32 either way, so within N u."""
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    tensors = _tensors(1)
    with cpu_redirect():
        expected, _ = local_multi_tensor_l2_norm(0, None, [tensors], False)
    ours, _ = speed._foreach_l2_norm(0, None, [tensors], False)
    assert ours.shape == expected.shape == (1,) and ours.dtype == torch.float32
    num_elements = sum(t.numel() for t in tensors)
    assert abs(float(ours) - float(expected)) <= num_elements * U * float(expected)

    for same in (True, False):
        sources = _tensors(2)
        targets_ours = sources if same else [torch.zeros_like(t) for t in sources]
        targets_megatron = (
            [t.clone() for t in sources] if same else [torch.zeros_like(t) for t in sources]
        )
        sources_megatron = targets_megatron if same else sources
        local_multi_tensor_scale(0, None, [sources_megatron, targets_megatron], 0.37)
        speed._foreach_scale(0, None, [sources, targets_ours], 0.37)
        for a, b in zip(targets_ours, targets_megatron, strict=True):
            assert torch.equal(a, b)


def test_the_foreach_fallbacks_replace_megatrons_only_where_it_fell_back():
    from megatron.core.optimizer import clip_grads

    assert speed.install_foreach_grad_norm()
    assert clip_grads.l2_norm_impl is speed._foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is speed._foreach_scale
    assert speed.install_foreach_grad_norm()  # idempotent


def test_compile_is_on_with_cuda_and_off_on_cpu_unless_asked():
    cpu = torch.device("cpu")
    assert not speed.use_compile("auto", cpu)
    assert speed.use_compile("on", cpu)
    assert not speed.use_compile("off", torch.device("cuda", 0))


def test_compiled_rope_rotates_queries_and_their_gradients_as_megatrons_own():
    """`compiled_rope(True)` routes megatron-core's RoPE through torch.compile: the same
    values and gradients (float32 on the CPU, a half rotary dimension and a pass-through
    part included) as the eager function, and `compiled_rope(False)` routes back to it."""
    from megatron.core.models.common.embeddings import rope_utils

    generator = torch.Generator().manual_seed(0)
    # [seq, batch, heads, head dim]; RoPE covers 16 of the 24 dims, the rest passes through.
    queries = torch.randn(11, 2, 3, 24, generator=generator)
    freqs = torch.randn(11, 1, 1, 16, generator=generator)
    upstream = torch.randn(11, 2, 3, 24, generator=generator)
    assert queries.abs().max() < 5 and upstream.abs().max() < 5  # the bound below assumes it

    def rotated(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        speed.compiled_rope(compiled)
        assert rope_utils._apply_rotary_pos_emb_bshd is not speed._ROPE["eager"]  # the router
        leaf = queries.clone().requires_grad_(True)
        out = rope_utils._apply_rotary_pos_emb_bshd(leaf, freqs, rotary_interleaved=False)
        (out * upstream).sum().backward()
        return out.detach(), leaf.grad

    try:
        eager_out, eager_grad = rotated(False)
        compiled_out, compiled_grad = rotated(True)
    finally:
        speed.compiled_rope(False)
    assert not speed.rope_compiled()
    assert not torch.equal(eager_out[..., :16], queries[..., :16])  # it rotated something
    assert torch.equal(eager_out[..., 16:], queries[..., 16:])
    # Each output is x cos + rotated(x) sin (and each gradient
    # likewise of the upstream gradient) with |x| < 5: the two compilers' cos and sin may
    # differ by an ulp, then two products and a sum round: a few roundings of 4.
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=8 * U * 4)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0, atol=8 * U * 4)


def test_without_compile_the_routers_expert_bias_counts_tokens_eagerly():
    """`compiled_expert_bias(False)` (the CPU default) runs megatron-core's own torch.compile'd
    `TopKRouter._apply_expert_bias` as the plain method: the unpadded tokens routed to each
    expert are added up, and dynamo traces nothing."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter
    from torch._dynamo.utils import counters

    router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
    routing_map = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    padding = torch.tensor([[False], [False], [True]])  # the third token is padding
    traced = counters["frames"]["total"]
    speed.compiled_expert_bias(False)
    TopKRouter._apply_expert_bias(router, routing_map)
    TopKRouter._apply_expert_bias(router, routing_map, padding_mask=padding)
    assert router.local_tokens_per_expert.tolist() == [2 + 1, 2 + 2, 1 + 1, 1 + 0]
    with torch.no_grad():  # counted only while gradients are on (not in a recompute)
        TopKRouter._apply_expert_bias(router, routing_map)
    assert router.local_tokens_per_expert.tolist() == [3, 4, 2, 1]
    assert counters["frames"]["total"] == traced
    assert TopKRouter._apply_expert_bias.__wrapped__ is speed._EXPERT_BIAS["eager"]


def test_swiglu_dispatch_leaves_what_the_kernels_do_not_take_to_megatron():
    """`swiglu.use(True)` puts the dispatcher in megatron-core's place; a CPU tensor (as an
    fp8 input store or CPU offload would) still goes through Megatron's own function, with
    its values and gradient, and `use(False)` keeps the dispatcher on Megatron's."""
    from megatron.core.fusions import fused_bias_swiglu

    from streamrl.backends.megatron import swiglu

    generator = torch.Generator().manual_seed(0)
    y = torch.randn(5, 2 * 7, generator=generator)
    upstream = torch.randn(5, 7, generator=generator)

    def apply() -> tuple[torch.Tensor, torch.Tensor]:
        leaf = y.clone().requires_grad_(True)
        out = fused_bias_swiglu.bias_swiglu_impl(leaf, None)
        (out * upstream).sum().backward()
        return out.detach(), leaf.grad

    try:
        swiglu.use(True)
        assert fused_bias_swiglu.SwiGLUFunction is not swiglu._STATE["megatron"]
        dispatched = apply()
    finally:
        swiglu.use(False)
    assert not swiglu.in_use()
    gate, up = y.chunk(2, -1)
    sigmoid = torch.sigmoid(gate)
    assert torch.allclose(dispatched[0], gate * sigmoid * up, atol=1e-6)
    want_grad = torch.cat(
        (upstream * sigmoid * (1 + gate * (1 - sigmoid)) * up, upstream * gate * sigmoid), -1
    )
    assert torch.allclose(dispatched[1], want_grad, atol=1e-5)
    assert [torch.equal(a, b) for a, b in zip(dispatched, apply(), strict=True)] == [True, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_swiglu_computes_megatrons_swiglu_and_its_gradient_on_cuda(dtype):
    """The Triton kernels against the float32 formulas of megatron-core's `swiglu` and
    `swiglu_back` on rows of a width that is not a multiple of the block. Both compute in
    float32 (Triton's exp is the hardware's approximate exp2: a few ulps times |x|, |x| < 16
    here) and round once to the dtype: the error bound is relative to the size of the terms
    (1 + gate (1 - sigmoid) cancels near gate = -1.28): 32 float32 ulps of it for float32,
    one bfloat16 ulp (of the value, which the terms bound) for bf16, whichever way the
    conversion rounds (Triton's interpreter truncates)."""
    from streamrl.backends.megatron import swiglu

    if not speed.triton_available():
        pytest.skip("Triton is not installed")
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, width = 300, 1500
    y = (3 * torch.randn(rows, 2 * width, device="cuda", generator=generator)).to(dtype)
    upstream = torch.randn(rows, width, device="cuda", generator=generator).to(dtype)
    leaf = y.clone().requires_grad_(True)
    out = swiglu.TritonSwiGLU.apply(leaf, False, False)
    out.backward(upstream)
    gate, up = y.float().chunk(2, -1)
    sigmoid = torch.sigmoid(gate)
    want = gate * sigmoid * up
    grad = upstream.float()
    want_grad = torch.cat(
        (grad * sigmoid * (1 + gate * (1 - sigmoid)) * up, grad * gate * sigmoid), -1
    )
    size = torch.cat(
        (
            (grad * sigmoid * up).abs() * (1 + (gate * (1 - sigmoid)).abs()),
            (grad * gate * sigmoid).abs(),
        ),
        -1,
    )
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18
    assert out.dtype == leaf.grad.dtype == dtype and y.abs().max() < 16
    assert ((out.float() - want).abs() <= step * want.abs() + 1e-30).all()
    assert ((leaf.grad.float() - want_grad).abs() <= step * size + 1e-30).all()
    assert swiglu.agrees(torch.device("cuda", torch.cuda.current_device()))  # the start-up check


def test_rope_dispatch_leaves_what_the_kernels_do_not_take_to_the_compiled_function():
    """With the Triton kernels on, a call they do not take (a CPU tensor; an interleaved
    layout, MLA's, or a partial rotary dimension likewise) still gets Megatron's rotation."""
    from megatron.core.models.common.embeddings import rope_utils

    from streamrl.backends.megatron import rope

    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(6, 2, 3, 8, generator=generator)
    freqs = torch.randn(6, 1, 1, 8, generator=generator)
    assert not rope.takes(queries, freqs, interleaved=False, mla=False)  # on the CPU
    try:
        speed.compiled_rope(False, kernels=True)
        assert not speed.rope_kernels()  # the kernels come with compile only
        eager = rope_utils._apply_rotary_pos_emb_bshd(queries, freqs)
        speed.compiled_rope(True, kernels=True)
        assert speed.rope_kernels()
        dispatched = rope_utils._apply_rotary_pos_emb_bshd(queries, freqs)
    finally:
        speed.compiled_rope(False)
    assert not speed.rope_kernels()
    torch.testing.assert_close(dispatched, eager, rtol=0, atol=8 * U * 4)
    assert torch.equal(eager, rope.reference(queries, freqs))  # float32: the same products


def test_rope_tables_are_made_once_per_angles_tensor():
    """The cos/sin tables of one angles tensor are reused by every later call (each layer's
    queries and keys), made anew for another tensor or another dtype, or after the angles
    change in place, and equal Megatron's rounding of cos and sin either way."""
    from streamrl.backends.megatron import rope

    freqs = torch.randn(7, 1, 1, 8, generator=torch.Generator().manual_seed(3))
    cos, sin = rope.tables(freqs, torch.bfloat16)
    assert torch.equal(cos, torch.cos(freqs).to(torch.bfloat16).squeeze(2))
    assert torch.equal(sin, torch.sin(freqs).to(torch.bfloat16).squeeze(2))
    again = rope.tables(freqs, torch.bfloat16)
    assert again[0] is cos and again[1] is sin
    assert rope.tables(freqs, torch.float32)[0].dtype == torch.float32
    other = freqs.clone()
    assert rope.tables(other, torch.bfloat16)[0] is not cos
    other.mul_(2)  # changed in place: the kept tables are stale
    doubled = rope.tables(other, torch.bfloat16)[0]
    assert torch.equal(doubled, torch.cos(other).to(torch.bfloat16).squeeze(2))


_ROPE_UNDER_INTERPRETER = """
import torch
from streamrl.backends.megatron import rope

generator = torch.Generator().manual_seed(2)
fused = torch.randn(9, 3, 5, 2 * 96, generator=generator)
positions = torch.arange(9).float()[:, None].expand(9, 3) * 13  # packed rows: [S, B] angles
inverse = 1.0 / 10000 ** (torch.arange(0, 96, 2).float() / 96)
angles = positions[..., None] * inverse
freqs = torch.cat((angles, angles), -1)[:, :, None, :]
x = fused[..., :96]  # strided, as Megatron's queries are
leaf = x.clone().requires_grad_(True)
out = rope.apply(leaf, freqs, 0.5)
upstream = torch.randn(9, 3, 5, 96, generator=generator)
out.backward(upstream)
want = rope.reference(x, freqs, 0.5)
cos, sin = (t.unsqueeze(2) for t in rope.tables(freqs, torch.float32, 0.5))
g1, g2 = upstream.chunk(2, -1)
want_grad = torch.cat((g1 * cos[..., :48] + g2 * sin[..., 48:], g2 * cos[..., 48:] - g1 * sin[..., :48]), -1)
print((out - want).abs().max().item(), (leaf.grad - want_grad).abs().max().item())
print(rope.agrees(torch.device("cpu")))
transposed = rope._rotate
rope._rotate = lambda x, cos, sin, sign: transposed(x, cos, sin, -sign)
rope.agrees.cache_clear()
print(rope.agrees(torch.device("cpu")))
"""


def test_triton_rope_rotates_and_its_check_catches_a_wrong_kernel_under_the_interpreter():
    """Triton's interpreter runs the RoPE kernels on the CPU (where Triton is installed):
    float32 packed rows and a strided input, rotated and back-propagated as the float32
    formulas do (only the fused multiply-adds' rounding differs); the start-up check passes
    them, and fails a kernel that rotates the wrong way."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _ROPE_UNDER_INTERPRETER], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    errors, first, broken = done.stdout.split("\n")[:3]
    assert all(float(error) <= 4e-6 for error in errors.split()), errors
    assert (first, broken) == ("True", "False")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_rope_rotates_megatrons_queries_and_their_gradients_on_cuda(dtype, packed):
    """Megatron's RoPE through the dispatcher with the kernels on, against its eager function:
    a query view of a fused QKV projection ([S, B, heads, 128] of a wider tensor), angles
    shared by the rows or each row's own (packed rows). float32: the same products, up to
    fused multiply-adds; bf16: within one bf16 ulp of the terms (eager rounds each of its
    products and the sum, the kernel once)."""
    from megatron.core.models.common.embeddings import rope_utils

    from streamrl.backends.megatron import rope

    if not speed.triton_available():
        pytest.skip("Triton is not installed")
    generator = torch.Generator(device="cuda").manual_seed(0)
    seq, batch, heads, dim = 300, 3, 12, 128
    fused = torch.randn(seq, batch, heads, 3 * dim, device="cuda", generator=generator)
    x = fused.to(dtype)[..., dim : 2 * dim]
    rows = batch if packed else 1
    positions = torch.randint(0, 4096, (seq, rows), device="cuda", generator=generator).float()
    inverse = 1.0 / 1e6 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    angles = positions[..., None] * inverse
    freqs = torch.cat((angles, angles), -1)[:, :, None, :]
    upstream = torch.randn(seq, batch, heads, dim, device="cuda", generator=generator).to(dtype)

    def rotated(kernels: bool):
        speed.compiled_rope(kernels, kernels=kernels)
        leaf = x.detach().clone().requires_grad_(True)
        out = rope_utils._apply_rotary_pos_emb_bshd(leaf, freqs)
        out.backward(upstream)
        return out.detach(), leaf.grad

    try:
        eager_out, eager_grad = rotated(False)
        out, grad = rotated(True)
    finally:
        speed.compiled_rope(False)
    assert out.is_contiguous() and out.dtype == grad.dtype == dtype
    cos, sin = (t.float().unsqueeze(2) for t in rope.tables(freqs, dtype))
    half = dim // 2
    x1, x2 = x.float().chunk(2, -1)
    g1, g2 = upstream.float().chunk(2, -1)
    size = torch.cat(
        ((x1 * cos[..., :half]).abs() + (x2 * sin[..., :half]).abs(),
         (x2 * cos[..., half:]).abs() + (x1 * sin[..., half:]).abs()), -1,
    )  # fmt: skip
    size_grad = torch.cat(
        ((g1 * cos[..., :half]).abs() + (g2 * sin[..., half:]).abs(),
         (g2 * cos[..., half:]).abs() + (g1 * sin[..., :half]).abs()), -1,
    )  # fmt: skip
    step = 2.0**-7 if dtype == torch.bfloat16 else 4 * U
    assert ((out.float() - eager_out.float()).abs() <= 2 * step * size + 1e-30).all()
    assert ((grad.float() - eager_grad.float()).abs() <= 2 * step * size_grad + 1e-30).all()
    assert not torch.equal(out, x)  # it rotated
    assert rope.agrees(torch.device("cuda", torch.cuda.current_device()))  # the start-up check
