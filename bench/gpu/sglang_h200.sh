#!/usr/bin/env bash
# streamrl against the real SGLang 0.5.17 on the one-GPU H200, in three calls on one warm
# machine (the carry limit is 64 MiB: the SGLang bundle, 43.6 MiB, and SmolLM2's GGUF,
# 98 MB, cannot travel together):
#
#   bench/gpu/sglang_h200.sh conformance OUT   carry .sgl .whl: the conformance suite against
#                                              SGLang on a tiny random Qwen3, then
#                                              `streamrl bench pause` (in_place, abort, retract,
#                                              retract_abort)
#   bench/gpu/sglang_h200.sh checkpoint OUT   carry .sgl .whl: `streamrl bench checkpoint` with
#                                              SGLang + Megatron on a random Qwen2-0.5B shape
#   bench/gpu/sglang_h200.sh pausemode OUT     carry .sgl .whl: one `streamrl run` of the
#                                              checkpoint config with weights.pause_mode =
#                                              PAUSE_MODE (retract_abort), PAUSEMODE_STEPS steps
#   bench/gpu/sglang_h200.sh engine OUT        carry .sgl .whl: `streamrl bench engine` (issue 21):
#                                              the embedded engine over HTTP, SGLang, and the
#                                              embedded engine in-process, one after the other,
#                                              random Qwen2-0.5B with SmolLM2's vocabulary,
#                                              64/256/512 requests x 128 + 256 tokens (~8 min)
#   bench/gpu/sglang_h200.sh stash OUT         carry .gguf/part.aa: keep it in /tmp (again
#                                              with part.ab; `bench/gpu/gguf_parts.sh`)
#   bench/gpu/sglang_h200.sh learn OUT         carry .gguf/part.ac: join the GGUF, convert it
#                                              to a Hugging Face directory, and
#                                              `streamrl run configs/gpu/sglang_capitals.toml`
#
# Run from the repository root on the GPU machine. Everything it measures lands in OUT.
set -uo pipefail
PART=${1:?usage: sglang_h200.sh conformance|checkpoint|pausemode|engine|stash|learn OUT}
OUT=$(mkdir -p "${2:?usage: sglang_h200.sh PART OUT}" && cd "$2" && pwd)
cd "$(dirname "$0")/../.."
# Pass STREAMRL_COMMIT=$(git rev-parse HEAD) from this machine: the device copy's .git may be stale.
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
# shellcheck source=bench/gpu/gguf_parts.sh
source bench/gpu/gguf_parts.sh

if [ ! -f /tmp/site/.installed ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    touch /tmp/site/.installed
fi

sglang_env() {  # the bundle first on PYTHONPATH, then the carried wheels and this checkout
  if [ -f .sgl/run-server.sh ]; then
    # shellcheck disable=SC1091
    source .sgl/run-server.sh --env || exit 1
  else  # a later call on the same machine: the bundle was unpacked by an earlier one
    [ -f /tmp/sglang-site/.bundle ] || { echo "no SGLang bundle: carry .sgl" >&2; exit 1; }
    export PYTHONPATH="/tmp/sglang-site${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
    export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH="/usr/local/cuda/bin:$PATH"
  fi
  export PYTHONPATH="$PYTHONPATH:/tmp/site:$PWD"
}

wait_health() {  # wait_health URL TIMEOUT_S
  for _ in $(seq "$2"); do
    curl -sf "$1/health" >/dev/null && return 0
    sleep 1
  done
  echo "no /health from $1 after $2 s" >&2
  return 1
}

case "$PART" in
conformance)
  sglang_env
  python3 -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)" |
    tee "$OUT/versions.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >>"$OUT/versions.txt"
  python3 -c "from streamrl.models import save_random_model; save_random_model('qwen3-tiny', '/tmp/tiny')"
  started=$(date +%s)
  python3 -m sglang.launch_server --model-path /tmp/tiny --host 127.0.0.1 --port 30000 \
    "${SGLANG_SAFE_ARGS[@]}" --mem-fraction-static 0.3 >"$OUT/sglang_tiny.log" 2>&1 &
  server=$!
  wait_health http://127.0.0.1:30000 420 || { tail -50 "$OUT/sglang_tiny.log"; exit 1; }
  echo "sglang ready after $(($(date +%s) - started)) s" | tee -a "$OUT/versions.txt"
  STREAMRL_CONFORMANCE_URL=http://127.0.0.1:30000 STREAMRL_CONFORMANCE_MODEL=/tmp/tiny \
    STREAMRL_CONFORMANCE_BACKEND=gloo timeout 300 \
    python3 -m pytest tests/conformance -k "not router" -v -p no:cacheprovider 2>&1 |
    tee "$OUT/conformance_sglang_h200x1.txt" | tail -40
  [ "${PAUSE_BENCH:-1}" = 0 ] || timeout 150 python3 -m streamrl --log-level warning bench pause --url http://127.0.0.1:30000 \
    --model /tmp/tiny --modes in_place,abort,retract,retract_abort --requests 64 --prompt-tokens 128 \
    --max-new-tokens 3500 --updates 5 --interval-s 0.3 --json "$OUT/sglang_pause_h200x1.json"
  curl -sf http://127.0.0.1:30000/health >/dev/null && echo "sglang still healthy"
  kill "$server"
  wait "$server" 2>/dev/null
  tail -20 "$OUT/sglang_tiny.log"
  ;;
