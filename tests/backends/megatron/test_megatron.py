"""The megatron backend on CPU: conversion, logprobs against Hugging Face, TP=2 / DP=2 / PP=2 training.

Multi-rank runs are real gloo processes started with
`streamrl.backends.rendezvous.start_ranks` on a free port, running this
file as a script (`python tests/backends/megatron/test_megatron.py worker ...`, the entry and
the fixture in megatron_ranks.py and conftest.py); readiness is the torch.distributed
rendezvous. The two runs (1 rank, 2 ranks) start together in a module fixture and each test
waits for the run it reads.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
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

from streamrl.backends.megatron import convert
from streamrl.backends.megatron.model import shape_from_hf
from streamrl.models import build_random_model, random_config

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

TINY_SHAPES = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")
MODEL_NAMES = (*TINY_SHAPES, "llama-tiny-llama3-rope")
NUM_STEPS = 4
RUN_TIMEOUT_S = 240.0


# ---------------------------------------------------------------- models


def _hf_model(name: str):
    """A seeded random tiny model; `llama-tiny-llama3-rope` adds Llama 3.1 RoPE scaling."""
    if name == "llama-tiny-llama3-rope":
        from transformers import AutoModelForCausalLM

        config = random_config("llama-tiny")
        config.rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return build_random_model(name, seed=0)


def _saved_state(model) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes (a tied lm_head is not one of them)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


# ---------------------------------------------------------------- workers (run as a script)


def _train(backend, micro_batches) -> list[dict[str, float]]:
    return [
        backend.train_mini_batch(micro_batches, nll_loss, temperature=1.0, need_entropy=True)
        for _ in range(NUM_STEPS)
    ]


def _worker_single(out: Path, dirs_json: str) -> None:
    """One rank: logprobs of every tiny architecture; Qwen3 training, reference, save/load."""
    from streamrl.backends.megatron.backend import MegatronBackend

    results: dict = {"logprobs": {}}
    for name, path in json.loads(dirs_json).items():
        backend = MegatronBackend(
            path, learner_config(), device="cpu", dtype=torch.float32,
            need_reference=name == "qwen3-tiny", seed=0,
        )  # fmt: skip
        micro_batches = fixed_micro_batches(backend.shape.vocab_size)
        results["logprobs"][name] = backend.compute_logprobs(micro_batches, temperature=1.0)
        if name != "qwen3-tiny":
            continue
        results["tempered"] = backend.compute_logprobs(micro_batches, temperature=0.7)
        results["steps"] = _train(backend, micro_batches)
        results["trained_logprobs"] = backend.compute_logprobs(micro_batches, temperature=1.0)
        results["reference_logprobs"] = backend.compute_logprobs(
            micro_batches, temperature=1.0, reference=True
        )
        backend.stage_checkpoint(out.parent / "reserved", staging="reserve")()
        backend.staging_pool.allocate_pending(60.0)
        backend.save(out.parent / "checkpoint")
        results["reserve"] = (
            (out.parent / "reserved").exists(),
            backend.staging_pool.reserved["policy"][0],
            backend.staging_pool.reuse(),
        )
        after_save = _train(backend, micro_batches)
        backend.load(out.parent / "checkpoint")
        results["resume"] = (after_save, _train(backend, micro_batches))
        results["variants"] = {
            variant: _first_steps(path, micro_batches, **kwargs)
            for variant, kwargs in {
                "local_attention": {"attention": "local"},
                "recompute": {"gradient_checkpointing": True},
                "partial_recompute": {"gradient_checkpointing": True, "recompute_layers": 1},
                "compiled": {"compile": "on"},
                "sequence_major_logits": {"batch_major_logits": False},
            }.items()
        }
        results["logits_view"] = _logits_are_the_output_layers(backend, micro_batches[0])
    torch.save(results, out)


def _logits_are_the_output_layers(backend, micro_batch) -> dict[str, bool]:
    """The model's [B, S, V] logits (B > 1) against the output layer's own result: the same
    memory (GPTModel's transpose-and-copy made no copy), and the same values as the layer
    applied to the sequence-major hidden states it was given."""
    layer = backend.model.output_layer
    seen: dict[str, torch.Tensor] = {}

    def hidden_in(module, args, kwargs):
        seen["hidden"] = args[0]

    def logits_out(module, args, kwargs, output):
        seen["logits"] = output[0]

    handles = (
        layer.register_forward_pre_hook(hidden_in, with_kwargs=True, prepend=True),
        layer.register_forward_hook(logits_out, with_kwargs=True),
    )
    ids = micro_batch.input_ids
    try:
        with torch.no_grad(), backend.megatron_context():
            logits = backend.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    finally:
        for handle in handles:
            handle.remove()
    weight = backend.model.shared_embedding_or_output_weight()
    expected = (seen["hidden"] @ weight.t()).transpose(0, 1)
    return {
        "batch": ids.shape[0] > 1,
        "contiguous": logits.is_contiguous() and logits.shape == expected.shape,
        "same_memory": logits.data_ptr() == seen["logits"].data_ptr(),
        "values": bool(torch.allclose(logits, expected, atol=1e-5)),
    }


def _background_checkpoint(backend, micro_batches, directory: Path):
    """Every rank copies its state, then writes it in a thread while training goes on (the
    two ranks' all-reduces beside the writers' agreement); loading the checkpoint and
    training again repeats the steps taken after the copy."""
    import threading

    import torch.distributed as dist

    path = directory / "dp2-background-checkpoint"
    if dist.get_rank() == 0:
        path.mkdir()
    dist.barrier()
    write = backend.stage_checkpoint(path, staging="host")
    writer = threading.Thread(target=write)
    writer.start()
    after_copy = _train(backend, micro_batches)
    writer.join()
    dist.barrier()
    backend.load(path)
    return after_copy, _train(backend, micro_batches)


def _first_steps(
    path: str, micro_batches, *, attention="sdpa", gradient_checkpointing=False,
    recompute_layers=0, compile="off", batch_major_logits=True,
):  # fmt: skip
    """Two training steps with Megatron's unfused attention, activation recompute (every
    layer, or the first of the model's two), the torch.compile'd kernels (CUDA's default:
    log-softmax and SwiGLU) or the output layer's logits laid out as Megatron lays them
    (sequence-major, then copied batch-major: `model.batch_major_logits`)."""
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.config import LearnerConfig, MegatronConfig

    config = LearnerConfig(
        backend="megatron", lr=1e-3, grad_clip=1.0, gradient_checkpointing=gradient_checkpointing,
        megatron=MegatronConfig(
            attention=attention, compile=compile, recompute_layers=recompute_layers
        ),
    )  # fmt: skip
    backend = MegatronBackend(path, config, device="cpu", dtype=torch.float32, seed=0)
    backend.model.output_layer.batch_major_logits = batch_major_logits
    if recompute_layers:  # the first layer recomputed alone, the second keeping its activations
        assert (backend.model.config.recompute_method, backend.model.config.recompute_num_layers) \
            == ("block", recompute_layers)  # fmt: skip
    return [
        backend.train_mini_batch(micro_batches, nll_loss, temperature=1.0, need_entropy=True)
        for _ in range(2)
    ]


def _worker_two_ranks(out: Path, dirs_json: str) -> None:
    """Two ranks: vocab-parallel logprobs, then TP=2, DP=2 and PP=2 training of Qwen3."""
    import torch.distributed as dist

    from streamrl.backends.megatron.backend import MegatronBackend

    rank = dist.get_rank()
    results: dict = {"vocab_parallel": _check_vocab_parallel()}
    path = json.loads(dirs_json)["qwen3-tiny"]
    for label, (tp, pp) in {"tp2": (2, 1), "dp2": (1, 1), "pp2": (1, 2)}.items():
        backend = MegatronBackend(
            path, learner_config(tp, pp),
            device="cpu", dtype=torch.float32, need_reference=False, seed=0,
        )  # fmt: skip
        micro_batches = fixed_micro_batches(backend.shape.vocab_size) if rank == 0 else []
        run = {"logprobs": backend.compute_logprobs(micro_batches, temperature=1.0)}
        if label == "tp2":
            run["weights_mismatch"] = _weights_mismatch(backend, path)
            run["tempered"] = backend.compute_logprobs(micro_batches, temperature=0.7)
        if label == "pp2":
            run["published"] = _published_by_this_rank(backend, path)
        run["steps"] = _train(backend, micro_batches)
        if label == "pp2":
            run["trained_logprobs"] = backend.compute_logprobs(micro_batches, temperature=1.0)
            backend.save(out.parent / "pp2-checkpoint")
        if label == "dp2":
            run["background"] = _background_checkpoint(backend, micro_batches, out.parent)
        results[label] = run
    torch.save(results, out if rank == 0 else out.parent / f"rank{rank}.pt")


def _weights_mismatch(backend, model_dir: str) -> list[str]:
    """HF names whose gathered tensor differs from the checkpoint (or is missing / extra)."""
    expected = convert.read_hf_state(model_dir)
    published = dict(backend.hf_weights())
    if not backend.is_publisher:
        return []
    bad = sorted(set(expected) ^ set(published))
    bad += [
        name
        for name in expected
        if name in published and not torch.equal(expected[name], published[name])
    ]
    return bad


def _published_by_this_rank(backend, model_dir: str) -> dict[str, bool]:
    """{HF name: equal to the checkpoint} for what this rank's `hf_weights` yields."""
    expected = convert.read_hf_state(model_dir)
    return {name: torch.equal(tensor, expected[name]) for name, tensor in backend.hf_weights()}


def _check_vocab_parallel() -> dict[str, float]:
    """Max |TP=2 - full vocabulary| of logprobs, entropy and their logits gradients."""
    import torch.distributed as dist

    from streamrl.algorithms import entropy_from_logits, logprobs_from_logits
    from streamrl.backends.megatron.logprobs import token_logprobs_and_entropy

    generator = torch.Generator().manual_seed(7)
    vocab, temperature = 1000, 0.8
    logits = torch.randn(3, 9, vocab, generator=generator) * 4
    input_ids = torch.randint(0, vocab, (3, 9), generator=generator)
    mask = torch.ones(3, 9, dtype=torch.int64)
    weights = torch.randn(3, 9, generator=generator)

    full = logits.clone().requires_grad_(True)
    ref_lp = logprobs_from_logits(full, input_ids, temperature=temperature)
    ref_ent = entropy_from_logits(full, temperature=temperature)
    ((ref_lp * weights).sum() + (ref_ent * weights).sum()).backward()

    rank, size = dist.get_rank(), dist.get_world_size()
    width = vocab // size
    local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(
        local, input_ids, mask, vocab_start=rank * width, temperature=temperature,
        group=dist.group.WORLD, need_entropy=True,
    )  # fmt: skip
    ((lp * weights).sum() + (ent * weights).sum()).backward()
    grad_diff = (local.grad - full.grad[..., rank * width : (rank + 1) * width]).abs().max()
    dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)
    return {
        "logprobs": float((lp - ref_lp).abs().max()),
        "entropy": float((ent - ref_ent)[:, 1:].abs().max()),
        "grad": float(grad_diff),
    }


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("megatron-models")
    dirs = {}
    for name in MODEL_NAMES:
        _hf_model(name).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="module")
