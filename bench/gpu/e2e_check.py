"""End-to-end checks on the GPU machine: weight push from the Megatron learner to a fast
embedded engine over the weight-update group, and `streamrl run` with the megatron backend.

    python bench/gpu/e2e_check.py push --out DIR     # ~2 min on the 2-GPU H200 machine
    python bench/gpu/e2e_check.py push --backend ipc --out DIR   # one GPU, by CUDA IPC handle
    python bench/gpu/e2e_check.py run  --out DIR     # `streamrl run` of configs/gpu/megatron_synthetic.toml

`push`: learner (megatron-core, bf16) on GPU 0, `streamrl engine serve` on GPU 1 (NCCL; with
one GPU both share it and the group is gloo; `--backend ipc`: both on GPU 0, the engine maps
the learner's staging buffers through `/update_weights_from_tensor`). The engine generates, the learner takes two
optimizer steps, the real WeightPublisher pushes each new version; afterwards the engine's
logprobs of its own new tokens are compared with the learner's on the same tokens, and the
engine log shows whether decode graphs were captured again. Writes DIR/push.json.
`run`: writes DIR/run_metrics.jsonl, DIR/run_summary.json and DIR/run_reward.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def push(out: Path, smoke: bool = False, backend: str = "auto") -> dict:
    import anyio
    import numpy as np
    import torch

    from streamrl.backends.batching import pack_micro_batches
    from streamrl.backends.megatron.backend import MegatronBackend
    from streamrl.backends.rendezvous import init_distributed
    from streamrl.config import config_from_dict
    from streamrl.fleet.client import EngineClient
    from streamrl.models import save_random_model
    from streamrl.process import free_port, spawn, streamrl_argv, wait_http_ready
    from streamrl.publish.factory import tensor_transport
    from streamrl.publish.publisher import WeightPublisher
    from streamrl.types import Sample

    shape = "qwen3-tiny" if smoke else "qwen2-0.5b"
    device = "cpu" if smoke else "cuda"
    result: dict = {"shape": shape}
    num_gpus = torch.cuda.device_count()
    engine_gpu = 1 if num_gpus > 1 and backend != "ipc" else 0
    if backend == "auto":
        backend = "nccl" if num_gpus > 1 and not smoke else "gloo"
    transport = backend
    result.update(num_gpus=num_gpus, engine_gpu=engine_gpu, transport=transport)
    model_dir = Path(tempfile.mkdtemp(prefix="push-model-"))
    save_random_model(shape, model_dir, seed=0)
    port = free_port()
    engine_log = out / "push_engine.log"
    engine = spawn(
        "engine",
        streamrl_argv(
            "engine",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--device",
            device,
            "--max-batch-size",
            "64",
            "--max-seq-len",
            "1024",
        ),
        env={"CUDA_VISIBLE_DEVICES": str(engine_gpu)},
        log_path=engine_log,
    )
    try:
        init_distributed(rank=0, world_size=1, master_port=free_port(), device=device)
        if not smoke:
            torch.cuda.set_device(0)
        cfg = config_from_dict(
            {
                "data": {"path": "x"},
                "model": {"path": str(model_dir)},
                "learner": {"backend": "megatron", "lr": 5e-4},
            }
        )
        backend = MegatronBackend(
            str(model_dir),
            cfg.learner,
            algorithm_cfg=cfg.algorithm,
            device=device,
            seed=0,
            dtype=torch.float32 if smoke else torch.bfloat16,
        )
        wait_http_ready(f"http://127.0.0.1:{port}", timeout_s=400, process=engine)

        rng = np.random.default_rng(0)
        prompt = rng.integers(100, 40_000, 64).tolist()

        def learner_logprobs(output_ids: list[int]) -> np.ndarray:
            sample = Sample(
                prompt_ids=prompt,
                response_ids=output_ids,
                logprobs=[0.0] * len(output_ids),
                versions=[0] * len(output_ids),
                loss_mask=[1] * len(output_ids),
            )
            batches = pack_micro_batches([sample], [0], token_budget=4096, pad_id=0)
            values = backend.compute_logprobs(batches, temperature=1.0)[0][0]
            return values[len(prompt) :].numpy()

        def train_once() -> None:
            ids = torch.tensor([rng.integers(100, 40_000, 256).tolist()] * 4)
            from streamrl.backends.base import MicroBatch

            mask = torch.ones_like(ids, dtype=torch.float32)
            mask[:, 0] = 0
            batch = MicroBatch(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                loss_mask=mask,
                behaviour_logprobs=torch.zeros_like(mask),
                sample_indices=[0, 1, 2, 3],
                num_tokens_in_mini_batch=float(mask.sum()),
            )

            def loss_fn(mb, logprobs, entropy):
                loss = -(logprobs * mb.loss_mask).sum() / mb.num_tokens_in_mini_batch
                return loss, {"nll": loss.detach()}

            backend.train_mini_batch([batch], loss_fn, temperature=1.0, need_entropy=False)

        def diff(a, b) -> dict:
            d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
            return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.size)}

        async def main() -> None:
            params = {"max_new_tokens": 128, "temperature": 1.0, "ignore_eos": True}
            async with (
                EngineClient(f"http://127.0.0.1:{port}") as client,
                anyio.create_task_group() as tg,
            ):
                before = await client.generate(prompt, params)
                result["engine_vs_learner_version0"] = diff(
                    before.logprobs, learner_logprobs(before.output_ids)
                )

                async def published(version: int) -> None:
                    pass

                publisher = WeightPublisher(
                    weights=backend.hf_weights,
                    members=lambda: [client],
                    on_published=published,
                    transport=tensor_transport(transport, members=lambda: [client]),
                    pause_mode="in_place",
                    staging_device="cpu" if transport == "gloo" or smoke else "cuda:0",
                )
                await tg.start(publisher.run)
                records = []
                for version in (1, 2):
                    train_once()
                    started = time.perf_counter()
                    await publisher.publish(version)
                    await publisher.wait_idle()
                    records.append(
                        {
                            **publisher.records[-1].as_metrics(),
                            "ok": publisher.records[-1].ok,
                            "publish_to_engines_s": time.perf_counter() - started,
                        }
                    )
                result["publishes"] = records
                after = await client.generate(prompt, params)
                result["engine_versions_after"] = sorted(set(after.versions))
                result["engine_vs_learner_after_push"] = diff(
                    after.logprobs, learner_logprobs(after.output_ids)
                )
                # The same tokens under the old and the new weights differ: the push changed the outputs.
                result["old_tokens_logprob_change"] = diff(
                    before.logprobs, learner_logprobs(before.output_ids)
                )
                tg.cancel_scope.cancel()

        anyio.run(main)
        captures = [
            line
            for line in engine_log.read_text().splitlines()
            if "captured" in line and "graphs" in line
        ]
        result["graph_capture_log_lines"] = captures
        result["graphs_recaptured"] = len(captures) > 1
    finally:
        engine.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
    return result


def run(out: Path) -> dict:
    config = REPO / "configs/gpu/megatron_synthetic.toml"
    run_dir = out / "run"
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl",
            "run",
            str(config),
            "--set",
            f"train.output_dir='{run_dir}'",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    result = {
        "returncode": proc.returncode,
        "wall_s": time.time() - started,
        "stderr_tail": proc.stderr[-4000:],
    }
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        shutil.copy(metrics, out / "run_metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        steps = [r for r in records if "kind" not in r]
        result["steps"] = len(steps)
        result["reward_curve"] = [round(r["reward_mean"], 4) for r in steps]
        result["staleness_max"] = max((r["staleness_max"] for r in steps), default=None)
        result["trained_tokens_per_s_final"] = (
            steps[-1]["throughput/trained_tokens_per_s"] if steps else None
        )
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], marker="o")
            ax.set_xlabel("step")
            ax.set_ylabel("mean reward (first letter is a vowel)")
            ax.set_title("streamrl run, megatron learner (GPU 0) + embedded engine (GPU 1)")
            fig.tight_layout()
            fig.savefig(out / "run_reward.png", dpi=110)
        except Exception:  # the plot is a convenience; the numbers are in the JSON
            result["plot_error"] = traceback.format_exc()
    summary = run_dir / "summary.json"
    if summary.exists():
        shutil.copy(summary, out / "run_summary.json")
    for log in (run_dir / "logs").glob("*.log") if (run_dir / "logs").exists() else []:
        shutil.copy(log, out / f"run_{log.name}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=["push", "run"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl", "ipc"],
        help="push: how weights reach the engine (auto: nccl with 2 GPUs, else gloo)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    record = {"section": args.section, "commit": os.environ.get("STREAMRL_COMMIT", "")}
    try:
        record.update(
            push(args.out, args.cpu_smoke, args.backend)
            if args.section == "push"
            else run(args.out)
        )
    except Exception:
        record["error"] = traceback.format_exc()
    text = json.dumps(record, indent=1, default=str)
    (args.out / f"{args.section}.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
