"""The Megatron learner's hand-written Triton kernels against what they replace, on one GPU.

    python3 bench/gpu/kernel_check.py --out bench/results/gpu/kernel_check_h200x1.json

At Qwen2-1.5B's shapes with one 32,768-token micro-batch (8 rows of 4,096 tokens), bf16:

- log-probabilities (`logprob_kernels`): the row statistics (with and without the entropy's
  sum) and the logits' gradient over [32,768, 151,936] logits, against the torch.compile'd
  functions of `logprobs` (what `learner.megatron.compile` ran before) and a device copy of
  the same bytes;
- RoPE (`rope`): a query view of a fused projection [4,096, 8, 12 of 16 heads, 128],
  forward and forward + backward, against megatron-core's `_apply_rotary_pos_emb_bshd`
  torch.compile'd with dynamic shapes (`speed.compiled_rope`);
- SwiGLU (`swiglu`): [32,768, 2 x 8,960] forward and backward, against megatron-core's
  torch.compile'd `swiglu` / `swiglu_back` as compiled for this one shape (`compiled`),
  and as compiled for any shape (`compiled_dynamic`), which is what torch.compile switches
  to once a second shape arrives, as a learner's micro-batches bring them.

Each figure is `triton.testing.do_bench`'s median in milliseconds, with the bytes the
operation must read and write over that time (TB/s). Needs CUDA and Triton (about a
minute on an H200, most of it compiling). The JSON records the commit (`STREAMRL_COMMIT`),
the command and the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ROWS, VOCAB = 32_768, 151_936  # Qwen2-1.5B's vocabulary, one 32k-token micro-batch
SEQ, BATCH, HEADS, FUSED_HEADS, HEAD_DIM = 4096, 8, 12, 16, 128  # 12 query heads of 16
FFN = 8960


def timed(function, moved_bytes: int) -> dict:
    from triton.testing import do_bench

    ms = do_bench(function, warmup=10, rep=100)
    return {"ms": round(ms, 4), "tb_per_s": round(moved_bytes / (ms * 1e-3) / 1e12, 3)}


def logprob_figures(generator: torch.Generator) -> dict:
    from streamrl.backends.megatron import logprob_kernels, logprobs

    logits = (3 * torch.randn(ROWS, VOCAB, device="cuda", generator=generator)).bfloat16()
    index = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=generator)
    per_row = torch.randn(3, ROWS, device="cuda", generator=generator)
    scale, size = 1 / 0.7, logits.numel() * logits.element_size()
    compiled_stats = torch.compile(logprobs._row_stats, dynamic=True)
    compiled_grads = torch.compile(logprobs._row_grads, dynamic=True)
    row_max, _, sum_exp, weighted = logprobs._row_stats(logits, index, scale, True)
    log_norm = row_max + sum_exp.log()
    entropy = log_norm - row_max - weighted / sum_exp
    grad_args = (index, log_norm, per_row[0], per_row[1], entropy)
    result = {"shape": [ROWS, VOCAB], "copy": timed(logits.clone, 2 * size)}
    for entropy_too in (False, True):
        name = "with_entropy" if entropy_too else "without_entropy"
        grad_entropy = per_row[2] if entropy_too else None
        stats_args = (logits, index, scale, entropy_too)
        grads_args = (logits, *grad_args, grad_entropy, scale)
        result[f"stats_{name}"] = {
            "triton": timed(partial(logprob_kernels.row_stats, *stats_args), size),
            "compiled": timed(partial(compiled_stats, *stats_args), size),
        }
        result[f"grads_{name}"] = {
            "triton": timed(partial(logprob_kernels.row_grads, *grads_args), 2 * size),
            "compiled": timed(partial(compiled_grads, *grads_args), 2 * size),
        }
    return result


def rope_figures(generator: torch.Generator) -> dict:
    from streamrl.backends.megatron import rope, speed

    speed.compiled_rope(True)  # installs the dispatcher; its `eager` is Megatron's function
    eager = speed._ROPE["eager"]
    compiled = torch.compile(eager, dynamic=True)
    fused = torch.randn(SEQ, BATCH, FUSED_HEADS, HEAD_DIM, device="cuda", generator=generator)
    query = fused.bfloat16()[:, :, :HEADS]
    inverse = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM)
    angles = torch.outer(torch.arange(SEQ, device="cuda").float(), inverse)
    freqs = torch.cat((angles, angles), -1)[:, None, None, :]
    upstream = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, device="cuda", generator=generator)
    upstream = upstream.bfloat16()
    size = query.numel() * query.element_size()
    leaf = query.detach().requires_grad_(True)

    def both(function):
        def step():
            torch.autograd.grad(function(leaf, freqs), leaf, upstream)

        return step

    result = {"shape": [SEQ, BATCH, HEADS, HEAD_DIM]}
    for name, function in (("triton", rope.apply), ("compiled", compiled)):
        result[name] = {
            "forward": timed(lambda f=function: f(query, freqs), 2 * size),
            "forward_backward": timed(both(function), 4 * size),
        }
    return result


def swiglu_figures(generator: torch.Generator) -> dict:
    from megatron.core.fusions import fused_bias_swiglu

    from streamrl.backends.megatron import swiglu

    y = torch.randn(ROWS, 2 * FFN, device="cuda", generator=generator).bfloat16()
    grad = torch.randn(ROWS, FFN, device="cuda", generator=generator).bfloat16()
    size_in, size_out = y.numel() * 2, grad.numel() * 2
    result = {"shape": [ROWS, 2 * FFN]}

    def dynamic(function):  # megatron-core's torch.compile'd function, compiled for any shape
        return torch.compile(
            getattr(function, "_torchdynamo_orig_callable", function), dynamic=True
        )

    pairs = (
        ("triton", swiglu.swiglu, swiglu.swiglu_back),
        ("compiled", fused_bias_swiglu.swiglu, fused_bias_swiglu.swiglu_back),
        (
            "compiled_dynamic",
            dynamic(fused_bias_swiglu.swiglu),
            dynamic(fused_bias_swiglu.swiglu_back),
        ),
    )
    for name, forward, backward in pairs:
        result[name] = {
            "forward": timed(lambda f=forward: f(y), size_in + size_out),
            "backward": timed(lambda b=backward: b(grad, y), size_out + 2 * size_in),
        }
    return result


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_check.py needs a CUDA GPU (and Triton)")
    started = time.perf_counter()
    report = {
        "commit": os.environ.get("STREAMRL_COMMIT", ""),
        "command": " ".join(["python3", *sys.argv]),
        "environment": environment(),
    }
    for name, section in (
        ("logprobs", logprob_figures), ("rope", rope_figures), ("swiglu", swiglu_figures)
    ):  # fmt: skip
        generator = torch.Generator(device="cuda").manual_seed(0)
        report[name] = section(generator)
        print(f"[kernel_check] {name}: {json.dumps(report[name])}", flush=True)
        torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
