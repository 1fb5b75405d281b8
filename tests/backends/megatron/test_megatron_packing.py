"""Packed rows on the megatron backend equal right-padded rows, on CPU.

The same samples (lengths spread, several per packed row) go through one backend built
from the same seed in each layout; the tests compare per-token log-probabilities, entropy,
the loss, every gradient and the values of a critic. Runs are real gloo processes (this
file as a script, `megatron_ranks.worker_main`): one rank for the dense, MoE (routing
replay), MLA and LoRA models, Megatron's unfused attention and activation recompute; two
ranks for TP = 2 with sequence parallelism and for PP = 2 (critics in the policy's layout
beside the policy at one rank, TP = 2 and PP = 2).

Tolerance: both layouts compute the same float32 sums over other row widths (SDPA's
kernel blocks, the matmuls' tiles), so they differ by rounding only. A log-probability
near -11 (ln of the 49,152-token vocabulary) has a float32 spacing of 1e-6; a few
roundings through two layers stay within 1e-5, and a real mistake (a token that sees
another sample, or RoPE at the row offset) moves values by more than 1e-3. Gradients are
compared relative to the largest: 1e-5 of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ranks import worker_main

from streamrl.types import Sample

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

LOGPROB_TOL = 1e-5
GRAD_REL_TOL = 1e-5
TOKEN_BUDGET = 96
RUN_TIMEOUT_S = 240.0
SINGLE_MODELS = ("qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny")


def _samples(*, num_layers: int = 0, top_k: int = 0, num_experts: int = 0) -> list[Sample]:
    """Ten samples of 2..60 tokens (prompts of 1..12, responses of 1..48 tokens, a fifth of
    them untrained); with `num_layers`, routed experts for every token but the last
    (distinct experts per layer)."""
    rng = np.random.default_rng(5)
    samples = []
    for _ in range(10):
        prompt = int(rng.integers(1, 13))
        response = int(rng.integers(1, 49))
        routed = None
        if num_layers:
            rows = prompt + response - 1
            picks = [rng.permutation(num_experts)[:top_k] for _ in range(rows * num_layers)]
            routed = np.asarray(picks).reshape(rows, num_layers * top_k)
        samples.append(
            Sample(
                prompt_ids=rng.integers(1, 1000, prompt),
                response_ids=rng.integers(1, 1000, response),
                logprobs=-rng.random(response),
                versions=[0] * response,
                loss_mask=(rng.random(response) < 0.8).astype(np.float32),
                routed_experts=routed,
            )
        )
    return samples


def _loss(micro_batch, logprobs, entropy):
    """A policy-gradient loss with an entropy bonus: gradients through both."""

    def mean(values):
        return (values * micro_batch.loss_mask).sum() / micro_batch.num_tokens_in_mini_batch

    value = mean(-logprobs * micro_batch.advantages) - 0.1 * mean(entropy)
    return value, {"loss": value.detach(), "entropy": mean(entropy).detach()}


def _micro_batches(samples, *, packed: bool):
    from streamrl.backends.batching import make_micro_batches, scatter_responses

    advantages = torch.from_numpy(np.random.default_rng(9).standard_normal((len(samples), 64)))
    batches = make_micro_batches(
        samples, list(range(len(samples))), token_budget=TOKEN_BUDGET, pad_id=0, packed=packed
    )
    for batch in batches:
        batch.advantages = scatter_responses(samples, batch, advantages.float())
    return batches


def _layout_run(backend, samples, *, packed: bool) -> dict:
    """One layout's logprobs (and critic values), a training step's metrics and gradients."""
    from streamrl.backends.batching import gather_responses, token_counts

    batches = _micro_batches(samples, packed=packed) if backend.is_data_rank else []
    result = {"tokens": token_counts(batches)}
    logprobs = backend.compute_logprobs(batches, temperature=0.8)
    if backend.is_data_rank:
        result["logprobs"] = gather_responses(samples, batches, logprobs)
    if backend.critic is not None:
        values = backend.critic.compute_values(batches)
        if backend.is_data_rank:
            result["values"] = gather_responses(samples, batches, values)
    result["step"] = backend.train_mini_batch(batches, _loss, temperature=0.8, need_entropy=True)
    result["grads"] = {
        name: parameter.main_grad.detach().clone()
        for name, parameter in backend.model.named_parameters()
        if parameter.requires_grad
    }
    return result


def _compare(path: str, samples, *, learner=None, algorithm=None, critic=False) -> dict:
    """Both layouts through one backend, padded first. Its learning rate (1e-12) moves no
    float32 weight, so the packed step starts from the same weights. Gradients are reduced
    to the largest difference and the largest gradient over every rank of the run."""
    import torch.distributed as dist

    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.config import AlgorithmConfig, LearnerConfig, MegatronConfig

    learner = dict(learner or {})
    megatron = MegatronConfig(**learner.pop("megatron", {}))
    config = LearnerConfig(
        backend="megatron", lr=1e-12, grad_clip=0.0, megatron=megatron, **learner
    )
    backend = MegatronBackend(
        path, config, algorithm_cfg=AlgorithmConfig(**(algorithm or {})), device="cpu",
        dtype=torch.float32, seed=0, critic_path=path if critic else None,
    )  # fmt: skip
    if critic and backend.layout.is_last_stage:  # a head that gives values other than 0
        with torch.no_grad():
            backend.critic.model.output_layer.weight.normal_(
                generator=torch.Generator().manual_seed(3)
            )
    padded = _layout_run(backend, samples, packed=False)
    packed = _layout_run(backend, samples, packed=True)
    largest = max(float(g.abs().max()) for g in padded["grads"].values())
    worst = max(
        float((packed["grads"][name] - grad).abs().max()) for name, grad in padded["grads"].items()
    )
    stats = torch.tensor([worst, largest], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    for run in (padded, packed):
        del run["grads"]
    return {"padded": padded, "packed": packed, "grad_diff": float(stats[0]),
            "grad_max": float(stats[1])}  # fmt: skip


def _worker_single(out: Path, dirs_json: str) -> None:
    from streamrl.config import LoraConfig

    dirs = json.loads(dirs_json)
    dense = _samples()
    results = {
        "sdpa": _compare(dirs["qwen3-tiny"], dense, critic=True),
        "local": _compare(dirs["qwen3-tiny"], dense, learner={"megatron": {"attention": "local"}}),
        "recompute": _compare(dirs["qwen3-tiny"], dense, learner={"gradient_checkpointing": True}),
        "lora": _compare(dirs["qwen3-tiny"], dense, learner={"lora": LoraConfig(rank=4)}),
        "moe_replay": _compare(
            dirs["qwen3-moe-tiny"],
            _samples(num_layers=2, top_k=2, num_experts=8),
            algorithm={"routing_replay": True},
        ),
        "mla": _compare(dirs["deepseek-v3-tiny"], dense),
    }
    torch.save(results, out)


def _worker_two(out: Path, dirs_json: str) -> None:
    import torch.distributed as dist

    path = json.loads(dirs_json)["qwen3-tiny"]
    dense = _samples()
    layouts = {
        "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
        "pp2": {"pipeline_parallel_size": 2, "use_distributed_optimizer": False},
    }
    results = {
        label: _compare(path, dense, learner={"megatron": megatron}, critic=True)
        for label, megatron in layouts.items()
    }
    if dist.get_rank() == 0:
        torch.save(results, out)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs(rank_runs, tmp_path_factory):
    from streamrl.models import save_random_model

    root = tmp_path_factory.mktemp("packing-models")
    dirs = {}
    for name in SINGLE_MODELS:
        save_random_model(name, root / name, seed=0)
        dirs[name] = str(root / name)
    rank_runs.start("single", 1, json.dumps(dirs), timeout_s=RUN_TIMEOUT_S)
    rank_runs.start(
        "two", 2, json.dumps({"qwen3-tiny": dirs["qwen3-tiny"]}), timeout_s=RUN_TIMEOUT_S
    )
    return rank_runs


def _assert_equal_layouts(run: dict) -> None:
    padded, packed = run["padded"], run["packed"]
    (real, padded_computed), (packed_real, packed_computed) = padded["tokens"], packed["tokens"]
    assert packed_real == real and packed_computed == real < padded_computed
    for key in ("logprobs", "values"):
        if key in padded:
            assert padded[key].abs().max() > 0.1, key  # real values were compared
            assert (packed[key] - padded[key]).abs().max() < LOGPROB_TOL, key
    for key in ("loss", "entropy", "grad_norm"):
        assert packed["step"][key] == pytest.approx(padded["step"][key], rel=1e-5), key
    assert run["grad_max"] > 0
    assert run["grad_diff"] <= GRAD_REL_TOL * run["grad_max"]


# ---------------------------------------------------------------- the pieces (in process)


def test_document_ids_start_a_sample_at_each_position_0_and_sequence_padding_is_one_more():
    from streamrl.backends.megatron import packing

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])  # samples of 3, 2, 1, then 2 padding
    padded = packing.padded_positions(positions, 10)  # sequence parallelism's multiple
    assert padded.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 0, 1]]
    assert packing.document_ids(padded).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4, 5, 5]]
    mask = packing.dense_mask(packing.document_ids(positions))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask.sum() == 6 + 3 + 1 + 3  # each sample's causal triangle, nothing across


def test_rotary_rows_follow_each_samples_own_position_in_a_packed_row():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from streamrl.backends.megatron import packing
    from streamrl.backends.megatron.cpu_shims import cpu_redirect

    stage = torch.nn.Module()
    stage.rotary = RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True
    )
    holder = packing.install(stage)
    assert packing.positions_of(stage) is holder
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0], [0, 1, 0, 1, 2, 3, 4]])  # [B, S]
    with cpu_redirect():
        by_column = stage.rotary(7)
        holder.positions = positions.t()  # Megatron's [S, B] order
        by_sample = stage.rotary(7)
        holder.positions = None
        again = stage.rotary(7)
    assert by_column.shape == (7, 1, 1, 8) and by_sample.shape == (7, 2, 1, 8)
    for row in range(2):
        for column in range(7):
            expected = by_column[positions[row, column], 0, 0]
            assert torch.equal(by_sample[column, row, 0], expected)
    assert torch.equal(again, by_column)


def test_an_mla_model_with_recompute_and_pipeline_stages_refuses_packing_naming_the_keys():
    from streamrl.backends.megatron import packing
    from streamrl.backends.megatron.model import shape_from_hf
    from streamrl.models import random_config

    mla = shape_from_hf(random_config("deepseek-v3-tiny"))
    dense = shape_from_hf(random_config("qwen3-tiny"))
    with pytest.raises(ValueError, match=r"learner\.pack_sequences") as refused:
        packing.check_supported(mla, gradient_checkpointing=True, pp_size=2)
    assert "learner.megatron.pipeline_parallel_size" in str(refused.value)
    assert "learner.gradient_checkpointing" in str(refused.value)
    packing.check_supported(mla, gradient_checkpointing=True, pp_size=1)
    packing.check_supported(mla, gradient_checkpointing=False, pp_size=2)
    packing.check_supported(dense, gradient_checkpointing=True, pp_size=2)


# ---------------------------------------------------------------- packed against padded


@pytest.mark.parametrize("variant", ["sdpa", "local", "recompute", "lora", "moe_replay", "mla"])
def test_packed_rows_train_like_right_padded_rows_on_one_rank(runs, variant):
    _assert_equal_layouts(runs("single")[variant])


def test_routing_replay_reports_the_same_agreement_in_both_layouts(runs):
    run = runs("single")["moe_replay"]
    padded, packed = run["padded"]["step"], run["packed"]["step"]
    assert packed["moe_router_agreement"] == pytest.approx(padded["moe_router_agreement"])
    # packed rows carry less padding: a larger share of the routed tokens is replayed
    assert packed["moe_replayed_fraction"] > padded["moe_replayed_fraction"] > 0


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_packed_rows_train_like_right_padded_rows_on_two_ranks(runs, layout):
    _assert_equal_layouts(runs("two")[layout])


if __name__ == "__main__":
    worker_main(single=_worker_single, two=_worker_two)
