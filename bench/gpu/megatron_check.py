"""Megatron backend on one or two GPUs: correctness against Hugging Face, and learner throughput.

Run from the repository root (about 3-4 minutes on one H200; `--sections throughput,
micro_batch_32k` skips the correctness sections):

    python bench/gpu/megatron_check.py --out bench/results/megatron_check.json

Sections, each in its own try/except (a failure records its traceback and the
run goes on); the JSON is rewritten to --out after every section (and every
shape of the throughput sections), and printed at the end:

(a) `logprobs_vs_hf`: per-token log-probabilities of the Megatron model and the
    HF model (SDPA) with the same random Qwen2-0.5B-shaped weights, bf16;
    mean and max |diff| over real tokens; and each bf16 computation (Megatron's also
    with its plain kernels) against HF in float32 (target: Megatron's bf16 no farther
    from it than HF's bf16; two bf16 paths of equal accuracy differ by about 0.01).
(b) `round_trip`: HF -> Megatron -> HF in bf16, bit-exact: pure conversion at
    TP=1, TP=2, TP=2 x PP=2, and through the live model (load, then `hf_weights`).
(c) `throughput`: one full RL learner step (`rl_step`: the old policy's
    log-probabilities, a forward pass of their own, then forward/backward of every
    micro-batch with log-probabilities and entropy, then the optimizer) for
    Qwen2-0.5B and Qwen2-1.5B shapes, 4 micro-batches of 2 x 4096 tokens, timed over
    3 steps after a warm-up (which compiles), with the time of each phase (CUDA
    events, no extra synchronisation). Megatron variants: the default
    (`learner.megatron.compile = "auto"`: compiled kernels, fused Adam on CUDA) and
    `compile_off` (compile off, torch's foreach Adam as Megatron builds it); where
    FlashAttention-4 can run (`flash-attn-4` installed, a Hopper or Blackwell GPU),
    `megatron_fa4` (`learner.flash_attention = "fa4"`: its kernels for these right-padded
    rows, which `auto` leaves to torch's; bench/results/gpu/attention has a run made when
    `auto` gave them FlashAttention-4: there `megatron` is FlashAttention-4 and
    `megatron_torch_attention` torch's); and, for
    reference, a plain PyTorch HF training step (AdamW, bf16, SDPA; no old-logprob
    pass). MFU figures (`step_flops`, all against the 989e12 dense bf16 peak, N =
    parameters with tied embeddings counted once):
      mfu_6n                    6 N tokens / step time: the issue's formula, the
                                old-logprob pass counted as time but not as work
      mfu_8n                    (6 N + 2 N) tokens / step time: the old-logprob
                                forward counted as work too
      mfu_8n_causal_attention   mfu_8n plus attention's score and value matmuls,
                                causal (a token at position t meets t + 1 keys):
                                per row of s tokens and layer, 2 d s (s + 1) forward
                                (d = heads x head dim), x 3 for training
      train_only                the same step without its old-logprob phase
                                (comparable with the figures this script printed
                                before, which timed `train_mini_batch` alone)
(c') `micro_batch_32k`: the same RL step with one micro-batch of 8 x 4096 = 32,768
    tokens per step at both shapes: peak memory, and whether it ran out of memory;
    when it does, again with full activation recompute (`learner.gradient_checkpointing`:
    every layer, Megatron's `full` / `uniform` / 1 layer).
(d) `tp2_vs_tp1`: with two GPUs, TP=2 ranks (started with
    streamrl.backends.rendezvous) recompute (a)'s log-probabilities and
    one training step; otherwise "skipped: one GPU".
(e) `profile`, only when `--sections` names it (about 3 minutes on one H200): where the RL
    step's GPU time goes, per shape with one default backend (compile and attention `auto`,
    no recompute) for both layouts, (c)'s 4 micro-batches of 2 x 4096 tokens
    (`micro_batches_8k`) and (c')'s one of 8 x 4096 (`micro_batch_32k`): a warm-up step,
    two timed ones (the figures (c) gives), then one step under torch.profiler
    (`profile_step`): its kernel time by kind (matmul, attention, compiled, elementwise,
    reductions and norms, optimizer, copies), the top kernels with their calls, how many
    kernels ran, and the GPU's idle share, (wall - kernel time) / wall; and the same per
    phase (old-logprob forward, train forward/backward, optimizer, metrics), the device
    drained at each phase's end so that its kernels fall inside it. The profiled step runs
    slower than the timed ones (the profiler's launch overhead and those waits): its
    kernel times hold, its idle share is an upper bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))

# The Megatron tests' seeded micro-batches and loss (tests/backends/megatron/megatron_ranks.py).
from megatron_ranks import nll_loss, seeded_micro_batches  # noqa: E402
from step_profile import StepClock, profile_step, timed_optimizer  # noqa: E402

PEAK_BF16_FLOPS = 989e12
ROWS_PER_MICRO_BATCH = 2
MICRO_BATCHES_PER_STEP = 4
MICRO_BATCH_32K_ROWS = 8  # x 4096 tokens: one 32,768-token micro-batch
TIMED_STEPS = 3


@dataclass(frozen=True)
class Plan:
    """What one run measures; `--cpu-smoke` shrinks it to check the script itself on CPU."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    small_shape: str = "qwen2-0.5b"
    large_shape: str = "qwen2-1.5b"
    seq_len: int = 4096
    logprob_seq_len: int = 1024


