"""The weight digest on the GPU: its cost per GB, and that it equals the CPU's digest of the
same bytes (the publisher and an engine may digest on different devices), for the Triton
kernel and for the torch path it replaces where Triton is missing (`torch_path_*`).

Run from the repository root on the GPU machine:

    python bench/gpu/digest_check.py --out bench/results/gpu/digest_h200x1.json \
        [--compare path/to/another/digest.py]

`--compare` times another implementation of `digest(tensors)` on the same tensors (an
earlier revision of streamrl/weights/digest.py, say) and checks that it agrees.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from streamrl.weights import digest as digest_module  # noqa: E402
from streamrl.weights.digest import digest  # noqa: E402

SIZES_MIB = (64, 1024)
REPEATS = 5


def timed(function, tensors) -> tuple[str, list[float]]:
    value = function(tensors)  # warm-up (caches, kernels)
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        assert function(tensors) == value
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return value, times


@contextlib.contextmanager
def without_kernel():
    """The digest as it runs where Triton is missing."""
    saved = digest_module._uses_kernel
    digest_module._uses_kernel = lambda words: False
    try:
        yield
    finally:
        digest_module._uses_kernel = saved


def load(path: Path):
    spec = importlib.util.spec_from_file_location("compared_digest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for mib in SIZES_MIB:
        numel = (mib << 20) // 2
        tensors = [torch.randn(numel, device="cuda", generator=generator).to(torch.bfloat16)]
        row = {"mib": mib}
        value, times = timed(digest, tensors)
        row["ms_median"] = round(1e3 * statistics.median(times), 2)
        row["gb_per_s"] = round((mib << 20) / 1e9 / statistics.median(times), 1)
        row["equals_cpu_digest"] = value == digest([t.cpu() for t in tensors])
        with without_kernel():
            torch_value, torch_times = timed(digest, tensors)
        row["torch_path_ms_median"] = round(1e3 * statistics.median(torch_times), 2)
        row["torch_path_agrees"] = torch_value == value
        if args.compare:
            other, other_times = timed(load(args.compare), tensors)
            row["compared_ms_median"] = round(1e3 * statistics.median(other_times), 2)
            row["compared_agrees"] = other == value
        results.append(row)
        print(json.dumps(row), flush=True)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "kernel": "triton" if digest_module._span_kernel() is not None else "torch",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "repeats": REPEATS,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