def runs(rank_runs, model_dirs):
    """The 1-rank run (every tiny model) and the 2-rank run (Qwen3), started together."""
    for mode, world_size, names in (("single", 1, MODEL_NAMES), ("two", 2, ("qwen3-tiny",))):
        dirs_json = json.dumps({name: model_dirs[name] for name in names})
        rank_runs.start(mode, world_size, dirs_json, timeout_s=RUN_TIMEOUT_S)
    return rank_runs


# ---------------------------------------------------------------- conversion (in process)


@pytest.mark.parametrize("tp_size,pp_size", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("name", TINY_SHAPES)
def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(name, tp_size, pp_size):
    model = build_random_model(name, seed=3)
    shape = shape_from_hf(model.config)
    for dtype in (torch.float32, torch.bfloat16):
        hf_state = {k: v.to(dtype) for k, v in _saved_state(model).items()}
        back = {}
        for pp_rank in range(pp_size):
            shards = [
                convert.hf_to_megatron(
                    hf_state, shape, tp_rank=r, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
                )
                for r in range(tp_size)
            ]
            stage = convert.megatron_to_hf(shards, shape, pp_rank=pp_rank, pp_size=pp_size)
            assert not set(stage) & set(back), "two stages exported the same tensor"
            back.update(stage)
        assert set(back) == set(hf_state)
        for key, value in hf_state.items():
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_fused_qkv_interleaves_query_heads_with_their_key_and_value_group():
    shape = shape_from_hf(random_config("qwen3-tiny"))  # 4 heads, 2 groups, head_dim 16
    hd = shape.head_dim
    q = torch.arange(4).repeat_interleave(hd).float()[:, None]  # query head j -> rows of value j
    k = 10 + torch.arange(2).repeat_interleave(hd).float()[:, None]
    v = 20 + torch.arange(2).repeat_interleave(hd).float()[:, None]
    fused = convert.fuse(convert.QKV, [q, k, v], shape)[::hd, 0].tolist()
    assert fused == [0, 1, 10, 20, 2, 3, 11, 21]
    rank1 = convert.shard(convert.QKV, [q, k, v], shape, tp_rank=1, tp_size=2)[::hd, 0].tolist()
    assert rank1 == [2, 3, 11, 21]


def test_gate_and_up_are_stacked_per_tensor_parallel_rank():
    shape = shape_from_hf(random_config("qwen3-tiny"))
    gate, up = torch.zeros(4, 1), torch.ones(4, 1)
    gate[:, 0], up[:, 0] = torch.arange(4.0), 10 + torch.arange(4.0)
    rank0 = convert.shard(convert.GATE_UP, [gate, up], shape, tp_rank=0, tp_size=2)
    assert rank0[:, 0].tolist() == [0, 1, 10, 11]


# ---------------------------------------------------------------- against Hugging Face


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_megatron_logprobs_equal_hugging_face_logprobs(name, runs, model_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
    micro_batches = fixed_micro_batches(hf.config.vocab_size)
    megatron = runs("single")["logprobs"][name]
    for micro_batch, ours in zip(micro_batches, megatron, strict=True):
        expected = hf_token_logprobs(hf, micro_batch)
        assert ours.shape == micro_batch.input_ids.shape
        assert (ours - expected).abs().max() <= 1e-4
        assert torch.all(ours[micro_batch.attention_mask == 0] == 0)


def test_a_tiny_qwen3_trains_with_falling_loss_at_tp1(runs):
    steps = runs("single")["steps"]
    losses = [step["nll"] for step in steps]
    assert all(math.isfinite(loss) for loss in losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert all(math.isfinite(step["entropy"]) and step["entropy"] > 0 for step in steps)
    assert all(step["grad_norm"] > 0 and step["lr"] == pytest.approx(1e-3) for step in steps)


def test_reference_model_stays_frozen_while_the_policy_trains(runs):
    result = runs("single")
    for initial, reference, trained in zip(
        result["logprobs"]["qwen3-tiny"], result["reference_logprobs"], result["trained_logprobs"],
        strict=True,
    ):  # fmt: skip
        assert torch.equal(initial, reference)
        assert (trained - initial).abs().max() > 1e-3


def test_the_logits_are_the_output_layers_own_memory_batch_major(runs):
    """GPTModel's [S, B, V] -> [B, S, V] transpose-and-copy of the logits is a view: the
    output layer computes them batch-major (`model.batch_major_logits`)."""
    assert runs("single")["logits_view"] == {
        "batch": True,
        "contiguous": True,
        "same_memory": True,
        "values": True,
    }


@pytest.mark.parametrize(
    "variant",
    ["local_attention", "recompute", "partial_recompute", "compiled", "sequence_major_logits"],
)
def test_unfused_attention_recompute_and_compiled_kernels_train_like_the_default(runs, variant):
    result = runs("single")
    expected = [step["nll"] for step in result["steps"][:2]]
    assert [step["nll"] for step in result["variants"][variant]] == pytest.approx(
        expected, rel=1e-5
    )


def test_a_reserved_staging_is_what_the_first_checkpoints_copy_takes(runs):
    written, reserved, reuse = runs("single")["reserve"]
    assert not written
    assert reuse.allocated_bytes == 0 and reuse.reused_bytes == reserved > 0


def test_loading_a_checkpoint_resumes_training_exactly(runs):
    after_save, after_load = runs("single")["resume"]
    assert after_save == after_load


# ---------------------------------------------------------------- two ranks


def test_a_checkpoint_written_by_two_ranks_while_they_train_resumes_exactly(runs):
    after_copy, after_load = runs("two")["dp2"]["background"]
    assert after_copy == after_load


def test_tp2_training_matches_tp1_and_logprobs_agree(runs):
    single, two = runs("single"), runs("two")
    for tp1, tp2 in zip(single["logprobs"]["qwen3-tiny"], two["tp2"]["logprobs"], strict=True):
        assert (tp1 - tp2).abs().max() <= 1e-5
    for tp1, tp2 in zip(single["tempered"], two["tp2"]["tempered"], strict=True):
        assert (tp1 - tp2).abs().max() <= 1e-5
    tp1_losses = [s["nll"] for s in single["steps"]]
    tp2_losses = [s["nll"] for s in two["tp2"]["steps"]]
    assert all(b < a for a, b in itertools.pairwise(tp2_losses)), tp2_losses
    # Step 0 sees identical weights; later steps differ by fp32 reduction order (TP all-reduces).
    assert tp2_losses[0] == pytest.approx(tp1_losses[0], abs=1e-5)
    assert tp2_losses == pytest.approx(tp1_losses, rel=1e-3)
    tp1_norms = [s["grad_norm"] for s in single["steps"]]
    assert [s["grad_norm"] for s in two["tp2"]["steps"]] == pytest.approx(tp1_norms, rel=1e-3)


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_data_and_pipeline_parallel_training_match_one_rank(runs, layout):
    """DP=2 sums the two replicas' gradients (not their mean); PP=2 runs 1F1B over gloo."""
    single, two = runs("single"), runs("two")
    for tp1, other in zip(single["logprobs"]["qwen3-tiny"], two[layout]["logprobs"], strict=True):
        assert (tp1 - other).abs().max() <= 1e-5
    tp1_steps, other_steps = single["steps"], two[layout]["steps"]
    for name in ("nll", "entropy", "grad_norm"):
        expected = [s[name] for s in tp1_steps]
        assert [s[name] for s in other_steps] == pytest.approx(expected, rel=1e-4, abs=1e-5), name


def test_vocab_parallel_logprobs_and_entropy_at_tp2_equal_full_vocabulary(runs):
    diffs = runs("two")["vocab_parallel"]
    assert diffs["logprobs"] <= 1e-5 and diffs["entropy"] <= 1e-5 and diffs["grad"] <= 1e-5, diffs


def test_hf_weights_gathered_from_tp2_shards_equal_the_checkpoint(runs):
    assert runs("two")["tp2"]["weights_mismatch"] == []


def test_each_pipeline_stage_publishes_its_own_layers_under_global_names(runs, model_dirs):
    """Stage 0 yields the embedding and layer 0; stage 1 layer 1 and the final norm."""
    stage0 = runs("two")["pp2"]["published"]
    stage1 = torch.load(runs.out_dir("two") / "rank1.pt", weights_only=False)["pp2"]["published"]
    assert not set(stage0) & set(stage1)
    assert all(stage0.values()) and all(stage1.values())
    assert "model.embed_tokens.weight" in stage0 and "model.norm.weight" in stage1
    assert {n.split(".")[2] for n in stage0 if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in stage1 if n.startswith("model.layers.")} == {"1"}
    assert len(stage0) + len(stage1) == len(convert.read_hf_state(model_dirs["qwen3-tiny"]))


def test_a_pipeline_parallel_checkpoint_loads_in_transformers_with_the_same_logprobs(runs):
    from transformers import AutoModelForCausalLM

    result = runs("two")["pp2"]
    checkpoint = runs.out_dir("two") / "pp2-checkpoint"
    assert (checkpoint / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    micro_batches = fixed_micro_batches(hf.config.vocab_size)
    for micro_batch, ours in zip(micro_batches, result["trained_logprobs"], strict=True):
        assert (ours - hf_token_logprobs(hf, micro_batch)).abs().max() <= 1e-4


def test_importing_the_megatron_package_loads_neither_torch_nor_megatron():
    code = (
        "import sys, streamrl.backends.megatron; "
        "print(any(m == 'torch' or m.startswith('megatron') for m in sys.modules))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert output.stdout.strip() == "False"


if __name__ == "__main__":
    worker_main(single=_worker_single, two=_worker_two_ranks)
