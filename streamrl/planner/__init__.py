"""The memory planner: each GPU's expected peak for a run config, before anything starts.

`streamrl check` prints it and refuses a config whose GPUs cannot hold it, naming the key to
change. Pure arithmetic on the model's shape (`streamrl.backends.megatron.shapes`) and the
config; no torch unless the GPU's size is read from the device. Terms, each a named function
with its formula: `learner.py` (weights, gradients, optimizer state, activations, logits),
`engine.py` (weights, KV cache); `plan.py` puts them together per process, `fit.py` per
GPU, `report.py` prints them. docs/memory.md says what each term counts and how it is
compared with a measured peak.
"""

from __future__ import annotations

from streamrl.planner.fit import plan_memory
from streamrl.planner.plan import GpuPlan, MemoryPlan, Usage

__all__ = ["GpuPlan", "MemoryPlan", "Usage", "plan_memory"]