SMOKE = Plan(
    device="cpu", dtype=torch.float32, small_shape="qwen2-tiny", large_shape="qwen3-tiny",
    seq_len=128, logprob_seq_len=64,
)  # fmt: skip
PLAN = Plan()


# ---------------------------------------------------------------- helpers


def learner_config(
    tp: int = 1, *, lr: float = 1e-6, compile: str = "auto", recompute: bool = False,
    flash_attention: str = "auto",
):  # fmt: skip
    from streamrl.config import LearnerConfig, MegatronConfig

    return LearnerConfig(
        backend="megatron",
        lr=lr,
        gradient_checkpointing=recompute,
        flash_attention=flash_attention,
        megatron=MegatronConfig(
            tensor_parallel_size=tp, use_distributed_optimizer=True, compile=compile
        ),
    )


def save_random_hf(shape: str, directory: Path, seed: int = 0) -> Path:
    """Random weights of a named shape in bf16, written with save_pretrained (no tokenizer)."""
    from transformers import AutoModelForCausalLM

    from streamrl.models import random_config

    torch.manual_seed(seed)
    with torch.device(PLAN.device):
        model = AutoModelForCausalLM.from_config(random_config(shape), dtype=PLAN.dtype)
    model.save_pretrained(directory)
    del model
    free_cuda()
    return directory


