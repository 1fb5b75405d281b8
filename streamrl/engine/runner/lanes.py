"""Static per-lane buffers of the decode step, and their pinned host mirrors.

Decode lane ``i`` is KV slot ``i``. The device buffers are what a captured
CUDA graph reads, so they are allocated once and only ever written in place.
Invariant between uploads: each step advances its own inputs on the device
(``tokens`` := sampled tokens, ``positions`` += active), so consecutive steps
over the same lanes need no host-to-device traffic; the host uploads all lane
state (one copy per dtype) only after the lane set changed.
"""

from __future__ import annotations

import torch

from streamrl.engine.runner.sampling import SamplingTensors
from streamrl.engine.runner.sequence import Sequence

_INT_FIELDS = ("tokens", "positions", "active", "top_k", "seeds")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


class LaneBuffers:
    def __init__(self, num_lanes: int, device: torch.device):
        self.num_lanes = num_lanes
        pin = device.type == "cuda"
        self.ints = torch.zeros(len(_INT_FIELDS), num_lanes, dtype=torch.int64, device=device)
        self.floats = torch.zeros(len(_FLOAT_FIELDS), num_lanes, dtype=torch.float32, device=device)
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.int64, pin_memory=pin)
        self.host_floats = torch.zeros(self.floats.shape, dtype=torch.float32, pin_memory=pin)
        for index, name in enumerate(_INT_FIELDS):
            setattr(self, name, self.ints[index])
        for index, name in enumerate(_FLOAT_FIELDS):
            setattr(self, name, self.floats[index])
        self.out_tokens = torch.zeros(num_lanes, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(num_lanes, dtype=torch.float32, device=device)
        # Two host result sets: one being filled by the step in flight, one being read.
        self.host_tokens = [
            torch.zeros(num_lanes, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self.host_logprobs = [
            torch.zeros(num_lanes, dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]

    def upload(self, lanes: list[Sequence]) -> None:
        """Write every lane's state (idle lanes: inactive, greedy) and copy it to the device.

        Precondition: no step that reads these buffers is still pending on the host side
        (the host buffers are reused)."""
        ints = self.host_ints.numpy()
        floats = self.host_floats.numpy()
        ints[:] = 0
        floats[:] = 0.0
        floats[1] = 1.0  # top_p off
        n = len(lanes)
        if n:
            params = [seq.params for seq in lanes]
            ints[0, :n] = [seq.last_token for seq in lanes]
            ints[1, :n] = [seq.num_tokens - 1 for seq in lanes]  # position fed this step
            ints[2, :n] = 1
            ints[3, :n] = [p.top_k for p in params]
            ints[4, :n] = [seq.seed for seq in lanes]
            floats[0, :n] = [p.temperature for p in params]
            floats[1, :n] = [p.top_p for p in params]
            floats[2, :n] = [p.min_p for p in params]
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.floats.copy_(self.host_floats, non_blocking=True)

    def sampling(self, lanes: int) -> SamplingTensors:
        """Views over the first ``lanes`` lanes; counters = tokens before the sampled one."""
        return SamplingTensors(
            temperature=self.temperature[:lanes],
            top_p=self.top_p[:lanes],
            top_k=self.top_k[:lanes],
            min_p=self.min_p[:lanes],
            seeds=self.seeds[:lanes],
            counters=self.positions[:lanes] + 1,
        )