checkpoint)
  sglang_env
  python3 -c "from streamrl.models import save_random_model; save_random_model('qwen2-0.5b', '/tmp/qwen2-0.5b')"
  timeout "${CHECKPOINT_TIMEOUT_S:-420}" python3 -m streamrl bench checkpoint \
    bench/configs/gpu_sglang_checkpoint.toml --steps "${CHECKPOINT_STEPS:-12}" --every "${CHECKPOINT_EVERY:-4}" --work-dir /tmp/bench-checkpoint \
    --run-log-level info --json "$OUT/checkpoint_sglang_h200x1.json"
  status=$?
  for name in without with; do
    tail -30 "/tmp/bench-checkpoint/$name.log" >"$OUT/checkpoint_sglang_h200x1_$name.log.txt" 2>/dev/null
    cp "/tmp/bench-checkpoint/$name/metrics.jsonl" "$OUT/checkpoint_sglang_h200x1_${name}_metrics.jsonl" 2>/dev/null
  done
  exit $status
  ;;
pausemode)
  # One `streamrl run` of bench/configs/gpu_sglang_checkpoint.toml (SGLang + Megatron on GPU 0,
  # random Qwen2-0.5B shape) with weights.pause_mode = PAUSE_MODE (retract_abort): its
  # per-update engine pauses, resumes and inexact samples, against the committed abort run
  # of that config (checkpoint_sglang_h200x1_without_metrics.jsonl)
  sglang_env
  mode=${PAUSE_MODE:-retract_abort}
  [ -f /tmp/qwen2-0.5b/config.json ] ||
    python3 -c "from streamrl.models import save_random_model; save_random_model('qwen2-0.5b', '/tmp/qwen2-0.5b')"
  rm -rf /tmp/run-pausemode # a new run refuses a directory holding another run's metrics
  timeout "${PAUSEMODE_TIMEOUT_S:-300}" python3 -m streamrl run bench/configs/gpu_sglang_checkpoint.toml \
    --set "weights.pause_mode=\"$mode\"" --set "train.steps=${PAUSEMODE_STEPS:-10}" \
    --set train.save_final=false --set train.output_dir=\"/tmp/run-pausemode\" >"$OUT/pausemode_$mode.log" 2>&1
  status=$?
  cp /tmp/run-pausemode/metrics.jsonl "$OUT/pausemode_${mode}_h200x1_metrics.jsonl"
  tail -30 "$OUT/pausemode_$mode.log"
  exit $status
  ;;
engine)
  sglang_env
  # SGLang's flags of the issue's figure (triton attention, CUDA graphs to 256) after the bundle's.
  timeout "${ENGINE_TIMEOUT_S:-570}" python3 -m streamrl --log-level warning bench engine \
    --shape qwen2-0.5b-smolvocab --device cuda --dtype bfloat16 --requests 64,256,512 \
    --prompt-tokens 128 --max-new-tokens 256 --repeats 3 --warmup-rounds 1 --ttft-probes 8 \
    --sglang-args "${SGLANG_SAFE_ARGS[*]:-} --attention-backend triton --sampling-backend pytorch \
--grammar-backend none --cuda-graph-max-bs 256 --mem-fraction-static 0.8" \
    --work-dir /tmp/bench-engine --json "$OUT/engine_h200x1.json"
  status=$?
  for name in embedded sglang; do
    tail -40 "/tmp/bench-engine/$name.log" >"$OUT/engine_h200x1_$name.log.txt" 2>/dev/null
  done
  exit $status
  ;;
stash)
  gguf_stash
  ;;
learn)
  gguf_join | tee "$OUT/gguf_sha256.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  sglang_env
  export STREAMRL_SMOLLM2_GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  model=$(python3 -c "from streamrl.models import smollm2_model_dir; print(smollm2_model_dir())") ||
    exit 1
  echo "model $model"
  run=/tmp/run-sglang-capitals
  rm -rf "$run"
  timeout 540 python3 -m streamrl run configs/gpu/sglang_capitals.toml \
    --set "model.path=\"$model\"" --set "train.output_dir=\"$run\"" 2>&1 | tail -60
  for f in metrics.jsonl summary.json events.jsonl config.toml; do
    [ -f "$run/$f" ] && cp "$run/$f" "$OUT/sglang_capitals_h200x1_$f"
  done
  tail -40 "$run/logs/engine-0.log" >"$OUT/sglang_capitals_h200x1_engine_tail.txt" 2>/dev/null
  python3 -m streamrl plot "$run" --out "$OUT/sglang_capitals_h200x1_reward.png" \
    --title "SmolLM2-135M on capitals: SGLang 0.5.17 + Megatron, one H200"
  ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
