"""MoE on the Megatron backend, one GPU: parity with transformers, learner MFU, routing replay.

Run from the repository root on one H200 (about 10 minutes):

    python bench/gpu/moe_check.py --out bench/results/gpu/moe_check_h200.json

`--tiny` runs the same sections on CPU with tiny shapes (fp32) to check the
script itself. Every section records its traceback instead of stopping the run;
one JSON object is printed and written to --out.

Models (random weights, bf16; full widths, fewer layers so that one GPU holds
the model with Megatron's Adam state, about 18 bytes per parameter):

- `qwen3_30b_a3b`: Qwen3-30B-A3B (hidden 2048, 32 heads / 4 KV heads, 128
  experts of width 768, top-8, vocabulary 151,936) cut to `--qwen-layers`
  (default 6) of its 48 layers.
- `deepseek_v3`: DeepSeek-V3 (hidden 7168, MLA with q/kv LoRA ranks 1536 / 512,
  128 heads, experts of width 2048, top-8 of 8 groups choosing 4, 1 shared
  expert, YaRN RoPE factor 40, vocabulary 129,280) cut to `--dsv3-layers`
  (default 3: 1 dense + 2 MoE) with `--dsv3-experts` (default 16) of its 256
  routed experts. A smaller cut is tried once if the first one runs out of memory.

Sections per model:

(a) `parity`: per-token log-probabilities of transformers (SDPA) and of the
    Megatron learner (grouped-GEMM experts, SDPA) on the same weights and
    right-padded micro-batches; mean and max |diff| over real tokens (target:
    mean <= 1e-2). `parity_hf_routing_replayed`: the same with transformers'
    expert choices replayed in the learner (routing replay), which separates
    the two implementations' numerics from near-tie routing flips; its
    `hf_routing.moe_router_agreement` is how often the learner's own router
    chose as transformers did.
(b) `mfu`: a training step (4 micro-batches of 1 x 4096 tokens, Adam) timed
    over 3 steps after a warm-up; MFU = 6 * N_active * tokens/s / 989e12
    (N_active: parameters a token uses, the top-k experts only, embeddings
    included; attention FLOPs are not counted).

And once, on the Qwen3-30B-A3B widths cut to 4 layers:

(c) `routing_replay`: the embedded engine (transformers runner, bf16) samples
    responses and reports each token's routed experts; the learner recomputes
    the response log-probabilities with its own routing and with the engine's
    (routing replay). Reported per mode: the spread of the importance ratio
    pi_learner / pi_engine (std, mean |log ratio|, max) and the learner
    router's agreement with the engine's choice.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import megatron_check  # noqa: E402  (bench/gpu/: shared helpers)
from megatron_check import micro_batches  # noqa: E402  (the same seeded batches)

PEAK_BF16_FLOPS = 989e12
TIMED_STEPS = 3
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    qwen_shape: str = "qwen3-30b-a3b"
    dsv3_shape: str = "deepseek-v3"
    qwen_layers: int = 6
    dsv3_layers: int = 3
    dsv3_experts: int = 16
    replay_layers: int = 4
    parity_rows: int = 4
    parity_seq_len: int = 1024
    train_seq_len: int = 4096
    train_micro_batches: int = 4
    replay_prompts: int = 32
    replay_new_tokens: int = 128


TINY = Plan(
    device="cpu", dtype=torch.float32, qwen_shape="qwen3-moe-tiny", dsv3_shape="deepseek-v3-tiny",
    qwen_layers=2, dsv3_layers=2, dsv3_experts=8, replay_layers=2, parity_rows=3,
    parity_seq_len=48, train_seq_len=64, train_micro_batches=2, replay_prompts=4,
    replay_new_tokens=12,
)  # fmt: skip
PLAN = Plan()


# ---------------------------------------------------------------- models and batches


def cut_config(shape: str, *, layers: int, experts: int | None = None, yarn: bool = False):
    """A named shape's transformers config with fewer layers (and experts)."""
    from streamrl.models import random_config

    config = random_config(shape)
    config.num_hidden_layers = layers
    if experts is not None:
        config.n_routed_experts = experts
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = min(config.first_k_dense_replace, 1)
    if yarn:
        config.rope_parameters = dict(YARN)
    return config


