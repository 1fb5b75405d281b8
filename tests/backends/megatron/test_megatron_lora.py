"""LoRA on the megatron backend (CPU, gloo): TP = 2 (with and without sequence parallelism)
trains like TP = 1 on the same seed, the adapters are all that trains, publishes and is
saved, peft reads the checkpoint back, and PP = 2 saves the same adapter.

Multi-rank runs are real gloo processes started with `start_ranks`, running this file as a
script (`python tests/backends/megatron/test_megatron_lora.py worker ...`, megatron_ranks.py)
with PYTHONPATH set to this checkout; the runs start together in a module fixture and each
test waits for the one it reads (readiness is the torch.distributed rendezvous).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ranks import (
    fixed_micro_batches,
    hf_token_logprobs,
    learner_config,
    nll_loss,
    worker_main,
)

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

NUM_STEPS = 4
RUN_TIMEOUT_S = 300.0
RANK, ALPHA = 4, 8.0


# ---------------------------------------------------------------- workers (run as a script)


def _config(tp: int = 1, pp: int = 1, *, sequence_parallel: bool = False):
    from streamrl.config import LoraConfig

    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    return learner_config(tp, pp, lr=1e-2, sequence_parallel=sequence_parallel, lora=lora)


def _run(model_dir: str, out_dir: Path, label: str, cfg) -> dict:
    """Train NUM_STEPS steps; logprobs before and after, the reference's, the published
    adapters and the step metrics (complete on rank 0), and a checkpoint."""
    import torch.distributed as dist

    from streamrl.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend(
        model_dir, cfg, device="cpu", dtype=torch.float32, need_reference=True, seed=0
    )
    micro_batches = fixed_micro_batches(backend.shape.vocab_size) if dist.get_rank() == 0 else []
    run = {"initial": backend.compute_logprobs(micro_batches, temperature=1.0)}
    run["steps"] = [
        backend.train_mini_batch(micro_batches, nll_loss, temperature=1.0, need_entropy=True)
        for _ in range(NUM_STEPS)
    ]
    run["trained"] = backend.compute_logprobs(micro_batches, temperature=1.0)
    run["reference"] = backend.compute_logprobs(micro_batches, temperature=1.0, reference=True)
    run["published"] = {name: t.clone() for name, t in backend.hf_weights()}
    run["has_reference_model"] = backend.reference is not None
    run["num_trainable"] = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    backend.save(out_dir / f"{label}-checkpoint")
    if label == "tp1":
        after_save = [_step(backend, micro_batches) for _ in range(2)]
        backend.load(out_dir / f"{label}-checkpoint")
        run["resume"] = (after_save, [_step(backend, micro_batches) for _ in range(2)])
    return run


def _step(backend, micro_batches) -> float:
    metrics = backend.train_mini_batch(micro_batches, nll_loss, temperature=1.0, need_entropy=True)
    return metrics.get("nll", float("nan"))


def _worker_single(out: Path, model_dir: str) -> None:
    torch.save({"tp1": _run(model_dir, out.parent, "tp1", _config())}, out)


def _worker_two(out: Path, model_dir: str) -> None:
    import torch.distributed as dist

    runs = {
        "tp2": _run(model_dir, out.parent, "tp2", _config(2)),
        "tp2_sp": _run(model_dir, out.parent, "tp2_sp", _config(2, sequence_parallel=True)),
        "pp2": _run(model_dir, out.parent, "pp2", _config(1, 2)),
    }
    if dist.get_rank() == 0:
        torch.save(runs, out)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs(rank_runs, tiny_model_dir):
    """The 1-rank and the 2-rank run, started together."""
    for mode, world_size in (("single", 1), ("two", 2)):
        rank_runs.start(mode, world_size, tiny_model_dir, timeout_s=RUN_TIMEOUT_S)
    return rank_runs


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_lora_at_tp2_trains_like_tp1_on_the_same_seed(runs, layout):
    tp1, tp2 = runs("single")["tp1"], runs("two")[layout]
    for one, two in zip(tp1["initial"], tp2["initial"], strict=True):
        assert (one - two).abs().max() <= 1e-5
    for name in ("nll", "entropy", "grad_norm"):
        expected = [step[name] for step in tp1["steps"]]
        got = [step[name] for step in tp2["steps"]]
        print(
            f"{layout} {name}: tp1 {expected} vs {got}, max relative difference "
            f"{max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(expected, got, strict=True)):.2e}"
        )
        assert got == pytest.approx(expected, rel=1e-5), name
    for one, two in zip(tp1["trained"], tp2["trained"], strict=True):
        assert (one - two).abs().max() <= 1e-4


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
def test_the_adapters_published_at_tp2_and_pp2_equal_those_of_tp1(runs, layout):
    tp1, other = runs("single")["tp1"]["published"], runs("two")[layout]["published"]
    if layout == "pp2":  # rank 0 publishes stage 0's layers; stage 1 publishes its own
        assert other and set(other) < set(tp1)
    else:
        assert set(other) == set(tp1)
    # Adam scales every update to ~lr (1e-2): where a gradient is ~0, fp32 reduction order
    # can move an element by a small fraction of one step; 1e-4 is 1% of a step.
    for name, tensor in other.items():
        assert (tensor - tp1[name]).abs().max() <= 1e-4, name


def test_only_the_adapters_train_and_the_reference_is_the_base_with_no_second_model(runs):
    from streamrl.models import random_config

    run = runs("single")["tp1"]
    config = random_config("qwen3-tiny")
    assert run["num_trainable"] == _adapter_elements(config)
    assert not run["has_reference_model"]
    losses = [step["nll"] for step in run["steps"]]
    assert all(math.isfinite(x) for x in losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    for initial, reference, trained in zip(
        run["initial"], run["reference"], run["trained"], strict=True
    ):
        assert torch.equal(initial, reference)
        assert (trained - initial).abs().max() > 1e-3
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in run["published"])


def _adapter_elements(config) -> int:
    """A [r, in] + B [out, r] for the 7 linears of every layer."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv_out, ffn = heads * head_dim, kv * head_dim, config.intermediate_size
    shapes = [(hidden, q), (hidden, kv_out), (hidden, kv_out), (q, hidden)]
    shapes += [(hidden, ffn), (hidden, ffn), (ffn, hidden)]
    return config.num_hidden_layers * sum(RANK * (inp + out) for inp, out in shapes)