def micro_batches(vocab: int, *, rows: int, seq_len: int, count: int, seed: int, padded: bool):
    """`count` seeded micro-batches of `rows` x `seq_len` tokens, trained past the first; with
    `padded`, rows are right-padded to lengths drawn from [seq_len / 4, seq_len]."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [
        [
            int(torch.randint(seq_len // 4, seq_len + 1, (1,), generator=generator))
            if padded
            else seq_len
            for _ in range(rows)
        ]
        for _ in range(count)
    ]
    return seeded_micro_batches(
        lengths, token_ids=range(vocab), generator=generator, prompt_tokens=1, width=seq_len,
        row_weights=True,
    )  # fmt: skip


def diff_stats(ours: list[torch.Tensor], ref: list[torch.Tensor], masks: list[torch.Tensor]):
    diffs = torch.cat(
        [
            (a.float() - b.float()).abs()[m[:, 1:].bool()]
            for a, b, m in zip(ours, ref, masks, strict=True)
        ]
    )
    return {"mean_abs": float(diffs.mean()), "max_abs": float(diffs.max()), "tokens": diffs.numel()}


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if PLAN.device == "cuda":
        torch.cuda.synchronize()


def vocab_size(model_dir: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def reset_peak_memory() -> None:
    if PLAN.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def init_single_rank() -> None:
    import torch.distributed as dist

    from streamrl.backends.rendezvous import init_distributed
    from streamrl.process import free_port

    if not dist.is_initialized():
        init_distributed(rank=0, world_size=1, master_port=free_port(), device=PLAN.device)


# ---------------------------------------------------------------- sections


def section_logprobs(model_dir: Path, state: dict) -> dict:
    """Megatron's bf16 log-probabilities against HF's bf16 ones (the figure with the target),
    and both, with Megatron's plain kernels (`learner.megatron.compile = "off"`) too, against
    HF in float32: which of the two bf16 computations is nearer the exact values."""
    from streamrl.backends.megatron.backend import MegatronBackend

    batch = micro_batches(
        vocab_size(model_dir), rows=4, seq_len=PLAN.logprob_seq_len, count=2, seed=1, padded=True
    )
    state["batch"] = batch
    masks = [mb.attention_mask for mb in batch]
    reference = hf_logprobs(model_dir, batch, PLAN.dtype)
    exact = hf_logprobs(model_dir, batch, torch.float32)
    # The plain kernels' learner first: each backend built switches the module-wide kernels
    # (RoPE, SwiGLU) to its own setting, and the later sections use the default one's.
    plain = MegatronBackend(
        str(model_dir), learner_config(compile="off"), device=PLAN.device, dtype=PLAN.dtype,
        seed=0,
    )  # fmt: skip
    plain_logprobs = [lp[:, 1:] for lp in plain.compute_logprobs(batch, temperature=1.0)]
    del plain
    free_cuda()
    backend = MegatronBackend(
        str(model_dir), learner_config(), device=PLAN.device, dtype=PLAN.dtype, seed=0
    )
    state["backend"] = backend
    ours = [lp[:, 1:] for lp in backend.compute_logprobs(batch, temperature=1.0)]
    state["tp1_logprobs"] = ours
    return {
        **diff_stats(ours, reference, masks),
        "against_float32_hf": {
            "megatron_bf16": diff_stats(ours, exact, masks),
            "megatron_bf16_plain_kernels": diff_stats(plain_logprobs, exact, masks),
            "hf_bf16": diff_stats(reference, exact, masks),
        },
        "megatron_bf16_against_its_plain_kernels": diff_stats(ours, plain_logprobs, masks),
    }


def hf_logprobs(model_dir: Path, batch, dtype: torch.dtype) -> list[torch.Tensor]:
    """The HF model's (SDPA) per-token log-probabilities of `batch` in `dtype`, on the CPU."""
    from transformers import AutoModelForCausalLM

    from streamrl.algorithms import logprobs_from_logits

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(PLAN.device).eval()
    result = []
    with torch.no_grad():
        for mb in batch:
            input_ids = mb.input_ids.to(PLAN.device)
            logits = hf(input_ids, attention_mask=mb.attention_mask.to(PLAN.device)).logits
            result.append(logprobs_from_logits(logits, input_ids)[:, 1:].cpu())
    del hf, logits
    free_cuda()
    return result


def section_round_trip(model_dir: Path, state: dict) -> dict:
    from streamrl.backends.megatron import convert
    from streamrl.backends.megatron.model import shape_from_hf

    backend = state["backend"]
    hf_state = {k: v.to(PLAN.device) for k, v in convert.read_hf_state(model_dir).items()}
    shape = shape_from_hf(backend.hf_config)
    result = {}
    for tp, pp in ((1, 1), (2, 1), (2, 2)):
        back = {}
        for pp_rank in range(pp):
            shards = [
                convert.hf_to_megatron(
                    hf_state, shape, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp
                )
                for r in range(tp)
            ]
            back.update(convert.megatron_to_hf(shards, shape, pp_rank=pp_rank, pp_size=pp))
        result[f"tp{tp}_pp{pp}_bit_exact"] = set(back) == set(hf_state) and all(
            torch.equal(back[k], v) for k, v in hf_state.items()
        )
    published = {k: v.to(PLAN.device) for k, v in backend.hf_weights()}
    result["live_model_bit_exact"] = set(published) == set(hf_state) and all(
        torch.equal(published[k], v) for k, v in hf_state.items()
    )
    result["num_tensors"] = len(hf_state)
    result["dtype"] = str(next(iter(published.values())).dtype)
    metrics = backend.train_mini_batch(
        state["batch"], nll_loss, temperature=1.0, need_entropy=False
    )
    state["tp1_step"] = metrics
    result["tp1_first_step"] = metrics
    return result