def describe(config) -> dict:
    from streamrl.backends.megatron.families import shape_from_hf

    shape = shape_from_hf(config)
    return {
        "model_type": config.model_type,
        "layers": shape.num_layers,
        "moe_layers": shape.moe.num_moe_layers,
        "hidden": shape.hidden_size,
        "experts": shape.moe.num_experts,
        "top_k": shape.moe.top_k,
        "expert_ffn": shape.moe.expert_ffn_hidden_size,
        "parameters": shape.num_parameters(),
        "active_parameters": shape.num_parameters(active=True),
        "rope": dict(getattr(config, "rope_parameters", None) or {}),
    }


def save_random(config, directory: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(PLAN.device):
        model = AutoModelForCausalLM.from_config(config, dtype=PLAN.dtype)
    model.save_pretrained(directory)
    del model
    free()
    return directory


def nll_loss(micro_batch, logprobs, entropy):
    loss = -(logprobs * micro_batch.loss_mask).sum() / micro_batch.num_tokens_in_mini_batch
    return loss, {"nll": loss.detach()}


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if PLAN.device == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if PLAN.device == "cuda" else None


def learner(model_dir: Path, *, replay: bool = False):
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.config import AlgorithmConfig, LearnerConfig, MegatronConfig

    config = LearnerConfig(
        backend="megatron", lr=1e-6, megatron=MegatronConfig(moe_grouped_gemm=True)
    )
    algorithm = AlgorithmConfig(routing_replay=replay)
    return MegatronBackend(
        str(model_dir), config, algorithm_cfg=algorithm, device=PLAN.device, dtype=PLAN.dtype
    )


def init_single_rank() -> None:
    import torch.distributed as dist

    from streamrl.backends.rendezvous import init_distributed
    from streamrl.process import free_port

    if not dist.is_initialized():
        init_distributed(rank=0, world_size=1, master_port=free_port(), device=PLAN.device)


# ---------------------------------------------------------------- (a) parity, (b) MFU


def hf_logprobs(model_dir: Path, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' log-probabilities, and the experts its routers chose for every token
    (`[B, T, layers * top_k]`, -1 for dense layers: `extras["routed_experts"]`'s layout)."""
    import re

    from transformers import AutoModelForCausalLM

    from streamrl.algorithms import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=PLAN.dtype)
    model = model.to(PLAN.device).eval()
    config, captured = model.config, {}
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)\.mlp\.experts$", name)
        if match:
            layer = int(match.group(1))
            module.register_forward_pre_hook(
                lambda _, args, layer=layer: captured.__setitem__(layer, args[1].detach())
            )
    out, routed = [], []
    with torch.no_grad():
        for mb in batch:
            ids = mb.input_ids.to(PLAN.device)
            logits = model(ids, attention_mask=mb.attention_mask.to(PLAN.device)).logits
            out.append(logprobs_from_logits(logits.float(), ids)[:, 1:].cpu())
            rows, length = ids.shape
            k = config.num_experts_per_tok
            table = torch.full((rows, length, config.num_hidden_layers, k), -1, dtype=torch.int16)
            for layer, chosen in captured.items():
                table[:, :, layer] = chosen.view(rows, length, k).to(torch.int16).cpu()
            table[mb.attention_mask == 0] = -1  # padding: neither replayed nor counted
            routed.append(table.view(rows, length, -1))
            del logits
    del model
    free()
    return out, routed


def parity(backend, batch, reference, routed) -> dict:
    from streamrl.backends.megatron.routing import control_of

    control = control_of(backend.model)
    control.replay = routed is not None
    control.reset()
    if routed is not None:
        batch = [replace(mb, extras={**mb.extras, "routed_experts": r}) for mb, r in
                 zip(batch, routed, strict=True)]  # fmt: skip
    ours = [lp[:, 1:] for lp in backend.compute_logprobs(batch, temperature=1.0)]
    agreement = control.collect(torch.device(PLAN.device))
    control.replay = False
    diffs = torch.cat(
        [(a - b).abs()[mb.attention_mask[:, 1:].bool()] for a, b, mb in
         zip(ours, reference, batch, strict=True)]
    )  # fmt: skip
    return {
        "mean_abs": float(diffs.mean()),
        "max_abs": float(diffs.max()),
        "tokens": diffs.numel(),
        "target_mean_abs": 1e-2,
        "ok": float(diffs.mean()) <= 1e-2,
        **({"hf_routing": agreement} if routed is not None else {}),
    }


def parity_and_mfu(config, work_dir: Path) -> dict:
    result = {"cut": describe(config)}
    model_dir = save_random(config, work_dir)
    try:
        batch = micro_batches(
            config.vocab_size, rows=PLAN.parity_rows, seq_len=PLAN.parity_seq_len, count=2,
            seed=1, padded=True,
        )  # fmt: skip
        reference, hf_routed = hf_logprobs(model_dir, batch)
        backend = learner(model_dir)
        result["parity"] = parity(backend, batch, reference, None)
        # The same with transformers' expert choices replayed: the numerics of the two
        # implementations alone, without the tokens whose routing flips on a near tie.
        result["parity_hf_routing_replayed"] = parity(backend, batch, reference, hf_routed)
        train = micro_batches(
            config.vocab_size, rows=1, seq_len=PLAN.train_seq_len,
            count=PLAN.train_micro_batches, seed=2, padded=False,
        )  # fmt: skip
        tokens = sum(mb.input_ids.numel() for mb in train)
        if PLAN.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def step():
            return backend.train_mini_batch(train, nll_loss, temperature=1.0, need_entropy=False)

        first = step()
        synchronize()
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step()
        synchronize()
        seconds = (time.perf_counter() - start) / TIMED_STEPS
        active = result["cut"]["active_parameters"]
        result["mfu"] = {
            "tokens_per_step": tokens,
            "step_s": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "mfu": round(6 * active * tokens / seconds / PEAK_BF16_FLOPS, 4),
            "first_step": first,
            "peak_memory_gib": peak_gib(),
        }
        backend = None
    finally:
        free()
        import shutil

        shutil.rmtree(model_dir, ignore_errors=True)
    return result


def model_section(configs: list, work_dir: Path) -> dict:
    """`parity_and_mfu` on the first cut; on running out of memory, once on the next."""
    errors = []
    for config in configs:
        try:
            return {**parity_and_mfu(config, work_dir / "model"), "earlier_cuts_failed": errors}
        except torch.cuda.OutOfMemoryError:
            errors.append({"cut": describe(config), "error": traceback.format_exc()[-2000:]})
            free()
    return {"error": "out of memory at every cut", "attempts": errors}


# ---------------------------------------------------------------- (c) routing replay


async def engine_samples(model_dir: Path, vocab: int) -> list:
    from streamrl.engine.core import EngineCore, Request, SamplingParams
    from streamrl.engine.options import EngineOptions

    engine = EngineCore(
        EngineOptions(
            model=str(model_dir), tokenizer="random:qwen3-tiny", runner="hf",
            device=PLAN.device, dtype="bfloat16" if PLAN.dtype == torch.bfloat16 else "float32",
            max_batch_size=PLAN.replay_prompts, max_seq_len=512,
        )
    )  # fmt: skip
    engine.start()
    try:
        generator = torch.Generator().manual_seed(3)
        requests = [
            Request(
                f"r{i}",
                torch.randint(3, vocab, (16 + i % 16,), generator=generator).tolist(),
                SamplingParams(max_new_tokens=PLAN.replay_new_tokens, ignore_eos=True, seed=i),
                return_routed_experts=True,
            )
            for i in range(PLAN.replay_prompts)
        ]
        return list(zip(requests, await engine.generate(requests), strict=True))
    finally:
        engine.shutdown()


def ratio_spread(samples, batches, logprobs) -> dict:
    log_ratios = []
    for mb, lp in zip(batches, logprobs, strict=True):
        for row, index in enumerate(mb.sample_indices):
            sample = samples[index]
            start = len(sample.prompt_ids)
            end = start + len(sample.response_ids)
            engine = torch.from_numpy(sample.logprobs).double()
            log_ratios.append(lp[row, start:end].double() - engine)
    log_ratio = torch.cat(log_ratios)
    ratio = log_ratio.clamp(-20, 20).exp()
    return {
        "tokens": log_ratio.numel(),
        "ratio_std": float(ratio.std(correction=0)),
        "log_ratio_abs_mean": float(log_ratio.abs().mean()),
        "log_ratio_abs_max": float(log_ratio.abs().max()),
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
    }


def routing_replay_section(work_dir: Path) -> dict:
    from streamrl.backends.batching import pack_micro_batches
    from streamrl.backends.megatron.routing import control_of
    from streamrl.types import Sample

    config = cut_config(PLAN.qwen_shape, layers=PLAN.replay_layers)
    result = {"cut": describe(config)}
    model_dir = save_random(config, work_dir / "replay-model")
    pairs = asyncio.run(engine_samples(model_dir, config.vocab_size))
    free()
    samples = [
        Sample(
            prompt_ids=request.input_ids, response_ids=output.output_ids,
            logprobs=output.logprobs, versions=[0] * len(output.output_ids),
            loss_mask=[1] * len(output.output_ids),
            routed_experts=output.routed_experts.reshape(len(output.routed_experts), -1),
        )
        for request, output in pairs
    ]  # fmt: skip
    batches = pack_micro_batches(samples, list(range(len(samples))), token_budget=8192, pad_id=0)
    backend = learner(model_dir)
    control = control_of(backend.model)
    for replay in (False, True):
        control.replay = replay
        control.reset()
        logprobs = backend.compute_logprobs(batches, temperature=1.0)
        entry = ratio_spread(samples, batches, logprobs)
        entry.update(control.collect(torch.device(PLAN.device)))
        result["with_replay" if replay else "without_replay"] = entry
    del backend
    free()
    return result


# ---------------------------------------------------------------- main


def environment() -> dict:
    """megatron_check's (versions, GPUs, the bf16 peak), with what MoE MFU counts."""
    info = megatron_check.environment()
    info["mfu_note"] = "6 * active parameters * tokens/s / 989e12 (H100/H200 dense bf16 peak)"
    info["grouped_mm"] = hasattr(torch, "_grouped_mm")
    return info


def run(out_path: Path) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    report: dict = {"environment": environment(), "plan": repr(PLAN), "sections_s": {}}
    smaller = max(PLAN.qwen_layers - 2, 1)
    qwen = [cut_config(PLAN.qwen_shape, layers=n) for n in (PLAN.qwen_layers, smaller)]
    dsv3 = [
        cut_config(PLAN.dsv3_shape, layers=PLAN.dsv3_layers, experts=PLAN.dsv3_experts, yarn=True),
        cut_config(PLAN.dsv3_shape, layers=2, experts=PLAN.dsv3_experts, yarn=True),
    ]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moe-check-") as tmp:
        work_dir = Path(tmp)
        sections = [
            ("qwen3_30b_a3b", lambda: model_section(qwen, work_dir)),
            ("deepseek_v3", lambda: model_section(dsv3, work_dir)),
            ("routing_replay", lambda: routing_replay_section(work_dir)),
        ]
        try:
            init_single_rank()
        except Exception:
            report["setup_error"] = traceback.format_exc()
        for name, section in sections:
            section_start = time.perf_counter()
            try:
                report[name] = section()
            except Exception:
                report[name] = {"error": traceback.format_exc()}
            report["sections_s"][name] = round(time.perf_counter() - section_start, 1)
            free()
            _write(out_path, report)  # after every section: a run cut short keeps what it has
    report["total_s"] = round(time.perf_counter() - started, 1)
    _write(out_path, report)
    print(json.dumps(report, default=str))
    return report


def _write(out_path: Path, report: dict) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str))


def main() -> None:
    global PLAN
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes on CPU (checks the script)"
    )
    parser.add_argument("--qwen-layers", type=int)
    parser.add_argument("--dsv3-layers", type=int)
    parser.add_argument("--dsv3-experts", type=int)
    args = parser.parse_args()
    PLAN = TINY if args.tiny else PLAN
    overrides = {
        key: value
        for key, value in {
            "qwen_layers": args.qwen_layers,
            "dsv3_layers": args.dsv3_layers,
            "dsv3_experts": args.dsv3_experts,
        }.items()
        if value is not None
    }
    PLAN = replace(PLAN, **overrides)
    if PLAN.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on CPU")
    run(args.out)


if __name__ == "__main__":
    main()
