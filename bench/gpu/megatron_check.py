"""Megatron backend on one or two GPUs: correctness against Hugging Face, and learner throughput.

Run from the repository root (about 4-6 minutes on one H200):

    python bench/gpu/megatron_check.py --out bench/results/megatron_check.json

Sections, each in its own try/except (a failure records its traceback and the
run goes on); one JSON object is printed and written to --out:

(a) `logprobs_vs_hf`: per-token log-probabilities of the Megatron model and the
    HF model (SDPA) with the same random Qwen2-0.5B-shaped weights, bf16;
    mean and max |diff| over real tokens (target: mean <= 1e-2).
(b) `round_trip`: HF -> Megatron -> HF in bf16, bit-exact: pure conversion at
    TP=1, TP=2, TP=2 x PP=2, and through the live model (load, then `hf_weights`).
(c) `throughput`: trained tokens/s and model FLOP utilisation
    6 * N * tokens / time / 989e12 (H100/H200 dense bf16 peak; N = parameters
    with tied embeddings counted once) for Qwen2-0.5B and Qwen2-1.5B shapes at
    4096-token sequences, for the Megatron backend and for a plain PyTorch HF
    step (AdamW, bf16 parameters, SDPA) on the same micro-batches.
(d) `tp2_vs_tp1`: with two GPUs, TP=2 ranks (started with
    streamrl.backends.rendezvous) recompute (a)'s log-probabilities and
    one training step; otherwise "skipped: one GPU".
"""

from __future__ import annotations

import argparse
import gc
import json
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

PEAK_BF16_FLOPS = 989e12
ROWS_PER_MICRO_BATCH = 2
MICRO_BATCHES_PER_STEP = 4
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


def learner_config(tp: int = 1, *, lr: float = 1e-6):
    from streamrl.config import LearnerConfig, MegatronConfig

    return LearnerConfig(
        backend="megatron",
        lr=lr,
        megatron=MegatronConfig(tensor_parallel_size=tp, use_distributed_optimizer=True),
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
    from transformers import AutoModelForCausalLM

    from streamrl.algorithms import logprobs_from_logits
    from streamrl.backends.megatron.backend import MegatronBackend

    batch = micro_batches(
        vocab_size(model_dir), rows=4, seq_len=PLAN.logprob_seq_len, count=2, seed=1, padded=True
    )
    state["batch"] = batch
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=PLAN.dtype, attn_implementation="sdpa"
    )
    hf = hf.to(PLAN.device).eval()
    reference = []
    with torch.no_grad():
        for mb in batch:
            input_ids = mb.input_ids.to(PLAN.device)
            logits = hf(input_ids, attention_mask=mb.attention_mask.to(PLAN.device)).logits
            reference.append(logprobs_from_logits(logits, input_ids)[:, 1:].cpu())
    del hf, logits
    free_cuda()
    backend = MegatronBackend(
        str(model_dir), learner_config(), device=PLAN.device, dtype=PLAN.dtype, seed=0
    )
    state["backend"] = backend
    ours = [lp[:, 1:] for lp in backend.compute_logprobs(batch, temperature=1.0)]
    state["tp1_logprobs"] = ours
    return diff_stats(ours, reference, [mb.attention_mask for mb in batch])


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


