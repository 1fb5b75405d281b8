"""Packed against right-padded micro-batches on one GPU: the Megatron learner's RL step time,
MFU and token efficiency on responses spread over 256..8,192 tokens, and log-probability
parity between the layouts (issue 27, item 2).

Run from the repository root (about 5-8 minutes on one H200):

    python bench/gpu/packing_check.py --out bench/results/gpu/packing_check.json

`--cpu-smoke` runs every section on tiny shapes on the CPU (checks the script, not the GPU).

Sections, each in its own try/except (a failure records its traceback and the run goes on);
the JSON is rewritten after every measurement and printed at the end:

(a) `megatron_step`: for the Qwen2-0.5B and Qwen2-1.5B shapes (random weights, bf16), one
    step's samples: 32 samples, prompts of 64..511 tokens, responses uniform in 256..8,192,
    `learner.micro_batch_tokens` = 16,384. For each layout (`padded`:
    `learner.pack_sequences = false`; `packed`: true, variable-length flash attention) one
    RL step as `megatron_check.rl_step` runs it (old-policy log-probabilities, then forward
    and backward of every micro-batch with entropy, then Adam), a warm-up step, then 3
    timed ones. Reported per layout: step time and its phases, tokens/s,
    the micro-batches' count, `token_efficiency` (samples' tokens / computed tokens), peak
    memory, and MFU against the 989e12 dense bf16 peak counting samples' tokens only:
      mfu_6n                   6 N tokens / step time (the issue's formula)
      mfu_8n_causal_attention  (6 + 2) N tokens plus attention's score and value matmuls
                               of each sample alone, causal (2 d s (s + 1) per sample and
                               layer forward, x 3 for training, d = heads x head dim)
    and `packed_over_padded`: the ratio of the step times and of tokens/s.
(b) `megatron_parity`: the 0.5B shape's log-probabilities of the same samples (8 of them,
    shorter: responses 256..2,048) in both layouts through one backend: mean and max |diff|
    over response tokens (bf16; different attention kernels, so not bit-equal), and the
    same for the padded layout against itself run twice (the noise floor).
(c) `torch_parity`: the torch backend (transformers, bf16 autocast) on the 0.5B shape, the
    same comparison (packed rows attend through `streamrl.backends.documents`: varlen flash
    on CUDA, on each sample alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_check as base  # (it also puts the repository on sys.path)

TIMED_STEPS = 3


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    shapes: tuple[str, ...] = ("qwen2-0.5b", "qwen2-1.5b")
    num_samples: int = 32
    prompt: tuple[int, int] = (64, 512)
    response: tuple[int, int] = (256, 8192)
    parity_samples: int = 8
    parity_response: tuple[int, int] = (256, 2048)
    budget: int = 16384


SMOKE = Plan(
    device="cpu", dtype=torch.float32, shapes=("qwen2-tiny",), num_samples=8, prompt=(4, 32),
    response=(8, 256), parity_samples=4, parity_response=(8, 64), budget=512,
)  # fmt: skip
PLAN = Plan()


def spread_samples(num: int, *, prompt: tuple[int, int], response: tuple[int, int], vocab: int):
    from streamrl.types import Sample

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(num):
        length = int(rng.integers(response[0], response[1] + 1))
        samples.append(
            Sample(
                prompt_ids=rng.integers(1, vocab, int(rng.integers(*prompt))),
                response_ids=rng.integers(1, vocab, length),
                logprobs=-rng.random(length),
                versions=[0] * length,
                loss_mask=np.ones(length),
            )
        )
    return samples


def layout_batches(samples, *, packed: bool):
    from streamrl.backends.batching import make_micro_batches

    batches = make_micro_batches(
        samples, list(range(len(samples))), token_budget=PLAN.budget, pad_id=0, packed=packed
    )
    for batch in batches:  # nll_loss checks a per-row extra travelled with its rows
        batch.extras["row_weight"] = torch.zeros(batch.input_ids.shape[0])
    return batches


def sample_flops(shape, num_params: int, samples) -> dict:
    """`megatron_check.step_flops` from each sample's own length (a packed row is several)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    tokens = sum(lengths)
    width = shape.num_heads * shape.head_dim
    attention_forward = 2 * shape.num_layers * width * sum(n * (n + 1) for n in lengths)
    return {
        "tokens": tokens,
        "train_6n": 6 * num_params * tokens,
        "old_logprob_2n": 2 * num_params * tokens,
        "attention_train": 3 * attention_forward,
        "attention_old_logprob": attention_forward,
    }


def megatron_backend(model_dir: Path, *, packed: bool):
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.config import LearnerConfig, MegatronConfig

    config = LearnerConfig(
        backend="megatron", lr=1e-6, micro_batch_tokens=PLAN.budget, pack_sequences=packed,
        megatron=MegatronConfig(use_distributed_optimizer=True),
    )  # fmt: skip
    return MegatronBackend(str(model_dir), config, device=PLAN.device, dtype=PLAN.dtype, seed=0)


