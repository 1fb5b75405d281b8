"""The memory planner: refusals by key through `streamrl check`, its model-state terms against
what the torch and Megatron backends allocate on the CPU, and the Qwen3-4B breakdown."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrl.config import config_from_dict
from streamrl.planner import learner as terms
from streamrl.planner import plan_memory
from streamrl.planner.fit import shape_of
from streamrl.planner.plan import learner_setup

ROOT = Path(__file__).resolve().parents[2]
QWEN3_4B_PARAMETERS = 4_022_468_096
QWEN3_4B_DIR = (
    ROOT / "configs" / "models" / "qwen3-4b"
)  # its config.json (SGLang needs a directory)


def _config(**sections):
    raw = {"data": {"path": "builtin:arithmetic", "apply_chat_template": False}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config_from_dict(raw)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_streamrl_check_refuses_a_config_that_cannot_fit_its_gpu_naming_the_key(tmp_path):
    # Qwen3-4B on the torch backend shares one 80 GB GPU with an embedded engine.
    config = _write(
        tmp_path / "run.toml",
        """
[model]
path = "random:qwen3-4b"
[data]
path = "builtin:arithmetic"
apply_chat_template = false
[learner]
micro_batch_tokens = 8192
[cluster]
gpu_memory_gb = 80
""",
    )
    result = subprocess.run(
        [sys.executable, "-m", "streamrl", "check", str(config)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {config}: learner.micro_batch_tokens: GPU 0 would need")
    assert "but has 80.0 GB (cluster.gpu_memory_gb)" in error
    assert "learner.gradient_checkpointing" in error and "cluster.engine_gpus" in error
    assert "# GPU 0: " in result.stderr  # the breakdown behind the refusal
    assert result.stdout == ""


def test_an_sglang_engine_whose_static_share_holds_only_its_weights_is_refused():
    cfg = _config(
        model={"path": str(QWEN3_4B_DIR)},
        engine={"backend": "sglang", "mem_fraction_static": 0.05, "max_seq_len": 8192},
        learner={"backend": "megatron", "gradient_checkpointing": True},
        cluster={"engine_gpus": [1]},
    )
    plan = plan_memory(cfg, gpu_bytes=141e9, source="test")
    (problem,) = plan.problems  # 8.04 GB of weights in a static share of 7.05 GB
    assert problem.startswith("engine.mem_fraction_static = 0.05: on GPU 1")
    assert "less than one sequence of engine.max_seq_len = 8192" in problem


def test_a_config_that_fits_has_no_problems_and_sums_each_gpus_processes():
    cfg = _config(
        model={"path": "random:qwen3-4b"},
        learner={"backend": "megatron", "gradient_checkpointing": True},
        engine={"max_batch_size": 32},
    )
    plan = plan_memory(cfg, gpu_bytes=141e9, source="an H200")
    assert plan.problems == []
    (gpu,) = plan.gpus  # learner and embedded engine share GPU 0
    assert [usage.role for usage in gpu.usages] == ["learner", "engine"]
    assert gpu.peak_bytes == sum(usage.peak_bytes for usage in gpu.usages) < 141e9
    assert json.loads(json.dumps(plan.to_dict()))["gpus"][0]["peak_bytes"] == gpu.peak_bytes


def test_a_colocated_gpu_peaks_at_the_larger_handoff_phase_not_the_sum():
    resident = _config(
        model={"path": "random:qwen3-4b"},
        learner={"backend": "megatron", "gradient_checkpointing": True},
        engine={"max_batch_size": 32},
        train={"mode": "sync"},
    )
    colocated = _config(
        model={"path": "random:qwen3-4b"},
        learner={"backend": "megatron", "gradient_checkpointing": True, "offload": "optimizer"},
        engine={"max_batch_size": 32},
        train={"mode": "sync"},
        cluster={"colocate": True},
    )
    (shared,) = plan_memory(resident, gpu_bytes=141e9, source="an H200").gpus
    (turns,) = plan_memory(colocated, gpu_bytes=141e9, source="an H200").gpus
    learner, engine = turns.usages
    assert turns.handoff_phases == {
        "learner phase": learner.peak_bytes + engine.terms["cuda_context"],
        "engine phase": engine.peak_bytes
        + sum(learner.terms[t] for t in ("weights", "weight_staging", "cuda_context")),
    }
    assert turns.peak_bytes == max(turns.handoff_phases.values()) < shared.peak_bytes
    assert (
        shared.handoff_phases == {} and shared.peak_bytes == learner.peak_bytes + engine.peak_bytes
    )


def test_an_8b_model_colocated_on_one_h200_is_refused_by_its_learner_phase(tmp_path):
    config = _write(
        tmp_path / "run.toml",
        """
