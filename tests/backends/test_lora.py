"""LoRA (`learner.lora`): the torch backend's adapters (peft), what they publish, the engine's
merge, checkpoints, export, and the config's checks."""

from __future__ import annotations

import pytest
import torch

from streamrl.backends.batching import pack_micro_batches
from streamrl.backends.step import make_loss_fn
from streamrl.backends.torch import TorchBackend
from streamrl.config import ConfigError, config_from_dict
from streamrl.types import Sample
from streamrl.weights import adapters

RANK, ALPHA = 4, 16.0
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _config(model_dir: str, *, algorithm: dict | None = None, **lora):
    return config_from_dict(
        {
            "data": {"path": "x"},
            "model": {"path": model_dir},
            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
            "algorithm": algorithm or {},
            "learner": {
                "lr": 1e-2,
                "grad_clip": 0.0,
                "lora": {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS, **lora},
            },
        }
    )


def _backend(model_dir: str, **kwargs) -> TorchBackend:
    cfg = _config(model_dir)
    return TorchBackend(
        model_dir, cfg.learner, device=torch.device("cpu"), dtype=torch.float32, **kwargs
    )


def _micro_batches():
    samples = [
        Sample(
            prompt_ids=[1, 5, 6, 7],
            response_ids=[100, 101, 102, 103],
            logprobs=[-2.0] * 4,
            versions=[0] * 4,
            loss_mask=[1, 1, 1, 1],
        ),
        Sample(
            prompt_ids=[1, 5],
            response_ids=[100, 107, 9, 7, 8],
            logprobs=[-1.0] * 5,
            versions=[0] * 5,
            loss_mask=[1] * 5,
        ),
    ]
    micro_batches = pack_micro_batches(samples, [0, 1], token_budget=1000, pad_id=0)
    num_tokens = float(sum(mb.loss_mask.sum() for mb in micro_batches))
    for micro_batch, sign in zip(micro_batches, (1.0, -1.0), strict=False):
        micro_batch.advantages = sign * micro_batch.loss_mask.clone()
        micro_batch.num_tokens_in_mini_batch = num_tokens
        micro_batch.num_sequences_in_mini_batch = 2
    return micro_batches


def _train(backend: TorchBackend, steps: int) -> list[float]:
    micro_batches, losses = _micro_batches(), []
    loss_fn = make_loss_fn(_config("x"))
    for _ in range(steps):
        for mb in micro_batches:
            mb.proximal_logprobs = backend.compute_logprobs([mb], temperature=1.0)[0]
        metrics = backend.train_mini_batch(
            micro_batches, loss_fn, temperature=1.0, need_entropy=False
        )
        losses.append(metrics["loss"])
    return losses


# ---------------------------------------------------------------- the torch backend


def test_a_lora_backend_trains_only_the_adapters_and_its_optimizer_holds_only_them(
    tiny_model_dir,
):
    backend = _backend(tiny_model_dir)
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    num_layers = backend.model.config.num_hidden_layers
    assert len(trainable) == 2 * len(TARGETS) * num_layers
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in backend.model.parameters() if p.requires_grad}
    base_before = {
        n: p.detach().clone() for n, p in backend.model.named_parameters() if n not in trainable
    }
    _train(backend, 2)
    for name, parameter in backend.model.named_parameters():
        if name in base_before:
            assert torch.equal(parameter, base_before[name]), name
    moved = [
        n for n, p in backend.model.named_parameters() if ".lora_B." in n and p.abs().max() > 0
    ]
    assert len(moved) == len(TARGETS) * num_layers


def test_the_kl_reference_of_a_lora_backend_is_the_base_and_no_second_model(tiny_model_dir):
    backend = _backend(tiny_model_dir, need_reference=True)
    assert backend.reference is None
    micro_batches = _micro_batches()
    initial = backend.compute_logprobs(micro_batches, temperature=1.0)
    _train(backend, 2)
    trained = backend.compute_logprobs(micro_batches, temperature=1.0)
    reference = backend.compute_logprobs(micro_batches, temperature=1.0, reference=True)
    for before, after, ref in zip(initial, trained, reference, strict=True):
        assert torch.equal(ref, before)
        assert (after - before).abs().max() > 1e-3


def test_a_lora_backend_publishes_only_the_adapters_with_lora_b_scaled(tiny_model_dir):
    backend = _backend(tiny_model_dir)
    _train(backend, 1)
    published = dict(backend.hf_weights())
    assert all(adapters.is_adapter_name(name) for name in published)
    parameters = dict(backend.model.named_parameters())
    module = "model.layers.0.self_attn.q_proj"
    peft_name = f"{adapters.PEFT_PREFIX}{module}"
    a = parameters[f"{peft_name}.lora_A.default.weight"]
    b = parameters[f"{peft_name}.lora_B.default.weight"]
    assert torch.equal(published[module + adapters.LORA_A], a)
    assert torch.allclose(published[module + adapters.LORA_B], b * ALPHA / RANK)
    full_bytes = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    adapter_bytes = sum(t.numel() * t.element_size() for t in published.values())
    assert adapter_bytes < full_bytes / 20


