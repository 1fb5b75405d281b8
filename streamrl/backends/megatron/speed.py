"""What makes a Megatron learner step faster without Transformer Engine or Apex.

Without either, megatron-core 0.16.1 falls back to plain torch in three places that
cost time at every step; each replacement here computes the same values:

- `learner.megatron.compile` (`use_compile`): torch.compile'd kernels for the
  elementwise work (the vocabulary log-softmax in `logprobs.py`, the SwiGLU through
  Megatron's `bias_activation_fusion`, which Megatron compiles with torch.compile, and
  RoPE through `compiled_rope`); off, Megatron's own torch.compile of the routers' expert
  bias update runs eager too (`compiled_expert_bias`).
- `use_fused_adam`: Megatron builds `torch.optim.AdamW` with torch's default, the
  foreach implementation (about ten passes over every fp32 state tensor); the fused
  one makes one.
- `install_foreach_grad_norm`: Megatron's fallback gradient norm computes one norm
  per tensor and reads each back to the host (one device synchronisation per
  parameter tensor, 290 of them at Qwen2-0.5B), and its fallback scaling (gradient
  clipping, main-to-model copies) runs two kernels per tensor. The replacements use
  torch's foreach kernels: one launch over all tensors, one synchronisation per step.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports: the learner's hand-written kernels (`swiglu`, `rope`,
    `logprob_kernels`) also need a CUDA device, and each its start-up check there."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def compile_works(device_type: str) -> bool:
    """Whether a small torch.compile'd function runs on `device_type` (a C compiler and,
    on CUDA, Triton are needed); a failure is logged once."""
    try:
        fn = torch.compile(lambda x: torch.nn.functional.silu(x) * x, dynamic=False)
        fn(torch.ones(8, device=device_type))
    except Exception as exc:  # any compiler failure: fall back to the plain kernels
        log.warning("torch.compile does not work on %s (%s): plain kernels", device_type, exc)
        return False
    return True


def use_compile(setting: str, device: torch.device) -> bool:
    """`learner.megatron.compile` for this learner: `auto` is on with CUDA (when a probe
    compilation works there) and off on CPU; `on` and `off` are taken as they are."""
    if setting == "auto":
        return device.type == "cuda" and compile_works(device.type)
    return setting == "on"


def use_fused_adam(optimizer) -> int:
    """Switch every torch Adam/AdamW inside a Megatron optimizer (chained or not) to torch's
    fused implementation, before its first step; returns how many were switched. Its step
    counters then live on the parameters' device (torch creates them so at the first step,
    and moves them so when a checkpoint loads)."""
    switched = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        if any(inner.state.values()):
            raise RuntimeError("use_fused_adam after the optimizer's first step")
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's `multi_tensor_l2norm` contract: ([1] fp32 norm of all tensors, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Megatron's `multi_tensor_scale` contract: dst = src * scale for each pair."""
    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def install_foreach_grad_norm() -> bool:
    """Replace megatron-core's per-tensor fallbacks (used when neither Transformer Engine nor
    Apex is installed) by foreach ones; returns whether it did (idempotent, and a no-op when
    Megatron found a fused implementation)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _foreach_scale
    return clip_grads.l2_norm_impl is _foreach_l2_norm


_ROPE: dict[str, object] = {"on": False, "kernels": False}


def compiled_rope(on: bool, *, kernels: bool = False) -> None:
    """Megatron's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`, which its attention
    calls for every query and key: a cos, a sin, a rotate-half `cat`, two products and a sum,
    each its own kernel, and as many in the backward) run torch.compile'd, as one kernel each
    way, while `on`; with `kernels` too, the calls that `rope.takes` go to its hand-written
    Triton kernels instead (Transformer Engine's fused RoPE does the same work). The function
    is module-wide in megatron-core, so the replacement dispatches on the latest learner built
    in this process: each backend calls this with its own `learner.megatron.compile`."""
    from megatron.core.models.common.embeddings import rope_utils

    from streamrl.backends.megatron import rope

    _ROPE["on"], _ROPE["kernels"] = on, on and kernels
    if "eager" in _ROPE:
        return
    eager = rope_utils._apply_rotary_pos_emb_bshd
    compiled = torch.compile(eager, dynamic=True)

    @functools.wraps(eager)
    def apply(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if _ROPE["kernels"] and rope.takes(
            t, freqs, interleaved=rotary_interleaved, mla=multi_latent_attention
        ):
            return rope.apply(t, freqs, mscale)
        function = compiled if _ROPE["on"] else eager
        return function(t, freqs, rotary_interleaved, multi_latent_attention, mscale)

    _ROPE["eager"] = eager
    rope_utils._apply_rotary_pos_emb_bshd = apply


def rope_compiled() -> bool:
    """Whether Megatron's RoPE runs compiled now (`compiled_rope`)."""
    return bool(_ROPE["on"])


def rope_kernels() -> bool:
    """Whether Megatron's RoPE runs on the Triton kernels where they take it (`compiled_rope`)."""
    return bool(_ROPE["kernels"])


_EXPERT_BIAS: dict[str, object] = {"on": False}


def compiled_expert_bias(on: bool) -> None:
    """megatron-core compiles the sigmoid routers' count of tokens per expert
    (`TopKRouter._apply_expert_bias`, one in-place add) with torch.compile itself (its
    `jit_fuser`). Compiled as a method, it is traced again for each router it meets (every MoE
    layer's is another `self`) until dynamo's recompile limit, about a CPU-second each; while
    not `on` the eager method runs instead, with the same counts. Module-wide like
    `compiled_rope`: it dispatches on the latest learner built in this process."""
    from megatron.core.transformer.moe.router import TopKRouter

    _EXPERT_BIAS["on"] = on
    if "eager" in _EXPERT_BIAS:
        return
    compiled = TopKRouter._apply_expert_bias
    eager = getattr(compiled, "_torchdynamo_orig_callable", compiled)

    @functools.wraps(eager)
    def apply(self, *args, **kwargs):
        return (compiled if _EXPERT_BIAS["on"] else eager)(self, *args, **kwargs)

    _EXPERT_BIAS["eager"] = eager
    TopKRouter._apply_expert_bias = apply