def step_flops(shape, num_params: int, batch) -> dict:
    """Model FLOPs of one RL step over `batch` (real tokens only; see the module docstring)."""
    lengths = [int(n) for mb in batch for n in mb.attention_mask.sum(dim=1)]
    tokens = sum(lengths)
    width = shape.num_heads * shape.head_dim
    attention_forward = 2 * shape.num_layers * width * sum(s * (s + 1) for s in lengths)
    return {
        "tokens": tokens,
        "train_6n": 6 * num_params * tokens,
        "old_logprob_2n": 2 * num_params * tokens,
        "attention_train": 3 * attention_forward,
        "attention_old_logprob": attention_forward,
    }


def mfu_figures(flops: dict, step_s: float, train_s: float) -> dict:
    def mfu(work: float, seconds: float) -> float:
        return round(work / seconds / PEAK_BF16_FLOPS, 4)

    rl_work = flops["train_6n"] + flops["old_logprob_2n"]
    attention = flops["attention_train"] + flops["attention_old_logprob"]
    return {
        "tokens_per_s": round(flops["tokens"] / step_s, 1),
        "mfu_6n": mfu(flops["train_6n"], step_s),
        "mfu_8n": mfu(rl_work, step_s),
        "mfu_8n_causal_attention": mfu(rl_work + attention, step_s),
        "train_only": {
            "step_s": round(train_s, 4),
            "tokens_per_s": round(flops["tokens"] / train_s, 1),
            "mfu_6n": mfu(flops["train_6n"], train_s),
            "mfu_6n_causal_attention": mfu(flops["train_6n"] + flops["attention_train"], train_s),
        },
    }


def rl_step(backend, batch, clock: StepClock, logprob_batch=None) -> None:
    """One learner step as `streamrl.backends.step.train_step` runs it with a proximal pass:
    old-policy log-probabilities, then one optimizer step over the same micro-batches (with
    entropy, as the learner always asks; here it feeds metrics only). `logprob_batch`: the
    proximal pass's own micro-batches (`learner.logprob_micro_batch_tokens`)."""
    clock.mark("between_steps_s")
    backend.compute_logprobs(logprob_batch or batch, temperature=1.0)
    clock.mark("old_logprob_forward_s")
    backend.train_mini_batch(batch, nll_loss, temperature=1.0, need_entropy=True)
    clock.mark("metrics_s")


def time_rl_steps(
    backend, batch, flops: dict, *, steps: int = TIMED_STEPS, logprob_batch=None
) -> dict:
    """A warm-up step (compilation, allocations), then `steps` timed ones."""
    clock = StepClock(PLAN.device)
    timed_optimizer(backend, clock)
    started = time.perf_counter()
    rl_step(backend, batch, clock, logprob_batch)
    clock.phases_s()
    first_step_s = time.perf_counter() - started
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        rl_step(backend, batch, clock, logprob_batch)
    synchronize()
    step_s = (time.perf_counter() - start) / steps
    phases = {name: seconds / steps for name, seconds in clock.phases_s().items()}
    train_s = step_s - phases.get("old_logprob_forward_s", 0.0)
    return {
        "step_s": round(step_s, 4),
        "phases_s": {name: round(seconds, 4) for name, seconds in phases.items()},
        "first_step_s": round(first_step_s, 2),
        **mfu_figures(flops, step_s, train_s),
        "peak_memory_gib": peak_memory_gib(),
    }


