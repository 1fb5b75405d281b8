"""SwiGLU for the Megatron learner on CUDA as two hand-written Triton kernels.

megatron-core applies SwiGLU to the fused gate/up projection [tokens, 2 F] through
`fused_bias_swiglu.SwiGLUFunction`, whose forward and backward are torch.compile'd
functions (`swiglu`, `swiglu_back`: a chunk, SiLU, products, and a `cat` of the two
gradients). On the H200 at Qwen2-1.5B's width (F = 8,960) with 32,768-token micro-batches
those kernels moved their bytes at about 1.4 TB/s forward and 0.8 TB/s backward, and took
17% of the learner's step (`bench/results/gpu/megatron_profile_h200x1_affefd6.json`).

Here each program reads one row's block of gate and up columns and writes its block of
the output (forward) or of both gradients (backward): the same formulas, in float32,
rounded once to the tensor's dtype. `use(on)` routes megatron-core's SwiGLU through them
(`SwiGLUFunction` is looked up by name at each call) while `on`, for the learner built
last in the process, as `speed.compiled_rope` does for RoPE; Megatron's own function
serves whatever these kernels do not take (fp8 input store, CPU offload, a tensor off
CUDA), and all of it where a start-up check (`agrees`) finds them wrong on the device.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

BLOCK = 1024  # columns per program


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(y_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        at = y_ptr + row * 2 * width + cols
        gate = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(at + width, mask=inside, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def backward(grad_ptr, y_ptr, dy_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        grad = tl.load(grad_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        at = y_ptr + row * 2 * width + cols
        gate = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(at + width, mask=inside, other=0.0).to(tl.float32)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        d_gate = grad * sigmoid * (1.0 + gate * (1.0 - sigmoid)) * up
        d_up = grad * gate * sigmoid
        dtype = dy_ptr.dtype.element_ty
        to = dy_ptr + row * 2 * width + cols
        tl.store(to, d_gate.to(dtype), mask=inside)
        tl.store(to + width, d_up.to(dtype), mask=inside)

    return forward, backward


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous ``y`` [rows, 2 F] = [gate | up]: [rows, F]."""
    rows, double = y.shape
    width = double // 2
    out = y.new_empty(rows, width)
    _kernels()[0][(rows, triton_cdiv(width))](y, out, width, BLOCK=BLOCK)
    return out


def swiglu_back(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu` at ``y`` for the output gradient ``grad``: [rows, 2 F]."""
    rows, double = y.shape
    grad = grad.contiguous()
    dy = torch.empty_like(y)
    _kernels()[1][(rows, triton_cdiv(double // 2))](grad, y, dy, double // 2, BLOCK=BLOCK)
    return dy


def triton_cdiv(width: int) -> int:
    return -(-width // BLOCK)


class TritonSwiGLU(torch.autograd.Function):
    """`SwiGLUFunction`'s contract (input [rows, 2 F], then its two flags) on these kernels."""

    @staticmethod
    def forward(ctx, input, fp8_input_store, cpu_offload_input):
        ctx.save_for_backward(input)
        return swiglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return swiglu_back(grad_output, input), None, None


_STATE: dict[str, object] = {"on": False}


def use(on: bool) -> None:
    """Route megatron-core's bias-free SwiGLU through `TritonSwiGLU` while ``on``."""
    from megatron.core.fusions import fused_bias_swiglu

    _STATE["on"] = on
    if "megatron" in _STATE:
        return
    megatron_function = fused_bias_swiglu.SwiGLUFunction

    class SwiGLUDispatch:
        """Stands in for `fused_bias_swiglu.SwiGLUFunction` (its one use is `.apply`)."""

        @staticmethod
        def apply(input, fp8_input_store=False, cpu_offload_input=False):
            takes = (
                _STATE["on"]
                and input.is_cuda
                and input.is_contiguous()
                and not fp8_input_store
                and not cpu_offload_input
            )
            function = TritonSwiGLU if takes else megatron_function
            return function.apply(input, fp8_input_store, cpu_offload_input)

    _STATE["megatron"] = megatron_function
    fused_bias_swiglu.SwiGLUFunction = SwiGLUDispatch


def in_use() -> bool:
    """Whether megatron-core's SwiGLU runs on these kernels now (`use`)."""
    return bool(_STATE["on"])


@functools.cache
def agrees(device: torch.device) -> bool:
    """Whether the kernels compute megatron-core's SwiGLU and its gradient on ``device``
    (checked once per process on bf16 rows against the float32 formulas, within a bf16 ulp
    of the size of their terms). The learner uses them only where they do: a wrong gradient
    would train on without an error."""
    generator = torch.Generator(device=device).manual_seed(0)
    y = (3 * torch.randn(64, 2 * 1500, device=device, generator=generator)).bfloat16()
    grad = torch.randn(64, 1500, device=device, generator=generator).bfloat16()
    try:
        out, dy = swiglu(y), swiglu_back(grad, y)
    except Exception as error:  # a Triton that cannot build them here: Megatron's serve
        logger.warning("the Triton SwiGLU failed on %s (%r): using megatron-core's", device, error)
        return False
    gate, up = y.float().chunk(2, -1)
    g = grad.float()
    sigmoid = torch.sigmoid(gate)
    want = gate * sigmoid * up
    want_dy = torch.cat((g * sigmoid * (1 + gate * (1 - sigmoid)) * up, g * gate * sigmoid), -1)
    size = torch.cat(
        ((g * sigmoid * up).abs() * (1 + (gate * (1 - sigmoid)).abs()), (g * gate * sigmoid).abs()),
        -1,
    )
    ulp = 2.0**-7
    good = bool(
        ((out.float() - want).abs() <= ulp * want.abs()).all()
        and ((dy.float() - want_dy).abs() <= ulp * size).all()
    )
    if good:
        logger.info("the Triton SwiGLU agrees with megatron-core's formulas on %s", device)
    else:
        logger.warning("the Triton SwiGLU disagrees on %s: using megatron-core's", device)
    return good