[model]
path = "random:llama3-8b"
[data]
path = "builtin:arithmetic"
apply_chat_template = false
[learner]
backend = "megatron"
gradient_checkpointing = true
offload = "all"
[cluster]
colocate = true
gpu_memory_gb = 141
[train]
mode = "sync"
""",
    )
    result = subprocess.run(
        [sys.executable, "-m", "streamrl", "check", str(config)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {config}: learner.num_gpus: GPU 0 would need")
    assert "(colocated, the larger of learner phase" in error
    assert "learner.lora.rank" not in error  # refused with colocated engines
    assert "# GPU 0: " in result.stderr and "a synchronous schedule" in result.stderr


def test_two_sglang_engines_on_one_gpu_are_planned_together_each_pool_capped_by_its_flag():
    cfg = _config(
        model={"path": str(QWEN3_4B_DIR)},
        engine={
            "backend": "sglang", "num_engines": 2, "mem_fraction_static": 0.3,
            "max_seq_len": 8192, "extra_args": ["--max-total-tokens", "65536"],
        },
        learner={"backend": "megatron", "gradient_checkpointing": True},
        cluster={"engine_gpus": [0, 0]},
        weights={"transport": "ipc"},
    )  # fmt: skip
    plan = plan_memory(cfg, gpu_bytes=141e9, source="test")
    (gpu,) = plan.gpus
    assert [usage.role for usage in gpu.usages] == ["learner", "engine", "engine"]
    per_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bf16
    assert [u.terms["kv_pool"] for u in gpu.usages[1:]] == [65536 * per_token] * 2
    assert gpu.peak_bytes == sum(usage.peak_bytes for usage in gpu.usages)


def _count_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors` (views and tied weights once)."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_state_terms_equal_what_the_torch_backend_allocates_for_a_tiny_model():
    from streamrl.backends.batching import pack_micro_batches
    from streamrl.backends.torch import TorchBackend
    from streamrl.types import Sample

    cfg = _config(
        model={"path": "random:qwen3-tiny"}, algorithm={"kl_loss_coef": 0.1},
        learner={"dtype": "bfloat16"},
    )  # fmt: skip
    backend = TorchBackend(
        cfg.model.path, cfg.learner, device=torch.device("cpu"), dtype=torch.bfloat16,
        need_reference=True,
    )  # fmt: skip
    sample = Sample(
        prompt_ids=[1, 5, 6], response_ids=[7, 8], logprobs=[-1.0, -1.0], versions=[0, 0],
        loss_mask=[1, 1],
    )  # fmt: skip
    micro_batches = pack_micro_batches([sample], [0], token_budget=64, pad_id=0)
    backend.train_mini_batch(
        micro_batches, lambda mb, logprobs, entropy: (-logprobs.sum(), {}),
        temperature=1.0, need_entropy=False,
    )  # fmt: skip
    model = backend.model
    moments = [
        state[name] for state in backend.optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")
    ]  # fmt: skip
    shape = shape_of(cfg.model.path)
    setup = learner_setup(shape, cfg, tokens=64)
    assert terms.weights(shape, setup) == _count_bytes(model.parameters())  # float32 master
    assert terms.gradients(shape, setup) == _count_bytes(p.grad for p in model.parameters())
    assert terms.adam_moments(shape, setup) == _count_bytes(moments)
    assert terms.reference_weights(shape, setup) == _count_bytes(backend.reference.parameters())
    assert terms.master_weights(shape, setup) == 0


MEGATRON_WORKER = """
import json, sys, torch, torch.distributed as dist
from streamrl.backends.megatron.backend import MegatronBackend
from streamrl.config import LearnerConfig, MegatronConfig
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
config = LearnerConfig(backend="megatron", lr=1e-3, megatron=MegatronConfig())
backend = MegatronBackend("random:qwen3-tiny", config, device="cpu", dtype=torch.float32)
from streamrl.backends.batching import pack_micro_batches
from streamrl.types import Sample
sample = Sample(prompt_ids=[1, 5, 6], response_ids=[7, 8], logprobs=[-1.0, -1.0],
                versions=[0, 0], loss_mask=[1, 1])