def peak_memory_gib() -> float | None:
    if PLAN.device != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def build_backend(model_dir: Path, **config):
    from streamrl.backends.megatron.backend import MegatronBackend

    return MegatronBackend(
        str(model_dir), learner_config(**config), device=PLAN.device, dtype=PLAN.dtype, seed=0
    )


def throughput_megatron(model_dir: Path, batch, flops: dict, backend=None, **config) -> dict:
    backend = backend or build_backend(model_dir, **config)
    if config.get("compile") == "off" and PLAN.device == "cuda":  # Megatron's own foreach Adam
        for part in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
            for group in part.optimizer.param_groups:
                group["fused"], group["foreach"] = False, True
    reset_peak_memory()
    result = time_rl_steps(backend, batch, flops)
    result["compiled"] = backend.compiled
    result["flash_attention"] = backend.flash_attention
    return result


def throughput_hf(model_dir: Path, batch, flops: dict) -> dict:
    """A plain PyTorch training step (no old-logprob pass): train_only figures only."""
    from transformers import AutoModelForCausalLM

    from streamrl.algorithms import aggregate, logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=PLAN.dtype, attn_implementation="sdpa"
    )
    model = model.to(PLAN.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=PLAN.device == "cuda")
    on_gpu = [(mb.input_ids.to(PLAN.device), mb.loss_mask.to(PLAN.device), mb) for mb in batch]
    reset_peak_memory()

    def step():
        for input_ids, loss_mask, mb in on_gpu:
            logits = model(input_ids).logits
            logprobs = logprobs_from_logits(logits, input_ids)
            loss = aggregate(
                -logprobs, loss_mask, "token_mean",
                num_tokens=mb.num_tokens_in_mini_batch, num_sequences=mb.num_sequences_in_mini_batch,
            )  # fmt: skip
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    synchronize()
    step_s = (time.perf_counter() - start) / TIMED_STEPS
    return {
        "train_only": mfu_figures(flops, step_s, step_s)["train_only"],
        "peak_memory_gib": peak_memory_gib(),
    }


def shape_model(shape_name: str, small_dir: Path, work_dir: Path) -> Path:
    """The random HF checkpoint of a named shape (the small one is the correctness sections')."""
    if shape_name == PLAN.small_shape:
        return small_dir
    directory = work_dir / shape_name
    return directory if directory.exists() else save_random_hf(shape_name, directory)


def measure(entry: dict, key: str, save, run, *args, **kwargs) -> None:
    """entry[key] = run(*args, **kwargs), or its traceback; printed and saved either way."""
    try:
        entry[key] = run(*args, **kwargs)
    except Exception:
        entry[key] = {"error": traceback.format_exc()}
    print(f"[megatron_check] {key}: {json.dumps(entry[key])[:2000]}", flush=True)
    free_cuda()
    save()


def throughput_shapes(small_dir: Path, work_dir: Path, out: dict, save):
    """(out's entry, model directory, ModelShape) for each of the two shapes in turn; a
    shape whose model cannot be made gets its traceback in its entry and is passed over."""
    from transformers import AutoConfig

    from streamrl.backends.megatron.model import shape_from_hf

    for shape_name in (PLAN.small_shape, PLAN.large_shape):
        entry = out.setdefault(shape_name, {})
        try:
            model_dir = shape_model(shape_name, small_dir, work_dir)
            shape = shape_from_hf(AutoConfig.from_pretrained(model_dir))
        except Exception:
            entry["error"] = traceback.format_exc()
            save()
            continue
        yield entry, model_dir, shape


