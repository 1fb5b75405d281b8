"""Peak host memory of the Megatron backend's logprobs + entropy, forward and backward.

    python bench/cpu/logprob_memory.py [--tokens 8192] [--vocab 49152] [--module FILE]

One [1, tokens, vocab] bf16 logits tensor (one TP rank's slice, TP 1) goes through
`token_logprobs_and_entropy` and back; prints the peak RSS above what the process held
with the logits allocated. `--module` takes another copy of
`streamrl/backends/megatron/logprobs.py` (e.g. an older commit's, from `git show
REV:streamrl/backends/megatron/logprobs.py > old.py`) to compare. The allocations are the
ones a GPU makes for the same shapes, so the CPU shows what fits, not how fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import time
from pathlib import Path

import torch

DEFAULT_MODULE = Path(__file__).parents[2] / "streamrl/backends/megatron/logprobs.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--module", type=Path, default=DEFAULT_MODULE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("logprobs_under_test", args.module)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    logits = torch.randn(1, args.tokens, args.vocab, dtype=torch.bfloat16).requires_grad_(True)
    input_ids = torch.randint(0, args.vocab, (1, args.tokens))
    mask = torch.ones(1, args.tokens, dtype=torch.int64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    started = time.perf_counter()
    logprobs, entropy = module.token_logprobs_and_entropy(
        logits, input_ids, mask, vocab_start=0, need_entropy=True
    )
    (logprobs.sum() + entropy.sum()).backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"{args.module}: {args.tokens} tokens x {args.vocab} vocab, logits "
        f"{logits.numel() * 2 / 2**30:.2f} GiB (bf16); peak above them "
        f"{(peak - before) / 2**20:.2f} GiB (the bf16 gradient included); {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