def megatron_step(model_dir: Path, out: dict, save) -> None:
    from transformers import AutoConfig

    from streamrl.backends.batching import token_counts
    from streamrl.backends.megatron.model import shape_from_hf

    shape = shape_from_hf(AutoConfig.from_pretrained(model_dir))
    samples = spread_samples(
        PLAN.num_samples, prompt=PLAN.prompt, response=PLAN.response, vocab=shape.vocab_size
    )
    for name in ("padded", "packed"):
        try:
            backend = megatron_backend(model_dir, packed=name == "packed")
            num_params = sum(p.numel() for p in backend.model.parameters())
            batches = layout_batches(samples, packed=name == "packed")
            real, computed = token_counts(batches)
            flops = sample_flops(shape, num_params, samples)
            base.reset_peak_memory()
            result = base.time_rl_steps(backend, batches, flops, steps=TIMED_STEPS)
            result.update(micro_batches=len(batches), token_efficiency=round(real / computed, 4))
            out[name] = result
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        print(f"[packing_check] {name}: {json.dumps(out[name])[:1500]}", flush=True)
        backend = batches = None
        base.free_cuda()
        save()
    if "step_s" in out.get("padded", {}) and "step_s" in out.get("packed", {}):
        out["packed_over_padded"] = {
            "step_time": round(out["packed"]["step_s"] / out["padded"]["step_s"], 4),
            "tokens_per_s": round(out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"], 4),
        }


def _response_diffs(samples, first, second) -> dict:
    diffs = torch.cat(
        [(first[i, : len(s.response_ids)] - second[i, : len(s.response_ids)]).abs()
         for i, s in enumerate(samples)]
    )  # fmt: skip
    return {"mean_abs": float(diffs.mean()), "max_abs": float(diffs.max()), "tokens": diffs.numel()}


def megatron_parity(model_dir: Path) -> dict:
    from transformers import AutoConfig

    from streamrl.backends.batching import gather_responses

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    samples = spread_samples(
        PLAN.parity_samples, prompt=PLAN.prompt, response=PLAN.parity_response, vocab=vocab
    )
    backend = megatron_backend(model_dir, packed=True)
    runs = {}
    for name, packed in (("padded", False), ("padded_again", False), ("packed", True)):
        batches = layout_batches(samples, packed=packed)
        runs[name] = gather_responses(
            samples, batches, backend.compute_logprobs(batches, temperature=1.0)
        )
    return {
        "packed_vs_padded": _response_diffs(samples, runs["packed"], runs["padded"]),
        "padded_vs_padded": _response_diffs(samples, runs["padded_again"], runs["padded"]),
    }


def torch_parity(model_dir: Path) -> dict:
    from transformers import AutoConfig

    from streamrl.backends.batching import gather_responses, make_micro_batches
    from streamrl.backends.torch import TorchBackend
    from streamrl.config import LearnerConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    samples = spread_samples(
        PLAN.parity_samples, prompt=PLAN.prompt, response=PLAN.parity_response, vocab=vocab
    )
    backend = TorchBackend(
        str(model_dir), LearnerConfig(pack_sequences=True), device=torch.device(PLAN.device),
        dtype=PLAN.dtype,
    )  # fmt: skip
    runs = {}
    for name, packed in (("padded", False), ("padded_again", False), ("packed", True)):
        batches = make_micro_batches(
            samples, list(range(len(samples))), token_budget=PLAN.budget, pad_id=0,
            packed=packed,
        )  # fmt: skip
        base.synchronize()
        start = time.perf_counter()
        logprobs = backend.compute_logprobs(batches, temperature=1.0)
        base.synchronize()
        runs[name] = gather_responses(samples, batches, logprobs)
        runs[f"{name}_s"] = round(time.perf_counter() - start, 4)
    return {
        "packed_vs_padded": _response_diffs(samples, runs["packed"], runs["padded"]),
        "padded_vs_padded": _response_diffs(samples, runs["padded_again"], runs["padded"]),
        "forward_s": {name: runs[f"{name}_s"] for name in ("padded", "padded_again", "packed")},
    }


SECTIONS = ("megatron_step", "megatron_parity", "torch_parity")


def run(out_path: Path, sections: tuple[str, ...]) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    report: dict = {"environment": base.environment(), "plan": repr(PLAN), "sections_s": {}}
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory(prefix="packing-check-") as tmp:
        base.init_single_rank()
        dirs = {shape: base.save_random_hf(shape, Path(tmp) / shape) for shape in PLAN.shapes}
        small = dirs[PLAN.shapes[0]]
        for name in sections:
            started = time.perf_counter()
            try:
                if name == "megatron_step":
                    steps = report.setdefault(name, {})
                    for shape, model_dir in dirs.items():
                        megatron_step(model_dir, steps.setdefault(shape, {}), save)
                elif name == "megatron_parity":
                    report[name] = megatron_parity(small)
                else:
                    report[name] = torch_parity(small)
            except Exception:
                report[name] = {"error": traceback.format_exc()}
            report["sections_s"][name] = round(time.perf_counter() - started, 1)
            print(f"[packing_check] section {name}: {report['sections_s'][name]} s", flush=True)
            base.free_cuda()
            save()
    print(json.dumps(report))
    return report


def main() -> None:
    global PLAN
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=base.REPO / "bench/results/gpu/packing_check.json"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    sections = tuple(name.strip() for name in args.sections.split(",") if name.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if args.cpu_smoke:
        PLAN = SMOKE
        base.PLAN = base.SMOKE
    run(args.out, sections)


if __name__ == "__main__":
    main()