batches = pack_micro_batches([sample], [0], token_budget=64, pad_id=0)
backend.train_mini_batch(batches, lambda mb, logprobs, entropy: (-logprobs.sum(), {}),
                         temperature=1.0, need_entropy=False)  # Adam's moments exist now
def distinct(tensors):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
params = list(backend.model.parameters())
moments = [s[k] for opt in backend.optimizer.chained_optimizers
           for s in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")] \\
    if hasattr(backend.optimizer, "chained_optimizers") else [
    s[k] for s in backend.optimizer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
print(json.dumps({"weights": distinct(params), "gradients": distinct(p.main_grad for p in params),
                  "moments": distinct(moments), "num_parameters": sum(p.numel() for p in params)}))
"""


def test_the_state_terms_match_what_the_megatron_backend_allocates_for_a_tiny_model(free_port):
    """One gloo rank on the CPU in float32 (weights are their own master copy), after one
    training step (Adam's moments exist from the first); Megatron pads its buffers, hence
    the tolerance."""
    result = subprocess.run(
        [sys.executable, "-c", MEGATRON_WORKER, f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    cfg = _config(
        model={"path": "random:qwen3-tiny"},
        learner={"backend": "megatron", "dtype": "float32"},
    )
    shape = shape_of(cfg.model.path)
    setup = learner_setup(shape, cfg, tokens=64)
    assert measured["num_parameters"] == shape.num_parameters()
    assert terms.weights(shape, setup) == pytest.approx(measured["weights"], rel=0.01)
    assert terms.gradients(shape, setup) == pytest.approx(measured["gradients"], rel=0.01)
    assert terms.master_weights(shape, setup) == 0
    assert terms.adam_moments(shape, setup) == pytest.approx(measured["moments"], rel=0.01)


def test_the_qwen3_4b_breakdown_is_printed_by_streamrl_check(tmp_path, capsys):
    from streamrl.check import check_command

    config = _write(
        tmp_path / "run.toml",
        f"""
[model]
path = "{QWEN3_4B_DIR}"
[data]
path = "builtin:arithmetic"
apply_chat_template = false
[engine]
backend = "sglang"
max_seq_len = 8192
[learner]
backend = "megatron"
micro_batch_tokens = 16384
gradient_checkpointing = true
[algorithm]
kl_loss_coef = 0.001
[cluster]
engine_gpus = [1]
gpu_memory_gb = 141
""",
    )
    assert check_command(argparse.Namespace(config=str(config), overrides=[])) == 0
    out = capsys.readouterr().out
    plan = [line for line in out.splitlines() if line.startswith("#")]
    print("\n".join(plan))  # the breakdown, for the reader of `pytest -s`
    assert plan[0].startswith(f"# memory plan of {QWEN3_4B_DIR} (4.02B parameters), 141.0 GB")
    assert "#     weights                         8.04 GB" in plan  # 2 B x 4.02B, bf16
    assert "#     gradients                      16.09 GB" in plan  # float32 main grads
    assert "#     master_weights                 16.09 GB" in plan  # float32, DP 1
    assert "#     adam_moments                   32.18 GB" in plan
    assert any(line.startswith("#   sglang engine (TP 1") for line in plan)
    assert f"{2 * QWEN3_4B_PARAMETERS / 1e9:.2f}" == "8.04"


def test_a_packed_micro_batch_is_planned_at_the_token_budget_as_a_padded_one():
    """Packed rows are exactly as wide as their samples: both layouts and both backends plan
    a micro-batch of learner.micro_batch_tokens."""
    from streamrl.planner.plan import learner_usage

    def activations(pack: bool, tokens: int, backend: str = "megatron") -> int:
        cfg = _config(
            model={"path": "random:qwen3-4b"},
            engine={"max_seq_len": 1000},
            rollout={"sampling": {"max_new_tokens": 500}},
            data={"max_prompt_tokens": 100},
            learner={"backend": backend, "pack_sequences": pack, "micro_batch_tokens": tokens},
        )
        return learner_usage(shape_of(cfg.model.path), cfg, None).terms["activations"]

    assert activations(True, 4000) == activations(False, 4000) < activations(False, 4096)
    assert activations(True, 4000, "torch") == activations(False, 4000, "torch")


def test_a_larger_forward_only_budget_is_planned_as_its_own_phase():
    """`learner.logprob_micro_batch_tokens` above the training budget adds a log-probability
    phase holding that many tokens' logits (no gradient: half the training logits' bytes per
    token at Megatron's bf16); at or below it, nothing is added. A budget large enough makes
    it the learner's peak, and the key is what a refusal over it names."""
    from streamrl.planner.plan import KEYS_FOR_TERM, learner_usage

    def usage(forward_tokens: int):
        cfg = _config(
            model={"path": "random:qwen3-4b"},
            engine={"max_seq_len": 1000},
            rollout={"sampling": {"max_new_tokens": 500}},
            data={"max_prompt_tokens": 100},
            learner={
                "backend": "megatron", "micro_batch_tokens": 4096,
                "logprob_micro_batch_tokens": forward_tokens,
            },
        )  # fmt: skip
        return learner_usage(shape_of(cfg.model.path), cfg, None)

    same, larger, huge = usage(0), usage(16384), usage(1_000_000)
    assert "forward_logits" not in same.terms and "log-probabilities" not in same.phases
    assert "forward_logits" not in usage(4096).terms
    chunk = terms.MEGATRON_LOGPROB_CHUNK_BYTES
    assert larger.terms["forward_logits"] - chunk == pytest.approx(
        4 * (larger.terms["logits"] - chunk) / 2, rel=1e-6
    )  # 4x the tokens, half the bytes per token
    assert larger.peak_phase == "train" and huge.peak_phase == "log-probabilities"
    assert KEYS_FOR_TERM["forward_logits"] == ("learner.logprob_micro_batch_tokens",)


def test_recomputing_some_layers_plans_activations_between_none_and_every_layer():
    """learner.megatron.recompute_layers = k of a stage's L: k layers keep their input, the
    other L - k their whole activations; k = L is full recompute, and the key changes the plan
    only with gradient checkpointing on (the config refuses it otherwise)."""
    from streamrl.config import ConfigError
    from streamrl.planner.plan import learner_usage

    shape = shape_of("random:qwen3-4b")

    def activations(recompute: bool, layers: int = 0) -> int:
        cfg = _config(
            model={"path": "random:qwen3-4b"},
            learner={
                "backend": "megatron", "micro_batch_tokens": 4096,
                "gradient_checkpointing": recompute, "megatron": {"recompute_layers": layers},
            },
        )  # fmt: skip
        return learner_usage(shape, cfg, None).terms["activations"]

    every, none = activations(True), activations(False)
    half = activations(True, shape.num_layers // 2)
    assert every < half < none
    assert activations(True, shape.num_layers) == every
    setup = learner_setup(shape, _config(learner={"backend": "megatron"}), tokens=4096)
    full = terms.layer_activation_bytes_per_token(shape, setup)
    layer_input = terms.layer_input_bytes_per_token(shape, setup)
    k = shape.num_layers // 2  # k layers more keep all (one did already), k fewer their input
    assert half - every == pytest.approx(4096 * ((k - 1) * full - k * layer_input), rel=1e-6)
    with pytest.raises(ConfigError, match=r"learner.megatron.recompute_layers = 4 needs"):
        _config(learner={"backend": "megatron", "megatron": {"recompute_layers": 4}})


def test_check_refuses_recomputing_more_layers_than_a_pipeline_stage_has():
    """The layer count comes from the model, so the config alone cannot refuse it; before,
    only the backend's build did, after the engines had started."""
    from streamrl.check import find_problems

    def problems(layers: int) -> list[str]:
        cfg = _config(
            model={"path": "random:qwen3-4b"},
            learner={
                "backend": "megatron", "gradient_checkpointing": True, "num_gpus": 2,
                "megatron": {"recompute_layers": layers, "pipeline_parallel_size": 2},
            },
            cluster={"learner_gpus": [0, 1], "engine_gpus": [2]},
        )  # fmt: skip
        return [p for p in find_problems(cfg) if "recompute_layers" in p]

    stage_layers = shape_of("random:qwen3-4b").num_layers // 2
    assert problems(stage_layers) == []
    assert problems(stage_layers + 1) == [
        f"learner.megatron.recompute_layers = {stage_layers + 1} is more than the "
        f"{stage_layers} layers of a pipeline stage; 0 recomputes every layer"
    ]


def test_a_push_over_nccl_or_ipc_keeps_every_published_tensor_staged_on_the_learners_gpu():
    """The publisher's staging buffers (`streamrl.weights.staging`) hold a whole version in the
    compute dtype from the first push on, in every phase; over gloo they are in host memory
    and the GPU holds one bucket at a push. On the H200 the 4B learner beside SGLang measured
    94.7 GB where the plan without them said 90.5 (bench/results/gpu/fullsize_async4b)."""
    from streamrl.planner.plan import learner_usage

    def usage(**sections):
        cfg = _config(model={"path": "random:qwen3-4b"}, **sections)
        return learner_usage(shape_of(cfg.model.path), cfg, None)

    megatron = {"backend": "megatron", "gradient_checkpointing": True}
    ipc = usage(learner=megatron, weights={"transport": "ipc"}, cluster={"engine_gpus": [0]})
    assert ipc.terms["weight_staging"] == 2 * QWEN3_4B_PARAMETERS  # bf16
    assert "weight_push_bucket" not in ipc.terms
    for phase in ipc.phases:
        assert "weight_staging" in ipc.phases[phase], phase
    nccl = usage(learner=megatron, cluster={"learner_gpus": [0], "engine_gpus": [1]})
    assert nccl.terms["weight_staging"] == 2 * QWEN3_4B_PARAMETERS
    staged_by_stage = usage(
        learner={**megatron, "num_gpus": 2, "megatron": {"pipeline_parallel_size": 2}},
        cluster={"learner_gpus": [0, 1], "engine_gpus": [2]},
    )
    assert staged_by_stage.terms["weight_staging"] == QWEN3_4B_PARAMETERS  # half the layers
    gloo = usage(learner=megatron, weights={"transport": "gloo"})
    assert "weight_staging" not in gloo.terms
    assert "weight_push_bucket" in gloo.phases["weight push"]
    assert "weight_push_bucket" not in gloo.phases["train"]
    assert ipc.peak_bytes - gloo.peak_bytes == 2 * QWEN3_4B_PARAMETERS