def test_the_checkpoint_is_a_peft_adapter_that_peft_runs_as_the_trained_policy(
    runs, tiny_model_dir
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from streamrl.weights import adapters

    checkpoint = runs.out_dir("single") / "tp1-checkpoint"
    files = {p.name for p in checkpoint.iterdir()}
    assert {adapters.CONFIG_FILE, adapters.WEIGHTS_FILE, "optimizer"} <= files
    assert not any(name.startswith("model") for name in files), files
    assert json.loads((checkpoint / adapters.CONFIG_FILE).read_text())["r"] == RANK
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = PeftModel.from_pretrained(base, str(checkpoint)).eval()
    trained = runs("single")["tp1"]["trained"]
    for micro_batch, ours in zip(fixed_micro_batches(base.config.vocab_size), trained, strict=True):
        assert (hf_token_logprobs(policy, micro_batch) - ours).abs().max() <= 1e-4


def test_loading_a_lora_checkpoint_resumes_training_exactly(runs):
    after_save, after_load = runs("single")["tp1"]["resume"]
    assert after_save == after_load


def test_pipeline_stages_save_one_adapter_equal_to_tp1s(runs):
    from streamrl.weights import adapters

    runs("single")
    runs("two")
    _, tp1 = adapters.read_peft_adapter(runs.out_dir("single") / "tp1-checkpoint")
    _, pp2 = adapters.read_peft_adapter(runs.out_dir("two") / "pp2-checkpoint")
    assert set(pp2) == set(tp1)
    for name, tensor in pp2.items():  # tolerance: see the test of published adapters
        assert (tensor - tp1[name]).abs().max() <= 1e-4, name


def test_megatron_lora_refuses_models_whose_linears_it_cannot_hook():
    from streamrl.backends.megatron.lora import check_supported
    from streamrl.backends.megatron.model import shape_from_hf
    from streamrl.models import random_config

    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_supported(shape_from_hf(random_config("qwen3-moe-tiny")))
    check_supported(shape_from_hf(random_config("qwen3-tiny")))


if __name__ == "__main__":
    worker_main(single=_worker_single, two=_worker_two)
