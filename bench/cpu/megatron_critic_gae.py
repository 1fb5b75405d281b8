"""The Megatron learner's GAE critic on CPU: explained variance per step.

    python bench/cpu/megatron_critic_gae.py [--tp 2] [--pp 1] [--dp 1] [--ep 1]
        [--sequence-parallel] [--model random:qwen3-tiny] [--steps 12] [--out result.json]

Starts TP x PP x DP gloo ranks (`streamrl.backends.rendezvous.start_ranks`) on a random
tiny model (`--model random:qwen3-moe-tiny --dp 2 --ep 2` for experts); rank 0 runs `train_step` with `algorithm.advantage_estimator = "gae"` through the
`Leader` of a run and the other ranks `follow`, on the same two groups every step (two
prompts; the reward depends on the prompt and on the sample, so a critic can learn part of
it). Prints each step's `train/critic_explained_variance` and value loss, then one result
line, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def groups():
    """Two groups of two samples (3 + i tokens trained, one untrained tool token after)."""
    from streamrl.types import Group, Sample

    generator = torch.Generator().manual_seed(3)
    out = []
    for seq, prompt in enumerate(([1, 5, 6, 7], [1, 9, 9])):
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(10, 200, (4 + i,), generator=generator).tolist(),
                logprobs=[-4.0] * (4 + i),
                versions=[0] * (4 + i),
                loss_mask=[1] * (3 + i) + [0],
                reward=float(seq) + 0.25 * i,
            )
            for i in range(2)
        ]
        out.append(Group(group_id=f"g{seq}", prompt_seq=seq, prompt_index=seq, samples=samples))
    return out


def run_config(args):
    from streamrl.config import config_from_dict

    megatron = {
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "expert_model_parallel_size": args.ep,
    }
    return config_from_dict(
        {
            "data": {"path": "unused"},
            "model": {"path": args.model},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 2},
            "algorithm": {"advantage_estimator": "gae", "value_clip": 0.0},
            "learner": {
                "backend": "megatron",
                "device": "cpu",
                "num_gpus": num_ranks(args),
                "lr": 1e-4,
                "critic": {"lr": 3e-3},
                "megatron": {**megatron, "sequence_parallel": args.sequence_parallel},
            },
        }
    )


def num_ranks(args) -> int:
    return args.tp * args.pp * args.dp


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from streamrl.backends.build import build_backend
    from streamrl.backends.ranks import Leader, follow
    from streamrl.backends.rendezvous import init_distributed, shutdown
    from streamrl.backends.step import make_loss_fn, make_value_loss_fn, train_step

    init_distributed(device="cpu", timeout_s=120)
    cfg = run_config(args)
    backend = build_backend(cfg, cfg.model.path, torch.device("cpu"), torch.float32)
    if dist.get_rank() == 0:
        leader = Leader(backend)
        steps = []
        for step in range(1, args.steps + 1):
            metrics = train_step(leader, groups(), cfg, pad_id=0)
            steps.append(
                {
                    "step": step,
                    "explained_variance": metrics["train/critic_explained_variance"],
                    "value_loss": metrics["train/critic_value_loss"],
                }
            )
            print(json.dumps(steps[-1]), flush=True)
        leader.close()
        Path(args.out).write_text(json.dumps(steps, indent=2) + "\n")
    else:
        follow(backend, make_loss_fn(cfg), value_loss_fn=make_value_loss_fn(cfg))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--model", default="random:qwen3-tiny")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="megatron_critic_gae.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from streamrl.backends.rendezvous import start_ranks

    started = time.perf_counter()
    argv = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    # The script's own directory leads a child's sys.path: put this checkout's streamrl first.
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as logs:
        group = start_ranks(argv, world_size=num_ranks(args), log_dir=Path(logs), env=env)
        try:
            group.wait(600)
        finally:
            group.stop()
        print((Path(logs) / "learner-rank0.log").read_text(), end="")
    steps = json.loads(Path(args.out).read_text())
    layout = f"{args.model}, TP {args.tp} PP {args.pp} DP {args.dp} EP {args.ep}"
    layout += " SP" if args.sequence_parallel else ""
    variance = ", ".join(f"{step['explained_variance']:.3f}" for step in steps)
    print(
        f"megatron critic GAE, {layout}: explained variance per step {variance} "
        f"({time.perf_counter() - started:.1f} s) -> {args.out}"
    )


if __name__ == "__main__":
    main()