def section_throughput(small_dir: Path, work_dir: Path, state: dict, out: dict, save) -> None:
    from streamrl.backends import flash

    for entry, model_dir, shape in throughput_shapes(small_dir, work_dir, out, save):
        num_params = shape.num_parameters()
        batch = micro_batches(
            shape.vocab_size, rows=ROWS_PER_MICRO_BATCH, seq_len=PLAN.seq_len,
            count=MICRO_BATCHES_PER_STEP, seed=2, padded=False,
        )  # fmt: skip
        flops = step_flops(shape, num_params, batch)
        entry.update(
            num_params=num_params, seq_len=PLAN.seq_len, flops=flops,
            micro_batches=f"{MICRO_BATCHES_PER_STEP} x {ROWS_PER_MICRO_BATCH} x {PLAN.seq_len}",
        )  # fmt: skip
        backend = state.pop("backend", None) if model_dir == small_dir else None
        measure(entry, "megatron", save, throughput_megatron, model_dir, batch, flops, backend)
        backend = None
        if flash.fa4_problem(torch.device(PLAN.device)) is None:
            measure(
                entry, "megatron_fa4", save, throughput_megatron, model_dir, batch, flops,
                flash_attention="fa4",
            )  # fmt: skip
        measure(
            entry, "megatron_compile_off", save, throughput_megatron, model_dir, batch, flops,
            compile="off",
        )  # fmt: skip
        measure(entry, "hf_pytorch", save, throughput_hf, model_dir, batch, flops)


def one_big_micro_batch(model_dir: Path, shape, *, recompute: bool) -> dict:
    """The RL step on one micro-batch of MICRO_BATCH_32K_ROWS x seq_len tokens."""
    batch = micro_batches(
        shape.vocab_size, rows=MICRO_BATCH_32K_ROWS, seq_len=PLAN.seq_len, count=1, seed=3,
        padded=False,
    )  # fmt: skip
    flops = step_flops(shape, shape.num_parameters(), batch)
    result: dict = {"recompute": "full, every layer" if recompute else "none"}
    reset_peak_memory()
    backend = None
    try:
        backend = build_backend(model_dir, recompute=recompute)
        result.update(time_rl_steps(backend, batch, flops, steps=2), out_of_memory=False)
    except torch.OutOfMemoryError as exc:
        result.update(out_of_memory=True, error=str(exc).split("\n")[0][:300])
    result["peak_memory_gib"] = peak_memory_gib()
    result["tokens_per_micro_batch"] = flops["tokens"]
    del backend
    return result


def section_micro_batch_32k(small_dir: Path, work_dir: Path, out: dict, save) -> None:
    for entry, model_dir, shape in throughput_shapes(small_dir, work_dir, out, save):
        measure(entry, "no_recompute", save, one_big_micro_batch, model_dir, shape, recompute=False)
        if entry["no_recompute"].get("out_of_memory"):
            measure(
                entry, "full_recompute", save, one_big_micro_batch, model_dir, shape,
                recompute=True,
            )  # fmt: skip


PROFILE_LAYOUTS = {  # name: (rows per micro-batch, micro-batches per step, seed, rows per
    # micro-batch of the proximal pass: all rows in one, or None for training's), as timed
    "micro_batches_8k": (ROWS_PER_MICRO_BATCH, MICRO_BATCHES_PER_STEP, 2, None),  # `throughput`
    "micro_batch_32k": (MICRO_BATCH_32K_ROWS, 1, 3, None),  # by `micro_batch_32k`
    # learner.micro_batch_tokens = 8192 with learner.logprob_micro_batch_tokens = 32768
    "micro_batches_8k_logprobs_32k": (ROWS_PER_MICRO_BATCH, MICRO_BATCHES_PER_STEP, 2, True),
}


