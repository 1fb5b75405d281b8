"""GLM-4, Qwen3-MoE, GLM-4.5 MoE and DeepSeek-V3 on the megatron backend, on CPU.

Conversion is checked in process; everything that runs Megatron runs in real
gloo processes (this file as a script, `python tests/backends/megatron/test_megatron_families.py
worker ...`), one run of 1 rank and one of 2 ranks started together by a module
fixture. The 2-rank run trains every family at TP = 2 (MoE layers then need
sequence parallelism, which also pads the odd-length micro-batch) and every
MoE family at EP = 2 (alltoall dispatcher over gloo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ranks import hf_token_logprobs, nll_loss, seeded_micro_batches, worker_main

from streamrl.backends.megatron import convert
from streamrl.backends.megatron.families import shape_from_hf
from streamrl.models import build_random_model, random_config

# One worker forks every rank of this room (conftest.py of this room says why).
pytestmark = pytest.mark.xdist_group("megatron")

FAMILIES = ("glm4-tiny", "qwen3-moe-tiny", "glm4-moe-tiny", "deepseek-v3-tiny")
MOE_FAMILIES = FAMILIES[1:]
YARN = "deepseek-v3-tiny-yarn"
# `-grouped`: the local experts as one GroupedExperts module (learner.megatron.moe_grouped_gemm).
TWO_RANK_LAYOUTS = [
    *[(name, "tp2") for name in FAMILIES],
    *[(name, "ep2") for name in MOE_FAMILIES],
    ("qwen3-moe-tiny", "ep2-grouped"),
    ("glm4-moe-tiny", "tp2-grouped"),
    ("deepseek-v3-tiny", "pp2"),  # stage 0: the dense layer, stage 1: the MoE layer
]
NUM_STEPS = 2
RUN_TIMEOUT_S = 400.0


# ---------------------------------------------------------------- models and data


def family_model(name: str):
    """A seeded random tiny model; the correction bias of sigmoid routers made non-zero
    (transformers initialises it to 0, which would leave that path untested);
    `deepseek-v3-tiny-yarn` adds YaRN RoPE."""
    from transformers import AutoModelForCausalLM

    if name == YARN:
        config = random_config("deepseek-v3-tiny")
        config.rope_parameters = {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0,
        }  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = build_random_model(name, seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.05)
    return model.eval()


def micro_batches(vocab_size: int):
    """Two right-padded micro-batches of widths 16 and 11 (odd: sequence parallelism pads it)."""
    return seeded_micro_batches(
        [[16, 9, 13], [11, 6]], token_ids=range(vocab_size),
        generator=torch.Generator().manual_seed(99), prompt_tokens=2, advantage=1.0,
        row_weights=True,
    )  # fmt: skip


# ---------------------------------------------------------------- workers (run as a script)


def _backend(path: str, layout: str = "", **moe_options):
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.config import LearnerConfig, MegatronConfig

    options = MegatronConfig(
        tensor_parallel_size=2 if layout.startswith("tp2") else 1,
        expert_model_parallel_size=2 if layout.startswith("ep2") else 1,
        pipeline_parallel_size=2 if layout.startswith("pp2") else 1,
        moe_grouped_gemm=layout.endswith("grouped"),
        **moe_options,
    )
    config = LearnerConfig(backend="megatron", lr=1e-3, grad_clip=1.0, megatron=options)
    return MegatronBackend(path, config, device="cpu", dtype=torch.float32, seed=0)


def _run(backend, *, is_data_rank: bool, checkpoint: Path | None = None) -> dict:
    batches = micro_batches(backend.shape.vocab_size) if is_data_rank else []
    run = {"logprobs": backend.compute_logprobs(batches, temperature=1.0)}
    published = dict(backend.hf_weights())
    run["published"] = {name: tensor.clone() for name, tensor in published.items()}
    run["steps"] = [
        backend.train_mini_batch(batches, nll_loss, temperature=1.0, need_entropy=True)
        for _ in range(NUM_STEPS)
    ]
    if checkpoint is not None:
        run["trained_logprobs"] = backend.compute_logprobs(batches, temperature=1.0)
        backend.save(checkpoint)
    return run


def _worker_single(out: Path, dirs_json: str) -> None:
    """Every family (and YaRN's logprobs) on one rank; DeepSeek-V3 with the router's losses."""
    model_dirs = json.loads(dirs_json)
    results: dict = {}
    for name, path in model_dirs.items():
        backend = _backend(path)
        if name == YARN:
            batches = micro_batches(backend.shape.vocab_size)
            results[name] = {"logprobs": backend.compute_logprobs(batches, temperature=1.0)}
        else:
            results[name] = _run(backend, is_data_rank=True)
    losses = {"moe_aux_loss_coeff": 0.5, "moe_z_loss_coeff": 0.5}
    backend = _backend(model_dirs["deepseek-v3-tiny"], **losses)
    results["deepseek-v3-tiny/aux"] = _run(backend, is_data_rank=True)
    torch.save(results, out)


def _worker_two(out: Path, dirs_json: str) -> None:
    """Every two-rank layout of TWO_RANK_LAYOUTS; an EP 2 checkpoint of Qwen3-MoE."""
    import torch.distributed as dist

    model_dirs = json.loads(dirs_json)
    rank = dist.get_rank()
    results: dict = {}
    for name, layout in TWO_RANK_LAYOUTS:
        checkpoint = None
        if (name, layout) == ("qwen3-moe-tiny", "ep2"):
            checkpoint = out.parent / f"{name}-ep2"
        backend = _backend(model_dirs[name], layout)
        run = _run(backend, is_data_rank=rank == 0, checkpoint=checkpoint)
        results[f"{name}/{layout}"] = run
    if rank == 0:
        torch.save(results, out)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("family-models")
    dirs = {}
    for name in (*FAMILIES, YARN):
        family_model(name).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="module")
def runs(rank_runs, model_dirs):
    """The 1-rank and the 2-rank run, started together."""
    for mode, world_size in (("single", 1), ("two", 2)):
        rank_runs.start(mode, world_size, json.dumps(model_dirs), timeout_s=RUN_TIMEOUT_S)
    return rank_runs


# ---------------------------------------------------------------- conversion (in process)


def _saved_state(model) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (per-expert names, the correction-bias buffers included)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return convert.read_hf_state(directory)


LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]


@pytest.mark.parametrize(
    "name,grouped", [*[(n, False) for n in FAMILIES], *[(n, True) for n in MOE_FAMILIES]]
)
def test_hf_to_megatron_to_hf_is_bit_exact_at_every_tp_pp_ep_layout(name, grouped):
    from streamrl.backends.megatron.model import learner_shape
    from streamrl.config import MegatronConfig

    hf_state = _saved_state(family_model(name))
    shape = learner_shape(random_config(name), MegatronConfig(moe_grouped_gemm=grouped))
    for dtype in (torch.float32, torch.bfloat16):
        state = {key: value.to(dtype) for key, value in hf_state.items()}
        for tp, pp, ep in LAYOUTS:
            if ep > 1 and shape.moe is None:
                continue
            back = {}
            for pp_rank in range(pp):
                shards = [
                    convert.hf_to_megatron(
                        state, shape, tp_rank=t, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                        ep_rank=e, ep_size=ep,
                    )
                    for e in range(ep)
                    for t in range(tp)
                ]  # fmt: skip
                stage = convert.megatron_to_hf(
                    shards, shape, pp_rank=pp_rank, pp_size=pp, ep_size=ep
                )
                assert not set(stage) & set(back), "two stages exported the same tensor"
                back.update(stage)
            assert set(back) == set(state), (tp, pp, ep)
            for key, value in state.items():
                assert back[key].dtype == dtype and torch.equal(back[key], value), (key, tp, ep)


def test_each_ep_rank_holds_a_contiguous_block_of_experts_under_local_names():
    shape = shape_from_hf(random_config("qwen3-moe-tiny"))  # 8 experts
    rules = convert.stage_rules(shape, pp_rank=0, pp_size=1, ep_rank=1, ep_size=2)
    experts = {
        (rule.megatron.split(".")[6], rule.expert) for rule in rules if rule.expert is not None
    }
    assert experts == {(str(local), 4 + local) for local in range(4)}
    fc1 = next(
        rule for rule in rules if rule.megatron.endswith("local_experts.0.linear_fc1.weight")
    )
    assert fc1.hf == (
        "model.layers.0.mlp.experts.4.gate_proj.weight",
        "model.layers.0.mlp.experts.4.up_proj.weight",
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_the_shape_counts_the_parameters_transformers_builds(name):
    model = build_random_model(name)
    shape = shape_from_hf(model.config)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    if shape.moe is not None:
        assert shape.num_parameters(active=True) < shape.num_parameters()


@pytest.mark.parametrize(
    "shape_name,overrides,field",
    [
        ("deepseek-v3-tiny", {"rope_interleave": False}, "rope_interleave"),
        ("glm4-moe-tiny", {"norm_topk_prob": False}, "norm_topk_prob"),
        ("deepseek-v3-tiny", {"num_experts_per_tok": 3}, "topk_group"),
        ("qwen3-moe-tiny", {"use_sliding_window": True}, "use_sliding_window"),
        ("deepseek-v3-tiny", {"attention_bias": True}, "attention_bias"),
    ],
)
def test_options_megatron_would_compute_differently_are_refused_by_name(
    shape_name, overrides, field
):
    config = random_config(shape_name)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(NotImplementedError, match=field):
        shape_from_hf(config)


def test_expert_parallelism_with_the_allgather_dispatcher_is_refused():
    from streamrl.backends.megatron.moe import moe_config_kwargs
    from streamrl.config import MegatronConfig

    shape = shape_from_hf(random_config("qwen3-moe-tiny"))
    options = MegatronConfig(expert_model_parallel_size=2, moe_token_dispatcher="allgather")
    with pytest.raises(ValueError, match="moe_token_dispatcher"):
        moe_config_kwargs(shape, options, ep_size=2, tp_size=1)
    with pytest.raises(ValueError, match="experts do not split"):
        moe_config_kwargs(shape, MegatronConfig(), ep_size=3, tp_size=1)


# ---------------------------------------------------------------- against Hugging Face


@pytest.mark.parametrize("name", (*FAMILIES, YARN))
def test_megatron_logprobs_equal_transformers_logprobs(name, runs, model_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
    batches = micro_batches(hf.config.vocab_size)
    for micro_batch, ours in zip(batches, runs("single")[name]["logprobs"], strict=True):
        assert (ours - hf_token_logprobs(hf, micro_batch)).abs().max() <= 1e-4


@pytest.mark.parametrize("name,layout", TWO_RANK_LAYOUTS)
def test_two_rank_layouts_match_one_rank(name, layout, runs):
    """Same log-probabilities, losses and grad norms as one rank with one MLP per expert (the
    gradient is complete at TP = 2 and EP = 2: an expert's tokens come from both DP replicas;
    grouped experts compute what the per-expert MLPs do)."""
    single, two = runs("single")[name], runs("two")[f"{name}/{layout}"]
    for one_rank, two_ranks in zip(single["logprobs"], two["logprobs"], strict=True):
        assert (one_rank - two_ranks).abs().max() <= 1e-5
    for key in ("nll", "entropy", "grad_norm"):
        expected = [step[key] for step in single["steps"]]
        assert [step[key] for step in two["steps"]] == pytest.approx(expected, rel=1e-4), key
    assert single["steps"][1]["nll"] < single["steps"][0]["nll"]


@pytest.mark.parametrize("name,layout", [c for c in TWO_RANK_LAYOUTS if c[1] != "pp2"])
def test_published_weights_gathered_from_two_ranks_equal_the_checkpoint(
    name, layout, runs, model_dirs
):
    """The publisher's gathered tensors (every TP shard, every expert of both EP ranks, the
    routers' correction bias) are the checkpoint's, bit for bit and under its names."""
    expected = convert.read_hf_state(model_dirs[name])
    for run in (runs("single")[name], runs("two")[f"{name}/{layout}"]):
        published = run["published"]
        assert set(published) == set(expected)
        assert [key for key in expected if not torch.equal(published[key], expected[key])] == []


def test_an_expert_parallel_checkpoint_loads_in_transformers_with_the_learners_logprobs(runs):
    from transformers import AutoModelForCausalLM

    checkpoint = runs.out_dir("two") / "qwen3-moe-tiny-ep2"
    result = runs("two")["qwen3-moe-tiny/ep2"]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batches = micro_batches(hf.config.vocab_size)
    for micro_batch, ours in zip(batches, result["trained_logprobs"], strict=True):
        assert (ours - hf_token_logprobs(hf, micro_batch)).abs().max() <= 1e-4


def test_the_load_balancing_and_z_losses_add_gradient_but_not_the_policy_loss(runs):
    """learner.megatron.moe_aux_loss_coeff / moe_z_loss_coeff reach Megatron's router: the
    first step's NLL is the same, its gradient is not."""
    plain, with_losses = runs("single")["deepseek-v3-tiny"], runs("single")["deepseek-v3-tiny/aux"]
    assert with_losses["steps"][0]["nll"] == pytest.approx(plain["steps"][0]["nll"], rel=1e-6)
    assert with_losses["steps"][0]["grad_norm"] > 1.5 * plain["steps"][0]["grad_norm"]


if __name__ == "__main__":
    worker_main(single=_worker_single, two=_worker_two)
