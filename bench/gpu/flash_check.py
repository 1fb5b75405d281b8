"""FlashAttention-4 against torch's kernels on the learner's attention shapes: accuracy and
speed (`learner.flash_attention`, streamrl/backends/flash.py).

Run from the repository root on a Hopper or Blackwell GPU with `flash-attn-4` installed:

    python bench/gpu/flash_check.py --out bench/results/gpu/flash_check_h200x1.json

Cases (bf16, causal; forward and backward):

    qwen3-4b_packed    32 query heads, 8 key/value groups, head 128: 16 samples of 64..511
                       prompt + 256..8,192 response tokens (seeded) as one variable-length
                       batch, as the packed 4B learner hands them over (bench/gpu/
                       learner_profile.py): torch's `varlen_attn` against
                       `flash_attn_varlen_func`
    qwen2-0.5b_rows    14 heads, 2 groups, head 64: 2 rows of 4,096 tokens, SDPA against
                       `flash_attn_func` (megatron_check.py's throughput rows)
    qwen2-1.5b_rows    12 heads, 2 groups, head 128: the same rows

Accuracy: on a smaller batch of the same head layout (4 samples, 1,024 tokens at most) the
float32 attention of each sample alone is the reference; each kernel's output and its
query, key and value gradients are compared with it (the largest difference, and the norm of
the difference over the reference's norm). FlashAttention-4 passes where its errors are of
the order of torch's bf16 kernel's (both round the same inputs to bf16). Speed: the median
of `--repeats` forward + backward calls after two warm-ups (the first FlashAttention-4 call
compiles its kernels: its time is reported as `first_call_s`), as TFLOP/s of causal work
(4 x head dim x heads per query-key pair forward, 2.5 times that backward).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from streamrl.backends import documents, flash  # noqa: E402

CASES = {
    # name: (heads, groups, head dim, packed?, lengths or (rows, seq))
    "qwen3-4b_packed": (32, 8, 128, True, None),
    "qwen2-0.5b_rows": (14, 2, 64, False, (2, 4096)),
    "qwen2-1.5b_rows": (12, 2, 128, False, (2, 4096)),
}


def sample_lengths(count: int, *, seed: int, longest_response: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(64, 511) + rng.randint(256, longest_response) for _ in range(count)]


def causal_pairs(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def tensors(total: int, heads: int, groups: int, dim: int, *, seed: int, dtype=torch.bfloat16):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def draw(h: int) -> torch.Tensor:
        return torch.randn(total, h, dim, device="cuda", dtype=dtype, generator=generator)

    return draw(heads), draw(groups), draw(groups), draw(heads)  # q, k, v, upstream gradient


def cumulative(lengths: list[int]) -> torch.Tensor:
    edges = [0]
    for n in lengths:
        edges.append(edges[-1] + n)
    return torch.tensor(edges, dtype=torch.int32, device="cuda")


def attention(kernel: str, q, k, v, lengths: list[int], packed: bool, scale: float):
    """One causal attention call of `kernel` over the flattened batch [T, h, d]."""
    if packed:
        edges, longest = cumulative(lengths), max(lengths)
        if kernel == "fa4":
            return flash.fa4_varlen(q, k, v, edges, longest, scale=scale)
        varlen_attn = documents._varlen_function()  # torch's, with this release's keywords
        options = dict(documents._VARLEN["causal"])
        if documents._VARLEN["gqa"]:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, edges, edges, longest, longest, scale=scale, **options)
    rows, seq = len(lengths), lengths[0]
    q4, k4, v4 = (t.view(rows, seq, t.shape[1], t.shape[2]) for t in (q, k, v))
    if kernel == "fa4":
        return flash.fa4_causal(q4, k4, v4, scale=scale).reshape(q.shape)
    out = F.scaled_dot_product_attention(
        q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), is_causal=True,
        scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).reshape(q.shape)


def reference(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """float32 attention of each sample alone."""
    parts, start = [], 0
    for n in lengths:
        part = [t[start : start + n].float().transpose(0, 1)[None] for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*part, is_causal=True, scale=scale, enable_gqa=True)
        parts.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(parts)


def forward_backward(kernel, q, k, v, grad, lengths, packed, scale):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(kernel, *leaves, lengths, packed, scale)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got.float() - want.float()).abs()
    return {
        "max_abs": float(diff.max()),
        "relative_norm": float(diff.norm() / want.float().norm().clamp_min(1e-30)),
    }


def accuracy(heads: int, groups: int, dim: int, packed: bool) -> dict:
    lengths = sample_lengths(4, seed=1, longest_response=512) if packed else [1024, 1024]
    q, k, v, grad = tensors(sum(lengths), heads, groups, dim, seed=2)
    scale = dim**-0.5
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    want = reference(*leaves, lengths, scale)
    want.backward(grad.float())
    wanted = [want.detach(), *(leaf.grad for leaf in leaves)]
    result = {"lengths": lengths}
    for kernel in ("torch", "fa4"):
        out, grads = forward_backward(kernel, q, k, v, grad, lengths, packed, scale)
        result[kernel] = {
            name: errors(got, ref)
            for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), wanted, strict=True)
        }
    return result


def speed(heads: int, groups: int, dim: int, packed: bool, shape, repeats: int) -> dict:
    lengths = sample_lengths(16, seed=0) if packed else [shape[1]] * shape[0]
    q, k, v, grad = tensors(sum(lengths), heads, groups, dim, seed=3)
    scale = dim**-0.5
    forward_flops = 4 * dim * heads * causal_pairs(lengths)
    result: dict = {"tokens": sum(lengths), "lengths": lengths}
    outputs = {}
    for kernel in ("torch", "fa4"):
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs[kernel] = forward_backward(kernel, q, k, v, grad, lengths, packed, scale)
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        forward_backward(kernel, q, k, v, grad, lengths, packed, scale)
        times = {"forward": [], "forward_backward": []}
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        for _ in range(repeats):
            begin, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            begin.record()
            out = attention(kernel, *leaves, lengths, packed, scale)
            middle.record()
            out.backward(grad)
            end.record()
            end.synchronize()
            times["forward"].append(begin.elapsed_time(middle) / 1e3)
            times["forward_backward"].append(begin.elapsed_time(end) / 1e3)
        forward_s = statistics.median(times["forward"])
        total_s = statistics.median(times["forward_backward"])
        result[kernel] = {
            "first_call_s": round(first, 3),
            "forward_s": round(forward_s, 5),
            "backward_s": round(total_s - forward_s, 5),
            "forward_tflops": round(forward_flops / forward_s / 1e12, 1),
            "backward_tflops": round(2.5 * forward_flops / (total_s - forward_s) / 1e12, 1),
            "forward_backward_tflops": round(3.5 * forward_flops / total_s / 1e12, 1),
        }
    seconds = {kernel: result[kernel]["forward_s"] + result[kernel]["backward_s"]
               for kernel in ("torch", "fa4")}  # fmt: skip
    result["speedup_forward_backward"] = round(seconds["torch"] / seconds["fa4"], 3)
    result["fa4_vs_torch"] = {
        name: errors(a, b)
        for name, a, b in zip(
            ("out", "dq", "dk", "dv"),
            (outputs["fa4"][0], *outputs["fa4"][1]),
            (outputs["torch"][0], *outputs["torch"][1]),
            strict=True,
        )
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    report: dict = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "fa4_problem": flash.fa4_problem(device),
        "cases": {},
    }
    if report["fa4_problem"] is None:
        flash.choose("fa4", device)
        from importlib import metadata

        report["flash-attn-4"] = metadata.version("flash-attn-4")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        heads, groups, dim, packed, shape = CASES[name]
        entry = report["cases"].setdefault(name, {"heads": heads, "groups": groups, "dim": dim})
        parts = {
            "accuracy": lambda: accuracy(heads, groups, dim, packed),  # noqa: B023 (called now)
            "speed": lambda: speed(heads, groups, dim, packed, shape, args.repeats),  # noqa: B023
        }
        for part, run in parts.items():
            try:
                entry[part] = run()
            except Exception:
                entry[part] = {"error": traceback.format_exc()}
            print(f"[flash_check] {name} {part}: {json.dumps(entry[part])[:1500]}", flush=True)
            args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report)[:3000])


if __name__ == "__main__":
    main()
