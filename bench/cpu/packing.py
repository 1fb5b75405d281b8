"""Packed against right-padded micro-batches on the CPU: a learner step's time and its token
efficiency, on a spread of sample lengths (issue 27, item 2).

    PYTHONPATH=. python bench/cpu/packing.py --out bench/results/packing_cpu.json

Part 1 (`spread_256_8192`, batching alone, no model): the issue's spread, responses uniform
in 256..8,192 tokens after prompts of 64..511, at 16, 32, 64 and 256 samples per mini-batch
and a 16,384-token budget: the share of computed tokens that are samples' tokens
(`train/token_efficiency`) and the micro-batches' count, each layout.

Part 2 (`torch_step`): `backends.step.train_step` of the torch backend on a random
`qwen3-tiny` model, 32 samples with responses 16..512 tokens (the same 1:32 spread at a
size the CPU trains in seconds), a 2,048-token budget; the layouts alternate for `--rounds`
rounds after a warm-up round, and the median step time of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def spread_samples(num: int, *, low: int, high: int, prompt: tuple[int, int], seed: int):
    from streamrl.types import Group, Sample

    rng = np.random.default_rng(seed)
    samples = []
    for index in range(num):
        length = int(rng.integers(low, high + 1))
        samples.append(
            Sample(
                prompt_ids=rng.integers(1, 1000, int(rng.integers(*prompt))),
                response_ids=rng.integers(1, 1000, length),
                logprobs=-rng.random(length),
                versions=[0] * length,
                loss_mask=np.ones(length),
                reward=float(index % 2),
            )
        )
    group_size = 4
    return [
        Group(group_id=f"g{i}", prompt_seq=i, prompt_index=i, samples=samples[i : i + group_size])
        for i in range(0, num, group_size)
    ]


def spread_efficiency() -> dict:
    from streamrl.backends.batching import make_micro_batches, token_counts

    out = {}
    for num in (16, 32, 64, 256):
        groups = spread_samples(num, low=256, high=8192, prompt=(64, 512), seed=0)
        samples = [s for g in groups for s in g.samples]
        entry = {}
        for packed in (False, True):
            batches = make_micro_batches(
                samples, list(range(num)), token_budget=16384, pad_id=0, packed=packed
            )
            real, computed = token_counts(batches)
            entry["packed" if packed else "padded"] = {
                "token_efficiency": round(real / computed, 4),
                "micro_batches": len(batches),
            }
        out[f"{num}_samples"] = entry
    return out


def torch_step(rounds: int) -> dict:
    from streamrl.backends.step import train_step
    from streamrl.backends.torch import TorchBackend
    from streamrl.config import config_from_dict
    from streamrl.models import save_random_model

    model_dir = tempfile.mkdtemp(prefix="packing-bench-")
    save_random_model("qwen3-tiny", model_dir, seed=0)
    groups = spread_samples(32, low=16, high=512, prompt=(8, 64), seed=1)
    configs = {
        name: config_from_dict(
            {
                "data": {"path": "x"},
                "model": {"path": model_dir},
                "rollout": {"batch_size": len(groups), "n_samples_per_prompt": 4},
                "learner": {"micro_batch_tokens": 2048, "pack_sequences": name == "packed"},
            }
        )
        for name in ("padded", "packed")
    }
    backend = TorchBackend(
        model_dir, configs["padded"].learner, device=torch.device("cpu"), dtype=torch.float32
    )
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    efficiency = {}
    for round_index in range(rounds + 1):
        for name, cfg in configs.items():
            start = time.perf_counter()
            metrics = train_step(backend, groups, cfg, pad_id=0)
            if round_index:  # the first round warms up
                times[name].append(time.perf_counter() - start)
            efficiency[name] = metrics["train/token_efficiency"]
    return {
        name: {
            "step_s_median": round(statistics.median(values), 3),
            "step_s": [round(v, 3) for v in values],
            "token_efficiency": round(efficiency[name], 4),
        }
        for name, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/packing_cpu.json"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"spread_256_8192": spread_efficiency(), "torch_step": torch_step(args.rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    step, spread = result["torch_step"], result["spread_256_8192"]["32_samples"]
    print(
        f"packing cpu: 32 samples of 256..8192 tokens: token efficiency padded "
        f"{spread['padded']['token_efficiency']:.3f} packed {spread['packed']['token_efficiency']:.3f}; "
        f"torch step (32 samples of 16..512): padded {step['padded']['step_s_median']:.2f} s "
        f"(eff {step['padded']['token_efficiency']:.3f}), packed "
        f"{step['packed']['step_s_median']:.2f} s (eff {step['packed']['token_efficiency']:.3f})"
    )


if __name__ == "__main__":
    main()