def profile_layout(backend, shape, *, rows: int, count: int, seed: int, merged) -> dict:
    """A warm-up RL step and four timed ones (`time_rl_steps`), then one under torch.profiler
    with its phases marked (`profile_step`). `merged`: the proximal pass takes all the step's
    rows as one micro-batch (of the same shape as the step's rows together; its tokens are
    drawn anew, which a forward's time does not depend on)."""
    batch = micro_batches(
        shape.vocab_size, rows=rows, seq_len=PLAN.seq_len, count=count, seed=seed, padded=False
    )
    logprob_batch = None
    if merged:
        logprob_batch = micro_batches(
            shape.vocab_size, rows=rows * count, seq_len=PLAN.seq_len, count=1, seed=seed,
            padded=False,
        )  # fmt: skip
    flops = step_flops(shape, shape.num_parameters(), batch)
    reset_peak_memory()
    result = {"micro_batches": f"{count} x {rows} x {PLAN.seq_len}"}
    if merged:
        result["logprob_micro_batches"] = f"1 x {rows * count} x {PLAN.seq_len}"
    result.update(time_rl_steps(backend, batch, flops, steps=4, logprob_batch=logprob_batch))
    clock = StepClock(PLAN.device, marks_profiler=True)
    timed_optimizer(backend, clock)
    result["profile"] = profile_step(
        lambda: rl_step(backend, batch, clock, logprob_batch), PLAN.device
    )
    return result


def section_profile(small_dir: Path, work_dir: Path, out: dict, save) -> None:
    for entry, model_dir, shape in throughput_shapes(small_dir, work_dir, out, save):
        try:
            backend = build_backend(model_dir)
        except Exception:
            entry["error"] = traceback.format_exc()
            save()
            continue
        entry.update(
            num_params=shape.num_parameters(), compiled=backend.compiled,
            flash_attention=backend.flash_attention,
        )  # fmt: skip
        for layout, (rows, count, seed, merged) in PROFILE_LAYOUTS.items():
            measure(
                entry, layout, save, profile_layout, backend, shape, rows=rows, count=count,
                seed=seed, merged=merged,
            )  # fmt: skip
        del backend
        free_cuda()


def section_tp2(model_dir: Path, work_dir: Path, state: dict) -> dict:
    if PLAN.device == "cuda" and torch.cuda.device_count() < 2:
        return {"status": "skipped: one GPU"}
    from streamrl.backends.rendezvous import start_ranks

    batch_path, out_path = work_dir / "tp2_batch.pt", work_dir / "tp2_out.pt"
    torch.save(state["batch"], batch_path)
    argv = [sys.executable, __file__, "--worker", PLAN.device, str(model_dir), str(batch_path)]
    argv.append(str(out_path))
    group = start_ranks(argv, world_size=2, log_dir=work_dir / "tp2-logs")
    group.wait(timeout_s=300)
    result = torch.load(out_path, weights_only=False)
    tp2 = [lp[:, 1:] for lp in result["logprobs"]]
    stats = diff_stats(tp2, state["tp1_logprobs"], [mb.attention_mask for mb in state["batch"]])
    return {
        "status": "ran",
        "logprobs_tp2_vs_tp1": stats,
        "first_step_tp2": result["step"],
        "first_step_tp1": state.get("tp1_step"),
    }


def tp2_worker(device: str, model_dir: str, batch_path: str, out_path: str) -> None:
    """One TP=2 rank (started by section_tp2): logprobs and one step on (a)'s batch."""
    import torch.distributed as dist

    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.backends.rendezvous import init_distributed, shutdown

    global PLAN
    PLAN = SMOKE if device == "cpu" else PLAN
    init_distributed(device=device)
    backend = MegatronBackend(
        model_dir, learner_config(tp=2), device=device, dtype=PLAN.dtype, seed=0
    )
    batch = torch.load(batch_path, weights_only=False) if dist.get_rank() == 0 else []
    logprobs = backend.compute_logprobs(batch, temperature=1.0)
    step = backend.train_mini_batch(batch, nll_loss, temperature=1.0, need_entropy=False)
    if dist.get_rank() == 0:
        torch.save({"logprobs": logprobs, "step": step}, out_path)
    shutdown()


# ---------------------------------------------------------------- main


