"""Where the Megatron learner's step goes at full size: one step's samples as the Qwen3-4B run
trains them (bench/configs/gpu_fullsize_async4b.toml), timed and profiled per recompute
setting (issue 27's MFU line).

Run from the repository root on one GPU, with a model directory drawn beforehand (about 4-6
minutes on one H200 for the 4B shape):

    python bench/gpu/learner_profile.py --model /tmp/qwen3-4b --out OUT/learner_profile.json

`--cpu-smoke` runs it on a tiny random shape on the CPU (checks the script, not the GPU).

The samples: `--samples` (16) of prompts 64..511 and responses uniform in 256..8,192
tokens, packed into rows of `--budget` (16,384) tokens (`learner.pack_sequences`), one
optimizer step over all of them, as the run's step makes it (no proximal pass: one optimizer
step a step). Each recompute variant (`--variants`):

    full   learner.gradient_checkpointing: every layer recomputed (the run's setting)
    half   learner.megatron.recompute_layers = half the layers (Megatron's `block` method)
    none   no recompute (the step runs out of memory beside SGLang; alone it may fit)

A variant may also name the attention kernels and the RoPE: `RECOMPUTE[/ATTENTION[/ROPE]]`,
ATTENTION `torch` (torch's FlashAttention-2) or `fa4` (FlashAttention-4,
`learner.flash_attention`), ROPE `compiled` (`learner.megatron.compile`'s RoPE) or `eager`
(megatron-core's unfused one); by default what the learner config gives (`auto`: FA4 where it
imports, the compiled RoPE with compile on). `full/torch/eager` is the step before either
existed. Both are switched between variants in the one process (`flash.choose`,
`speed.compiled_rope`).

The variants share one backend: Megatron's TransformerBlock reads `recompute_granularity`,
`recompute_method` and `recompute_num_layers` from its config at every forward, so each
variant sets them there (the values `build_transformer_config` gives for that setting).
Per variant: a warm-up step, `--steps` (2) timed ones with CUDA events around the
optimizer step, the allocator's peak, and one more step under torch.profiler whose CUDA
kernel time is summed by kind (matmul, attention, compiled elementwise, other elementwise,
reductions and norms, optimizer, copies) with the top kernels by time, the GPU's idle share,
and the same per phase (`step_profile.profile_step`). MFU against the 989e12 dense bf16
peak, trained tokens only:

    mfu_6n        6 N tokens / step time (the issue's formula and the run's report)
    mfu_work      (6 N + 2 N x the share of layers recomputed) tokens plus attention's causal
                  score and value matmuls per sample (x 3 for training, x 4 with the
                  recompute's forward, scaled the same way) / step time: the work the GPU did
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_check as base  # (it also puts the repository on sys.path)
import packing_check as packing
from step_profile import StepClock, profile_step, timed_optimizer

VARIANTS = ("full", "half", "none")
ATTENTIONS = ("torch", "fa4")
ROPES = ("compiled", "eager")


def set_recompute(model, variant: str) -> dict:
    """The variant's recompute fields on the model's (shared) TransformerConfig, as
    `build_transformer_config` sets them for that learner config."""
    from streamrl.backends.megatron.model import _recompute_kwargs

    config = model.config
    layers = config.num_layers
    recomputed = {"full": layers, "half": layers // 2, "none": 0}[variant]
    names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    kwargs = _recompute_kwargs(recomputed, layers) if recomputed else dict.fromkeys(names)
    for name in names:
        setattr(config, name, kwargs[name])
    fields = tuple(kwargs[name] for name in names)
    return {"recompute": fields, "recomputed_share": recomputed / layers}


def work_flops(flops: dict, recomputed_share: float) -> float:
    extra = recomputed_share * (flops["old_logprob_2n"] + flops["attention_old_logprob"])
    return flops["train_6n"] + flops["attention_train"] + extra


def parse_variant(text: str) -> tuple[str, str | None, str | None]:
    """`RECOMPUTE[/ATTENTION[/ROPE]]` (the module docstring) -> its three parts, None unset."""
    recompute, attention, rope = [*text.split("/"), None, None][:3]
    if recompute not in VARIANTS or attention not in (None, *ATTENTIONS) or rope not in (
        None, *ROPES
    ):  # fmt: skip
        raise ValueError(
            f"variant {text!r}: RECOMPUTE[/ATTENTION[/ROPE]] with RECOMPUTE one of {VARIANTS}, "
            f"ATTENTION one of {ATTENTIONS}, ROPE one of {ROPES}"
        )
    return recompute, attention, rope


def set_kernels(backend, attention: str | None, rope: str | None) -> dict:
    """Switch the process's attention kernels and RoPE for a variant; returns what runs."""
    from streamrl.backends import flash
    from streamrl.backends.megatron import speed

    if attention is not None:
        flash.choose(attention, backend.device)
    if rope is not None:
        speed.compiled_rope(rope == "compiled")
    return {"attention": flash.kernel(), "rope": "compiled" if speed.rope_compiled() else "eager"}


