"""The weight-update group: this process is rank 0 (the trainer), a child process rank 1."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from streamrl.engine.weight_sync import (
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
    torch_dtype,
)
from streamrl.launch.process import spawn

_RECEIVER = textwrap.dedent(
    """
    import json, sys
    from streamrl.engine.weight_sync import (
        destroy_weight_update_group, init_weight_update_group, receive_tensors)
    port, group_name, spec_path, out_path = sys.argv[1:5]
    spec = json.load(open(spec_path))
    group = init_weight_update_group(master_address="127.0.0.1", master_port=int(port),
        rank=1, world_size=2, group_name=group_name, backend="gloo", timeout_s=60)
    received = receive_tensors(group, spec["names"], spec["dtypes"], spec["shapes"], "cpu")
    destroy_weight_update_group(group)
    import torch
    torch.save(dict(received), out_path)
    """
)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator),
        "model.norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        # A non-contiguous view: the sender must send its contiguous copy.
        "lm_head.weight": torch.randn(5, 7, generator=generator).t(),
        "scalar_like": torch.tensor([3], dtype=torch.int64),
    }


def _send_to_child(tmp_path, free_port, tensors: dict[str, torch.Tensor], group_name: str) -> dict:
    spec = {
        "names": list(tensors),
        "dtypes": [
            # Exercise both spellings SGLang clients use.
            str(t.dtype) if i % 2 else dtype_name(t.dtype)
            for i, t in enumerate(tensors.values())
        ],
        "shapes": [list(t.shape) for t in tensors.values()],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "receiver.py").write_text(_RECEIVER)
    port = free_port()
    out_path = tmp_path / "received.pt"
    child = spawn(
        "receiver",
        [
            sys.executable,
            str(tmp_path / "receiver.py"),
            str(port),
            group_name,
            str(tmp_path / "spec.json"),
            str(out_path),
        ],
        log_path=tmp_path / "receiver.log",
    )
    try:
        group = init_weight_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name=group_name,
            backend="gloo",
            timeout_s=60,
        )
        broadcast_tensors(group, list(tensors.values()))
        destroy_weight_update_group(group)
        assert child.popen.wait(60) == 0, child.log_tail()
    finally:
        child.stop()
    return torch.load(out_path)


def test_a_broadcast_over_the_named_group_arrives_intact_in_another_process(tmp_path, free_port):
    tensors = _tensors()
    received = _send_to_child(tmp_path, free_port, tensors, "weight_update_group")
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name


def test_the_trainers_own_default_group_does_not_interfere(tmp_path, free_port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        tensors = _tensors()
        received = _send_to_child(tmp_path, free_port, tensors, "wg_beside_default")
        assert all(torch.equal(received[n], t) for n, t in tensors.items())
        # The default group still works and is still the default.
        value = torch.ones(2)
        dist.all_reduce(value)
        assert dist.get_world_size() == 1 and torch.equal(value, torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_a_group_name_can_be_reused_after_destroy(tmp_path, free_port):
    for _ in range(2):
        received = _send_to_child(tmp_path, free_port, {"w": torch.arange(4.0)}, "reused")
        assert torch.equal(received["w"], torch.arange(4.0))


@pytest.mark.parametrize("name", ["bfloat16", "torch.bfloat16", "float32", "torch.float16"])
def test_dtype_names_in_both_spellings_resolve(name):
    assert dtype_name(torch_dtype(name)) == name.removeprefix("torch.")


def test_an_unknown_dtype_name_is_an_error():
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("float33")