def test_a_lora_checkpoint_holds_only_the_adapter_and_resumes_exactly(tiny_model_dir, tmp_path):
    backend = _backend(tiny_model_dir)
    _train(backend, 2)
    backend.save(tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {adapters.CONFIG_FILE, adapters.WEIGHTS_FILE, "optimizer.pt"} <= files
    assert not any(name.startswith("model") for name in files), files
    continued = _train(backend, 2)
    restored = _backend(tiny_model_dir)
    restored.load(tmp_path / "ckpt")
    assert _train(restored, 2) == continued


def test_loading_an_adapter_of_another_rank_is_refused_with_both_named(tiny_model_dir, tmp_path):
    _backend(tiny_model_dir).save(tmp_path / "ckpt")
    other = TorchBackend(
        tiny_model_dir,
        _config(tiny_model_dir, rank=8).learner,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="rank, alpha, target_modules"):
        other.load(tmp_path / "ckpt")


# ---------------------------------------------------------------- export


def test_the_exported_merged_model_and_peft_adapter_reproduce_the_trained_policy(
    tiny_model_dir, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from streamrl.export import export_adapter, export_merged
    from streamrl.models import load_causal_lm

    backend = _backend(tiny_model_dir)
    _train(backend, 2)
    backend.save(tmp_path / "ckpt")
    micro_batch = _micro_batches()[0]
    expected = backend.compute_logprobs([micro_batch], temperature=1.0)[0]

    adapter_dir = export_adapter(tmp_path / "ckpt", tmp_path / "out" / "adapter")
    merged_dir = export_merged(adapter_dir, tmp_path / "out" / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = load_causal_lm(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    for model in (merged, with_adapter):
        logprobs = _teacher_forced(model, micro_batch)
        assert (logprobs - expected).abs().max() <= 1e-5


def _teacher_forced(model, micro_batch) -> torch.Tensor:
    from streamrl.algorithms import logprobs_from_logits

    with torch.no_grad():
        logits = model(micro_batch.input_ids, attention_mask=micro_batch.attention_mask).logits
    logprobs = logprobs_from_logits(logits, micro_batch.input_ids)
    return logprobs * (micro_batch.loss_mask > 0)


def test_exporting_a_full_fine_tuning_checkpoint_says_it_has_no_adapter(tmp_path):
    from streamrl.export import export_adapter

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        export_adapter(tmp_path / "ckpt", tmp_path / "out")


# ---------------------------------------------------------------- the engine's merge


def _runner(model_dir: str):
    from streamrl.engine.runner.select import build_runner

    runner, _ = build_runner(
        model_dir, runner="compact", device=torch.device("cpu"), dtype=torch.float32,
        max_batch_size=2, max_seq_len=64, max_prefill_tokens=64, cuda_graphs=False,
        compile_elementwise=False, seed=0,
    )  # fmt: skip
    return runner


def _live(runner, name: str) -> torch.Tensor:
    parameter, start, end = runner.targets[name]
    return parameter.data[start:end].clone()


def _adapter(seed: int, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(RANK, inp, generator=generator), torch.randn(out, RANK, generator=generator)


def test_an_engine_merges_adapters_and_each_version_replaces_the_previous_one(tiny_model_dir):
    runner = _runner(tiny_model_dir)
    q, o = "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    base = {name: _live(runner, f"{name}.weight") for name in (q, o)}
    shapes = {name: tuple(tensor.shape) for name, tensor in base.items()}
    for seed in (1, 2):
        pairs = {name: _adapter(seed, *shapes[name]) for name in (q, o)}
        wire = [(f"{n}{suffix}", t) for n, (a, b) in pairs.items() for suffix, t in
                ((adapters.LORA_A, a), (adapters.LORA_B, b))]  # fmt: skip
        runner.load_weights(runner.plan_weights(wire))
        for name, (a, b) in pairs.items():
            assert torch.allclose(_live(runner, f"{name}.weight"), base[name] + b @ a, atol=1e-5)
    # A full tensor replaces the weight and becomes the base of the next adapter.
    full = torch.randn(shapes[q])
    runner.load_weights(runner.plan_weights([(f"{q}.weight", full)]))
    assert torch.equal(_live(runner, f"{q}.weight"), full)
    a, b = _adapter(3, *shapes[q])
    runner.load_weights(runner.plan_weights([(q + adapters.LORA_A, a), (q + adapters.LORA_B, b)]))
    assert torch.allclose(_live(runner, f"{q}.weight"), full + b @ a, atol=1e-5)


@pytest.mark.parametrize(
    "wire, message",
    [
        ([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(RANK, 64))], "lora_B"),
        (
            [
                ("model.layers.0.mlp.nope.lora_A.weight", torch.zeros(RANK, 64)),
                ("model.layers.0.mlp.nope.lora_B.weight", torch.zeros(64, RANK)),
            ],
            "unknown module",
        ),
        (
            [
                ("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(RANK, 3)),
                ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(64, RANK)),
            ],
            "update",
        ),
    ],
)
def test_an_adapter_the_engine_cannot_apply_is_refused_before_any_copy(
    tiny_model_dir, wire, message
):
    runner = _runner(tiny_model_dir)
    with pytest.raises(ValueError, match=message):
        runner.plan_weights(wire)
    assert not runner.adapter_bases


def test_an_engine_started_with_an_adapter_serves_the_trained_policy(tiny_model_dir, tmp_path):
    from streamrl.engine.core import EngineCore
    from streamrl.engine.options import EngineOptions

    backend = _backend(tiny_model_dir)
    _train(backend, 2)
    backend.save(tmp_path / "ckpt")
    core = EngineCore(
        EngineOptions(
            model=tiny_model_dir,
            device="cpu",
            runner="compact",
            lora_adapter=str(tmp_path / "ckpt"),
        )
    )
    published = dict(backend.hf_weights())
    module = "model.layers.0.self_attn.v_proj"
    base = _live(_runner(tiny_model_dir), f"{module}.weight")
    delta = published[module + adapters.LORA_B] @ published[module + adapters.LORA_A]
    assert torch.allclose(_live(core.runner, f"{module}.weight"), base + delta, atol=1e-5)


# ---------------------------------------------------------------- publishing to a real engine


def _policy_logprobs(backend: TorchBackend, prompt: list[int], output_ids: list[int]) -> list:
    """log p(output_ids[i] | prompt + output_ids[:i]) under the learner's adapted model."""
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output_ids))
    return logprobs[positions, torch.tensor(output_ids)].tolist()


@pytest.mark.anyio
async def test_published_adapters_reach_a_real_engine_and_each_replaces_the_last(
    tiny_model_dir, tmp_path
):
    import anyio
    from engine_helpers import running_engines

    from streamrl.fleet.client import EngineClient
    from streamrl.publish.group_transport import GroupTransport
    from streamrl.publish.publisher import WeightPublisher

    backend = _backend(tiny_model_dir)
    backend.model.eval()
    prompt = [1, 504, 3458, 314, 253]

    async def on_published(version: int) -> None:
        pass

    async def one_gpu(engines) -> list[int]:
        return [1] * len(engines)

    seen = []
    with running_engines(tiny_model_dir, tmp_path, extra_args=["--weight-version", "0"]) as (
        engine,
    ):
        async with EngineClient(engine.url, timeout_s=120) as client:
            publisher = WeightPublisher(
                weights=backend.hf_weights,
                members=lambda: [client],
                on_published=on_published,
                transport=GroupTransport(members=lambda: [client], gpu_counts=one_gpu),
                pause_mode="in_place",
            )
            async with anyio.create_task_group() as tasks:
                await tasks.start(publisher.run)
                for version in (1, 2):
                    _train(backend, 1)
                    backend.model.eval()
                    with anyio.fail_after(120):
                        await publisher.publish(version)
                        await publisher.wait_idle()
                    result = await client.generate(
                        prompt, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
                    )
                    expected = _policy_logprobs(backend, prompt, result.output_ids)
                    seen.append((result, expected))
                tasks.cancel_scope.cancel()
    for version, (result, expected) in enumerate(seen, start=1):
        assert result.versions == [version] * 8
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) < 1e-4
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in backend.hf_weights())
    assert [record.num_bytes for record in publisher.records] == [adapter_bytes] * 2
    assert all(record.ok for record in publisher.records)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "lora, learner, message",
    [
        ({"rank": 8, "target_modules": ["q_proj", "x"]}, {}, r"target_modules\[1\] = 'x'"),
        ({"rank": 8, "target_modules": []}, {}, "target_modules is empty"),
        ({"rank": 8, "target_modules": ["q_proj", "q_proj"]}, {}, "names a layer twice"),
        ({"rank": 8, "dropout": 0.1}, {"backend": "megatron"}, "learner.lora.dropout = 0.1"),
    ],
)
def test_a_bad_lora_table_names_the_dotted_key(lora, learner, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        config_from_dict({"data": {"path": "x"}, "learner": {**learner, "lora": lora}}, "run.toml")


def test_lora_is_off_by_default_and_then_checks_nothing():
    cfg = config_from_dict({"data": {"path": "x"}, "learner": {"lora": {"target_modules": []}}})
    assert not cfg.learner.lora.is_enabled