def measure_variant(backend, batches, flops: dict, variant: str, steps: int) -> dict:
    from megatron_ranks import nll_loss

    recompute, attention, rope = parse_variant(variant)
    kernels = set_kernels(backend, attention, rope)
    result = set_recompute(backend.model, recompute) | kernels
    clock = StepClock(base.PLAN.device)
    timed_optimizer(backend, clock)  # marks the optimizer step's start and end

    def step() -> None:
        clock.mark("between_steps_s")
        backend.train_mini_batch(batches, nll_loss, temperature=1.0, need_entropy=True)
        clock.mark("metrics_s")

    base.reset_peak_memory()
    try:
        started = time.perf_counter()
        step()  # warm-up: compilation, allocations
        base.synchronize()
        result["first_step_s"] = round(time.perf_counter() - started, 2)
        clock.phases_s()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        base.synchronize()
    except torch.OutOfMemoryError as exc:
        result.update(out_of_memory=True, error=str(exc).split("\n")[0][:300])
        result["peak_memory_gib"] = base.peak_memory_gib()
        return result
    step_s = (time.perf_counter() - started) / steps
    phases = {name: round(s / steps, 4) for name, s in clock.phases_s().items()}
    mfu = flops["train_6n"] / step_s / base.PEAK_BF16_FLOPS
    result.update(
        out_of_memory=False, step_s=round(step_s, 4), phases_s=phases,
        tokens_per_s=round(flops["tokens"] / step_s, 1), mfu_6n=round(mfu, 4),
        mfu_work=round(work_flops(flops, result["recomputed_share"]) / step_s
                       / base.PEAK_BF16_FLOPS, 4),
        peak_memory_gib=base.peak_memory_gib(),
    )  # fmt: skip
    clock.marks_profiler = True  # the profile's phases
    result["profile"] = profile_step(step, base.PLAN.device, top=25)
    clock.phases_s()
    return result


def run(model_dir: Path, out_path: Path, *, samples: int, budget: int, steps: int,
        variants: tuple[str, ...]) -> dict:  # fmt: skip
    import warnings

    from transformers import AutoConfig

    from streamrl.backends.batching import token_counts
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.backends.megatron.model import shape_from_hf
    from streamrl.config import LearnerConfig, MegatronConfig

    warnings.filterwarnings("ignore")
    packing.PLAN = packing.Plan(
        device=base.PLAN.device, dtype=base.PLAN.dtype, budget=budget,
        **({"prompt": (4, 32), "response": (8, 256)} if base.PLAN.device == "cpu" else {}),
    )  # fmt: skip
    report: dict = {
        "environment": base.environment(), "model": str(model_dir), "samples": samples,
        "budget": budget, "steps": steps, "variants": {},
    }  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=2))

    base.init_single_rank()
    shape = shape_from_hf(AutoConfig.from_pretrained(model_dir))
    batch_samples = packing.spread_samples(
        samples, prompt=packing.PLAN.prompt, response=packing.PLAN.response,
        vocab=shape.vocab_size,
    )  # fmt: skip
    batches = packing.layout_batches(batch_samples, packed=True)
    real, computed = token_counts(batches)
    config = LearnerConfig(
        backend="megatron", lr=1e-6, micro_batch_tokens=budget, pack_sequences=True,
        gradient_checkpointing=True, megatron=MegatronConfig(use_distributed_optimizer=True),
    )  # fmt: skip
    started = time.perf_counter()
    backend = MegatronBackend(
        str(model_dir), config, device=base.PLAN.device, dtype=base.PLAN.dtype, seed=0
    )
    num_params = sum(p.numel() for p in backend.model.parameters())
    flops = packing.sample_flops(shape, num_params, batch_samples)
    report.update(
        build_s=round(time.perf_counter() - started, 1), num_params=num_params,
        micro_batches=len(batches), tokens=real, token_efficiency=round(real / computed, 4),
        compiled=backend.compiled, flops=flops,
    )  # fmt: skip
    save()
    for variant in variants:
        try:
            report["variants"][variant] = measure_variant(backend, batches, flops, variant, steps)
        except Exception:
            report["variants"][variant] = {"error": traceback.format_exc()}
        print(f"[learner_profile] {variant}: {json.dumps(report['variants'][variant])[:1500]}",
              flush=True)  # fmt: skip
        base.free_cuda()
        save()
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face directory (random weights)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--budget", type=int, default=16384, help="learner.micro_batch_tokens")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="RECOMPUTE[/ATTENTION[/ROPE]], comma-separated",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU")
    args = parser.parse_args()
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for variant in variants:
        try:
            parse_variant(variant)
        except ValueError as exc:
            parser.error(str(exc))
    model = args.model
    if args.cpu_smoke:
        base.PLAN = base.SMOKE
        model = model or base.save_random_hf(
            "qwen3-tiny", args.out.parent / "learner-profile-qwen3-tiny"
        )
        args.budget = min(args.budget, 512)
    if model is None:
        parser.error("--model is required (or --cpu-smoke)")
    run(model, args.out, samples=args.samples, budget=args.budget, steps=args.steps,
        variants=variants)  # fmt: skip


if __name__ == "__main__":
    main()
