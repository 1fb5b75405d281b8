"""Every CUDA-only workaround that lets megatron-core 0.16.1 train on CPU (gloo, fp32).

Nothing here runs on a CUDA machine: `cpu_redirect()` is a no-op context when
CUDA is available, and `install_cpu_rng_tracker()` is only called on CPU.
The rest of the package never mentions CUDA workarounds.

Shimmed calls (each one was hit by a CPU train step, or sits on a path we use):

- `torch.cuda.current_device()` (raises on a CPU build) returns 0, and device 0
  is then redirected to CPU (below). Hit by
  `RotaryEmbedding.get_emb` (moves `inv_freq` to the GPU on first forward),
  `_ParamAndGradBuffer.__init__` (DDP grad and param buffers),
  `DistributedOptimizer` (shard buffers), `p2p_communication` (pipeline
  shape exchange), `GlobalMemoryBuffer.get_tensor` (local attention only).
- `torch.cuda.synchronize()` is a no-op (pipeline p2p, parallel_state barriers).
- `torch.cuda.Stream()`, `torch.cuda.current_stream()`, `torch.cuda.stream(s)`
  give a stream that runs nothing asynchronously (`wait_stream`, `record_event`,
  the event's `synchronize` are no-ops): the MoE alltoall token dispatcher
  copies its split sizes to the host on a side stream
  (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`), and the shared experts keep
  a stream for overlap.
- Factory functions and moves with `device="cuda"` / `0` / `Tensor.cuda()`,
  and `torch.device(0)` itself (the YaRN rotary embedding of MLA builds its
  tables under `with torch.device(torch.cuda.current_device())`), land on CPU: `schedules.forward_backward_*` (`total_num_tokens`),
  `FP32Optimizer._scale`, `MixedPrecisionOptimizer.found_inf`,
  `clip_grads.get_grad_norm_fp32` / `clip_grad_by_total_norm_fp32`
  (norm and overflow buffers).
- `torch.distributed.all_to_all_single` gets its split sizes as lists: the
  MoE alltoall dispatcher (expert parallelism) moves them to host numpy arrays
  only when they are CUDA tensors, and gloo's binding refuses CPU tensors.
- `Tensor.type()` answers `torch.cuda.<T>Tensor` for CPU tensors, because
  `DistributedOptimizer` and `Float16OptimizerWithFloat16Params` reject any
  parameter whose type string is not a CUDA one.
- `tensor_parallel.get_cuda_rng_tracker()` becomes a tracker whose `fork()`
  does nothing (CPU has no CUDA RNG state to fork; dropout is 0 in RL), and
  `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state` (used
  by activation recomputation) save and restore the CPU generator instead.

The redirect is a `TorchFunctionMode`, active only inside `cpu_redirect()`;
the backend enters it around each call into Megatron on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_MOVE_METHODS = {torch.Tensor.to, torch.Tensor.cuda}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, int):
        return True  # an ordinal, as torch.cuda.current_device() returns
    if isinstance(device, str | torch.device):
        return torch.device(device).type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrite CUDA devices to CPU in tensor factories and moves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and len(args) == 1 and _is_cuda_device(args[0]):
            return torch.device("cpu")  # `with torch.device(current_device()):` (YaRN RoPE)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is dist.all_to_all_single:
            # The alltoall dispatcher turns its split sizes into host numpy arrays only when
            # they are CUDA tensors; on CPU they stay tensors, which gloo's binding refuses.
            for key in ("output_split_sizes", "input_split_sizes"):
                if isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = kwargs[key].tolist()
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in _MOVE_METHODS and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _current_device() -> int:
    return 0


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class _CpuStream:
    """A CUDA stream stand-in: CPU work is synchronous, so ordering is already right."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = _CpuStream()


@contextlib.contextmanager
def cpu_redirect() -> Iterator[None]:
    """Run Megatron code on CPU: CUDA device requests land on CPU (no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    names = ("current_device", "synchronize", "Stream", "current_stream", "stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *args, **kwargs: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


class _CpuRngTracker:
    """Stands in for CudaRNGStatesTracker on CPU: named states exist, fork is a no-op."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.seeds_.add(seed)
        self.states_[name] = torch.tensor([seed])

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


def install_cpu_rng_tracker() -> None:
    """Replace Megatron's CUDA RNG tracker (and recompute's RNG save/restore) on CPU."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
