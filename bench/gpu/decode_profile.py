"""Where the embedded engine's decode step spends its time, per batch size (diagnosis).

Run from the repository root on a GPU machine (about 2 minutes on one H200):

    python bench/gpu/decode_profile.py --out OUT/decode_profile_h200x1.json

For a random ``--shape`` served by the compact runner exactly as `streamrl engine serve`
builds it (CUDA graphs, compiled elementwise kernels), with ``--lanes`` sequences of
``--prompt-tokens`` random tokens prefilled, it reports per lane count:

- ``graph_ms``: GPU time of one decode-graph replay (CUDA events around 40 replays);
- ``loop_ms``: wall time per step of the runner's own loop (launch a step, collect the
  previous one: what the scheduler does, without HTTP or the scheduler's Python);
- ``kernels_per_step`` and the kernels' summed GPU time per step, from the torch
  profiler over 5 replays, with the top kernels by time and a breakdown by kind
  (matmul, attention, elementwise, copy/index, reduction/sampling).

``--variants`` builds the runner once per named set of `CompactRunner` options so two
forms of the step are compared in one run (`base` is the default runner).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

KINDS = (
    ("matmul", re.compile(r"gemm|cutlass|sm90|nvjet|matmul|splitk|xmma", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("copy/index", re.compile(r"copy|index|scatter|gather|cat|memcpy|memset|fill", re.I)),
    ("reduction/sampling", re.compile(r"reduce|scan|sort|search|argmax|logsumexp|cumsum", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "elementwise/fused"


def build(shape: str, max_batch_size: int, max_seq_len: int, options: dict):
    from streamrl import models
    from streamrl.engine.runner.compact import CompactRunner

    path = models.random_model_dir(shape, seed=0)
    config = models.model_config(str(path))
    state = models.read_checkpoint(str(path))
    return CompactRunner(
        config,
        state,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_prefill_tokens=32768,
        cuda_graphs=True,
        compile_elementwise=True,
        **options,
    ), config


def fill(runner, lanes: int, prompt_tokens: int, vocab: int) -> None:
    from streamrl.engine.core import SamplingParams
    from streamrl.engine.runner.sequence import Sequence

    runner.release(list(runner.lanes))
    generator = torch.Generator().manual_seed(lanes)
    params = SamplingParams(max_new_tokens=10_000, temperature=1.0, ignore_eos=True)
    seqs = []
    for index in range(lanes):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()
        seqs.append(Sequence(f"r{index}", prompt, params, index, lambda seq: None))
    for start in range(0, lanes, 128):
        group = seqs[start : start + 128]
        tokens, _ = runner.prefill([[seq] for seq in group])
        for seq, token in zip(group, tokens, strict=True):
            seq.output_ids.append(token)


def measure(runner, lanes: int, steps: int) -> dict:
    from streamrl.engine.runner.graphs import bucket_for

    # The lane buffers advance on the device; the host's Sequence objects are not
    # appended to here (positions stay within max_seq_len for the steps run).
    pending = runner.launch_decode()
    runner.collect(pending)
    torch.cuda.synchronize()
    start = time.perf_counter()
    previous = None
    for _ in range(steps):
        launched = runner.launch_decode()
        if previous is not None:
            runner.collect(previous)
        previous = launched
    runner.collect(previous)
    loop_ms = (time.perf_counter() - start) * 1000 / steps

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        runner.graphs.replay(lanes, False)
    end.record()
    torch.cuda.synchronize()
    graph_ms = begin.elapsed_time(end) / steps

    profiled = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            runner.graphs.replay(lanes, False)
        torch.cuda.synchronize()
    row = summarize(prof, profiled)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):  # the same kernels, launched one by one
            runner._decode_body(bucket_for(runner.max_batch_size, lanes), False)
        torch.cuda.synchronize()
    return {
        "lanes": lanes,
        "graph_ms": round(graph_ms, 4),
        "loop_ms": round(loop_ms, 4),
        "graph": row,
        "eager": summarize(prof, profiled),
    }


def summarize(prof, profiled: int) -> dict:
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    rows = sorted(kernels.items(), key=lambda item: -item[1][1])
    by_kind: dict[str, list[float]] = {}
    for name, (count, us) in rows:
        entry = by_kind.setdefault(kind_of(name), [0, 0.0])
        entry[0] += count / profiled
        entry[1] += us / profiled
    return {
        "kernels_per_step": round(sum(c for c, _ in kernels.values()) / profiled, 1),
        "kernel_ms_per_step": round(sum(us for _, us in kernels.values()) / profiled / 1000, 4),
        "by_kind": {
            kind: {"kernels": round(c, 1), "ms": round(us / 1000, 4)}
            for kind, (c, us) in sorted(by_kind.items(), key=lambda item: -item[1][1])
        },
        "top": [
            {
                "name": name[:140],
                "per_step": round(count / profiled, 1),
                "us_per_step": round(us / profiled, 1),
            }
            for name, (count, us) in rows[:25]
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b-smolvocab")
    parser.add_argument("--lanes", default="64,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=448)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--variants",
        default="base",
        help="comma-separated NAME or NAME=JSON-options for CompactRunner (base: none)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    lane_counts = [int(x) for x in args.lanes.split(",")]
    result = {
        "command": " ".join(sys.argv),
        "commit": os.environ.get("STREAMRL_COMMIT", "unknown"),
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "config": vars(args),
        "variants": {},
    }
    for spec in args.variants.split(","):
        name, _, options = spec.partition("=")
        started = time.perf_counter()
        runner, config = build(
            args.shape, max(lane_counts), args.max_seq_len, json.loads(options or "{}")
        )
        rows = []
        for lanes in lane_counts:
            fill(runner, lanes, args.prompt_tokens, config.vocab_size)
            rows.append(measure(runner, lanes, args.steps))
            row = rows[-1]
            print(
                name,
                lanes,
                row["graph_ms"],
                row["loop_ms"],
                row["graph"]["kernels_per_step"],
                row["eager"]["kernels_per_step"],
                flush=True,
            )
        result["variants"][name] = {
            "options": json.loads(options or "{}"),
            "build_s": round(time.perf_counter() - started, 1),
            "rows": rows,
        }
        del runner
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
