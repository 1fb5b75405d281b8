"""Weights handed to an engine on the learner's own device: SGLang's `/update_weights_from_tensor`.

When learner and engine share a GPU, NCCL refuses a group of the two (two
ranks on one device) and gloo goes through host memory (~1 GB/s). Instead the
learner hands the engine CUDA IPC handles of its staging buffers: the engine
maps them and copies the weights into its model, device to device.

    learner: [(name, view of a staging buffer), ...]
             -> ForkingPickler (torch's tensor reductions: IPC handle, offsets, event)
             -> base64 text, one entry per engine GPU      = serialized_named_tensors
    engine:  restricted unpickler -> tensors mapped from the learner's memory -> load

Device numbers differ between processes (each sees its own CUDA_VISIBLE_DEVICES),
so a CUDA tensor travels with its device's UUID instead of its index, and the
receiver maps the UUID back to its own index. SGLang's engines do the same
mapping (`monkey_patch_torch_reductions`); that pairing is not run here
(SGLang cannot be installed on these machines).

CPU tensors travel as named shared-memory files (torch's `file_system`
sharing strategy, which this module switches on in the sending process), so
the same protocol works, and is tested, without a GPU.

The receiver unpickles only torch's tensor and storage rebuilders, storage
classes, dtypes and sizes: a payload naming anything else is refused. The
sender must keep the staging buffers alive and unchanged until the engine has
answered (the publisher does: it reuses them only for the next version).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

_DEVICE_ARG = 6
"""Index of the device in the arguments of torch's `rebuild_cuda_tensor` (torch 2.x)."""


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """`[(name, tensor), ...]` as one entry of `serialized_named_tensors` (base64 text)."""
    if any(tensor.device.type == "cpu" for _, tensor in named):
        torch_mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump([(name, tensor) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry back to `[(name, tensor), ...]`, mapped from the
    sender's memory. Raises `ValueError` on a payload that is not that."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    try:
        named = _Unpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"serialized_named_tensors: {exc}") from None
    if not isinstance(named, list) or not all(
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return named


class _Pickler(ForkingPickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            rebuild, args = reductions.reduce_tensor(obj)
            args = list(args)
            args[_DEVICE_ARG] = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
            return rebuild, tuple(args)
        return NotImplemented


def _rebuild_cuda_tensor(*args):
    """torch's `rebuild_cuda_tensor`, with the device given by UUID (or index)."""
    args = list(args)
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        args[_DEVICE_ARG] = _device_index(device)
    return reductions.rebuild_cuda_tensor(*args)


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise pickle.UnpicklingError(f"no visible CUDA device has UUID {uuid}")


_REBUILDERS = {
    "rebuild_tensor",
    "rebuild_storage_filename",
    "rebuild_storage_empty",
    "rebuild_typed_storage",
    "rebuild_meta_tensor",
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions":
            if name == "rebuild_cuda_tensor":
                return _rebuild_cuda_tensor
            if name in _REBUILDERS:
                return getattr(reductions, name)
        elif module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        elif module == "torch":
            value = getattr(torch, name, None)
            if name in ("Tensor", "Size", "UntypedStorage") or isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")