def time_steps(step, tokens_per_step: int, num_params: int) -> dict:
    step()  # warm-up (allocations, kernels)
    synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    synchronize()
    seconds = (time.perf_counter() - start) / TIMED_STEPS
    tokens_per_s = tokens_per_step / seconds
    return {
        "step_s": round(seconds, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(6 * num_params * tokens_per_s / PEAK_BF16_FLOPS, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if PLAN.device == "cuda"
        else None,
    }


def throughput_megatron(model_dir: Path, batch, num_params: int, backend=None) -> dict:
    from streamrl.backends.megatron.backend import MegatronBackend

    backend = backend or MegatronBackend(
        str(model_dir), learner_config(), device=PLAN.device, dtype=PLAN.dtype, seed=0
    )
    reset_peak_memory()
    tokens = sum(mb.input_ids.numel() for mb in batch)

    def step():
        backend.train_mini_batch(batch, nll_loss, temperature=1.0, need_entropy=False)

    return time_steps(step, tokens, num_params)


def throughput_hf(model_dir: Path, batch, num_params: int) -> dict:
    from transformers import AutoModelForCausalLM

    from streamrl.algorithms import aggregate, logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=PLAN.dtype, attn_implementation="sdpa"
    )
    model = model.to(PLAN.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=PLAN.device == "cuda")
    on_gpu = [(mb.input_ids.to(PLAN.device), mb.loss_mask.to(PLAN.device), mb) for mb in batch]
    reset_peak_memory()
    tokens = sum(mb.input_ids.numel() for mb in batch)

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

    return time_steps(step, tokens, num_params)


def section_throughput(small_dir: Path, work_dir: Path, state: dict, out: dict) -> None:
    from transformers import AutoConfig

    from streamrl.backends.megatron.model import shape_from_hf

    for shape_name in (PLAN.small_shape, PLAN.large_shape):
        entry = out.setdefault(shape_name, {})
        is_small = shape_name == PLAN.small_shape
        try:
            model_dir = small_dir if is_small else save_random_hf(shape_name, work_dir / shape_name)
            num_params = shape_from_hf(AutoConfig.from_pretrained(model_dir)).num_parameters()
            batch = micro_batches(
                vocab_size(model_dir), rows=ROWS_PER_MICRO_BATCH, seq_len=PLAN.seq_len,
                count=MICRO_BATCHES_PER_STEP, seed=2, padded=False,
            )  # fmt: skip
            tokens = sum(mb.input_ids.numel() for mb in batch)
            entry.update(num_params=num_params, seq_len=PLAN.seq_len, tokens_per_step=tokens)
            backend = state.pop("backend", None) if is_small else None
            try:
                entry["megatron"] = throughput_megatron(model_dir, batch, num_params, backend)
            except Exception:
                entry["megatron"] = {"error": traceback.format_exc()}
            backend = None
            free_cuda()
            try:
                entry["hf_pytorch"] = throughput_hf(model_dir, batch, num_params)
            except Exception:
                entry["hf_pytorch"] = {"error": traceback.format_exc()}
        except Exception:
            entry["error"] = traceback.format_exc()
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
        "peak_note": "989e12 = H100/H200 SXM dense bf16 peak; MFU = 6 * N * tokens/s / peak",
    }
    for module in ("transformers", "megatron.core", "transformer_engine", "apex"):
        try:
            info[module] = __import__(module, fromlist=["__version__"]).__version__
        except Exception as exc:
            info[module] = f"unavailable ({type(exc).__name__})"
    return info


def run(out_path: Path) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    report: dict = {"environment": environment(), "plan": repr(PLAN), "sections_s": {}}
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
        sections = [
            ("logprobs_vs_hf", lambda: section_logprobs(small_dir, state)),
            ("round_trip", lambda: section_round_trip(small_dir, state)),
            (
                "throughput",
                lambda: section_throughput(
                    small_dir, work_dir, state, report.setdefault("throughput", {})
                ),
            ),
            ("tp2_vs_tp1", lambda: section_tp2(small_dir, work_dir, state)),
        ]
        for name, section in sections:
            section_start = time.perf_counter()
            try:
                result = section()
                if result is not None:
                    report[name] = result
            except Exception:
                report[name] = {"error": traceback.format_exc()}
            report["sections_s"][name] = round(time.perf_counter() - section_start, 1)
            free_cuda()
        report["total_s"] = round(time.perf_counter() - started, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
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
    args = parser.parse_args()
    if args.cpu_smoke:
        PLAN = SMOKE
    run(args.out)


if __name__ == "__main__":
    main()