def environment() -> dict:
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "peak_bf16_flops": PEAK_BF16_FLOPS,
        "peak_note": "989e12 = H100/H200 SXM dense bf16 peak; mfu_6n = 6 * N * tokens/s / peak "
        "(N counts tied embeddings once); mfu_8n and *_causal_attention: the module docstring",
    }
    for module in ("transformers", "megatron.core", "transformer_engine", "apex"):
        try:
            info[module] = __import__(module, fromlist=["__version__"]).__version__
        except Exception as exc:
            info[module] = f"unavailable ({type(exc).__name__})"
    from importlib import metadata

    from streamrl.backends import flash

    for package in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = "not installed"
    if torch.cuda.is_available():
        info["flash_attention_4"] = flash.fa4_problem(torch.device("cuda", 0)) or "usable"
    return info


SECTIONS = ("logprobs_vs_hf", "round_trip", "throughput", "micro_batch_32k", "tp2_vs_tp1")
"""The sections a run makes unless `--sections` names others, in this order."""
EXTRA_SECTIONS = ("profile",)
"""Sections run only when `--sections` names them."""


def run(out_path: Path, sections: tuple[str, ...] = SECTIONS) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    report: dict = {
        "environment": environment(), "plan": repr(PLAN), "sections": list(sections),
        "sections_s": {},
        # The caller's commit (a device copy's git HEAD is the copy's, not the code's).
        "commit": os.environ.get("STREAMRL_COMMIT", ""),
        "command": " ".join(["python3", *sys.argv]),
    }  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=2))

    state: dict = {}
    with tempfile.TemporaryDirectory(prefix="megatron-check-") as tmp:
        work_dir = Path(tmp)
        started = time.perf_counter()
        try:
            init_single_rank()
            small_dir = save_random_hf(PLAN.small_shape, work_dir / PLAN.small_shape)
        except Exception:
            report["setup_error"] = traceback.format_exc()
            small_dir = None
        runners = {
            "logprobs_vs_hf": lambda: section_logprobs(small_dir, state),
            "round_trip": lambda: section_round_trip(small_dir, state),
            "throughput": lambda: section_throughput(
                small_dir, work_dir, state, report.setdefault("throughput", {}), save
            ),
            "micro_batch_32k": lambda: section_micro_batch_32k(
                small_dir, work_dir, report.setdefault("micro_batch_32k", {}), save
            ),
            "tp2_vs_tp1": lambda: section_tp2(small_dir, work_dir, state),
            "profile": lambda: section_profile(
                small_dir, work_dir, report.setdefault("profile", {}), save
            ),
        }
        for name in sections:
            section_start = time.perf_counter()
            if name not in ("round_trip", "throughput"):  # they reuse (a)'s backend
                state.pop("backend", None)
                free_cuda()
            try:
                if name in ("round_trip", "tp2_vs_tp1") and "batch" not in state:
                    raise RuntimeError("needs the logprobs_vs_hf section (its model and batch)")
                result = runners[name]()
                if result is not None:
                    report[name] = result
            except Exception:
                report[name] = {"error": traceback.format_exc()}
            report["sections_s"][name] = round(time.perf_counter() - section_start, 1)
            print(f"[megatron_check] section {name}: {report['sections_s'][name]} s", flush=True)
            free_cuda()
            save()
        report["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps(report))
    return report


def main() -> None:
    global PLAN
    if sys.argv[1:2] == ["--worker"]:
        tp2_worker(*sys.argv[2:6])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/megatron_check.json")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU: checks the script, not the GPU",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, run in this order (default: {','.join(SECTIONS)}; "
        f"also: {','.join(EXTRA_SECTIONS)})",
    )
    args = parser.parse_args()
    sections = tuple(name.strip() for name in args.sections.split(",") if name.strip())
    unknown = sorted(set(sections) - set(SECTIONS) - set(EXTRA_SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS + EXTRA_SECTIONS)}")
    if args.cpu_smoke:
        PLAN = SMOKE
    run(args.out, sections)


if __name__ == "__main__":
    main()
