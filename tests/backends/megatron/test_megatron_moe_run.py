"""`streamrl run` trains a tiny Qwen3-MoE end to end: Megatron at EP = 2 (two gloo ranks,
alltoall token dispatcher), the embedded engine serving it through its transformers runner,
weights (every expert, per-expert names) pushed after every step, with routing replay: the
engine's routed experts travel from its /generate answers through the stream to the learner."""

from __future__ import annotations

import json

import pytest
from run_helpers import step_records, streamrl_run, write_config

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow


def test_streamrl_run_trains_a_tiny_qwen3_moe_at_expert_parallel_2_with_routing_replay(tmp_path):
    config = write_config(
        tmp_path, steps=3, eta=1, extra="[algorithm]\nrouting_replay = true\n",
        megatron="expert_model_parallel_size = 2",
    )  # fmt: skip
    text = config.read_text().replace(
        'path = "random:qwen3-tiny"', 'path = "random:qwen3-moe-tiny"'
    )
    config.write_text(text)
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    steps = step_records(out)
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in steps)
    # Same weights on both sides at version 0, then one step apart: the learner's router agrees
    # with the engine's on most choices, and replay covers the reported tokens.
    assert all(0.5 < r["train/moe_router_agreement"] <= 1.0 for r in steps)
    assert all(r["train/moe_replayed_fraction"] > 0.5 for r in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and set(summary["engine_versions"].values()) == {3}
    checkpoint = out / "checkpoints" / "step_000003"
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
