#!/usr/bin/env bash
# Issue 27's H200 measurements at full size, one section per device call of <= 10 minutes,
# all on one warm one-GPU machine, in this order (what a section carries: the `carry` list):
#
#   fetch                (CPU machine, not a device call) download sglang-router 0.3.2's wheel
#                        into .router-whl/ (30 MB: it cannot travel beside the 44 MiB SGLang
#                        bundle, so a later call carries it alone) and torch_memory_saver's
#                        into .whl/ (run bench/gpu/fetch_wheels.sh first)
#   async4b OUT          carry .sgl .whl (FlashAttention-4 too where attention_h200.sh staged it;
#                        ASYNC4B_SETS / ASYNC4B_NAME: more --set overrides and a result name):
#                        draw the Qwen3-4B shape in bf16 on the GPU into
#                        /tmp/qwen3-4b, `streamrl run bench/configs/gpu_fullsize_async4b.toml`
#                        (SGLang + Megatron on GPU 0, async, max_staleness 1, responses of
#                        256..8,192 tokens, 10 steps), then the report and the planner next to
#                        the measured peaks (~3 min of start-up, SGLang's JIT on a fresh
#                        machine, then the steps)
#   checkpoint OUT       carry .router-whl: keep the router's wheel in /tmp for `router`, then
#                        `streamrl bench checkpoint` at the Qwen2-1.5B shape (a 4B checkpoint,
#                        52 GB, does not fit the machine's disk; 11 steps without and with a
#                        checkpoint every 5: each write of 21.6 GB takes 20-30 s, about 5
#                        steps, and a checkpoint due while one is written waits for it; the
#                        bundle and wheels stay from async4b; about 8 minutes on a fresh
#                        machine, carrying .sgl .whl instead; CHECKPOINT_RESPONSE_TOKENS=N
#                        gives every response N tokens, the same tokens in every step;
#                        PAUSED_HEALTH=1 first asks a paused SGLang /health:
#                        bench/gpu/paused_health.py)
#   router OUT           carry nothing: two SGLang servers on GPU 0 behind sglang-router, 5
#                        steps (bench/configs/gpu_fullsize_router.toml), each engine's version
#                        read every 2 s
#   profile4b OUT        carry .whl: the Megatron learner alone on the Qwen3-4B shape, one step's
#                        16 packed samples of 256..8,192 tokens timed and profiled with every
#                        layer, half of them and none recomputed (bench/gpu/learner_profile.py;
#                        about 5 minutes)
#   colocated8b OUT      carry .sgl .whl (a fresh machine is fine): `streamrl check` of the
#                        Llama-3-8B shape colocated (the planner refuses it on one H200: its
#                        figures are kept), then the Qwen3-4B shape colocated with SGLang,
#                        >= 5 steps with release / resume / offload / reload times, rows
#                        packed where the checkout has the key (PACK=0: padded): the learner
#                        has the GPU to itself while it trains, so its MFU is the step's own
#
# Packing (learner.pack_sequences) is switched on in async4b where this checkout has the key;
# PACK=0 runs the padded path for the comparison the issue asks for.
# Pass STREAMRL_COMMIT=$(git rev-parse HEAD) from the CPU machine. Results: OUT/*; copy them
# into bench/results/gpu/ under the names they have (fullsize_*_h200x1*).
set -uo pipefail
PART=${1:?usage: fullsize_h200.sh fetch|async4b|checkpoint|router|profile4b|colocated8b OUT}
cd "$(dirname "$0")/../.."
if [ "$PART" = fetch ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .router-whl sglang-router==0.3.2 && du -sh .router-whl && ls .router-whl || exit 1
  # SGLang's --enable-memory-saver (colocated8b) imports torch_memory_saver, which the bundle
  # lacks: it travels with .whl (2.5 MB) and installs into /tmp/site on the first call
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl torch_memory_saver==0.0.10 && ls .whl
  exit $?
fi
OUT=$(mkdir -p "${2:?usage: fullsize_h200.sh PART OUT}" && cd "$2" && pwd)
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
export STREAMRL_CACHE_DIR=/tmp/streamrl-cache # drawn weights stay for the next call

# shellcheck source=bench/gpu/fa4_env.sh
source bench/gpu/fa4_env.sh
if [ ! -f /tmp/site/.installed ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    touch /tmp/site/.installed
fi
if [ -d .router-whl ] && [ ! -f /tmp/router-site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/router-site \
    .router-whl/*.whl && touch /tmp/router-site/.installed
fi

sglang_env() { # the bundle first on PYTHONPATH, then the router, the carried wheels, this checkout
  if [ -f .sgl/run-server.sh ]; then
    # shellcheck disable=SC1091
    source .sgl/run-server.sh --env || exit 1
  else
    [ -f /tmp/sglang-site/.bundle ] || {
      echo "no SGLang bundle: carry .sgl" >&2
      exit 1
    }
    export PYTHONPATH="/tmp/sglang-site${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
    export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH="/usr/local/cuda/bin:$PATH"
  fi
  fa4_stage # FlashAttention-4, where attention_h200.sh's parts reached this machine
  local fa4
  fa4=$(fa4_pythonpath)
  export PYTHONPATH="$PYTHONPATH:/tmp/router-site:/tmp/site${fa4:+:$fa4}:$PWD"
}

draw() { # draw SHAPE DIR: the shape's random weights (bf16, drawn on the GPU), timed
  local started
  started=$(date +%s)
  [ -f "$2/config.json" ] ||
    python3 -c "from streamrl.models import save_random_model; save_random_model('$1', '$2')" ||
    exit 1
  echo "$1 in $2: $(du -sh "$2" | cut -f1), $(($(date +%s) - started)) s" | tee -a "$OUT/versions.txt"
}

has_key() { # has_key SECTION_CLASS FIELD: whether this checkout's config knows the key
  python3 -c "from streamrl.config import sections as s; import sys; \
sys.exit(0 if '$2' in s.$1.__struct_fields__ else 1)"
}

run_and_report() { # run_and_report NAME CONFIG TIMEOUT_S [--set ...]
  local name=$1 config=$2 limit=$3 run=/tmp/run-$1
  shift 3
  rm -rf "$run"
  timeout "$limit" python3 -m streamrl --log-level "${RUN_LOG_LEVEL:-info}" run "$config" \
    --set "train.output_dir=\"$run\"" "$@" >"$OUT/${name}_run.log.txt" 2>&1
  local status=$?
  tail -40 "$OUT/${name}_run.log.txt"
  for f in metrics.jsonl summary.json config.toml engines.json; do
    [ -f "$run/$f" ] && cp "$run/$f" "$OUT/${name}_$f"
  done
  for log in "$run"/logs/*.log; do # the start (load, graph capture) and the end of each
    [ -f "$log" ] && head -80 "$log" >"$OUT/${name}_$(basename "$log" .log)_head.txt"
    [ -f "$log" ] && tail -60 "$log" >"$OUT/${name}_$(basename "$log" .log)_tail.txt"
  done
  if [ -s "$run/metrics.jsonl" ]; then
    python3 bench/gpu/fullsize_report.py "$run" --json "$OUT/${name}_report.json"
  fi
  if [ -f "$run/summary.json" ]; then
    python3 -m streamrl check "$run/config.toml" --against "$run" \
      --json "$OUT/${name}_memory.json" | grep -v "^#" | tee "$OUT/${name}_memory.txt"
  fi
  return $status
}

case "$PART" in
async4b)
  sglang_env
  python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" |
    tee "$OUT/versions.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >>"$OUT/versions.txt"
  draw qwen3-4b /tmp/qwen3-4b
  pack=()
  if [ "${PACK:-1}" = 1 ] && has_key LearnerConfig pack_sequences; then
    pack=(--set learner.pack_sequences=true)
  fi
  echo "packing: ${pack[*]:-off}" | tee -a "$OUT/versions.txt"
  sets=() # ASYNC4B_SETS="a.b=c d.e=f": more --set overrides (the micro-batch, recompute)
  for item in ${ASYNC4B_SETS:-}; do sets+=(--set "$item"); done
  echo "sets: ${sets[*]:-none}" | tee -a "$OUT/versions.txt"
  run_and_report "fullsize_async4b_h200x1${ASYNC4B_NAME:+_$ASYNC4B_NAME}" \
    bench/configs/gpu_fullsize_async4b.toml "${ASYNC4B_TIMEOUT_S:-480}" "${pack[@]}" "${sets[@]}"
  ;;
checkpoint)
  sglang_env
  # two 21.6 GB checkpoints stand on the 64 GiB disk while the newer is written: the other
  # sections' models and runs go first (a full disk failed a write: "unexpected pos")
  rm -rf /tmp/qwen3-4b /tmp/run-* /tmp/bench-checkpoint
  df -h /tmp | tail -1 | tee -a "$OUT/versions.txt"
  draw qwen2-1.5b /tmp/qwen2-1.5b
  if [ "${PAUSED_HEALTH:-0}" = 1 ]; then # a paused SGLang's /health, as the fleet starts it
    timeout 240 python3 bench/gpu/paused_health.py bench/configs/gpu_fullsize_checkpoint.toml \
      --model /tmp/qwen2-1.5b --json "$OUT/paused_health_h200x1.json" 2>&1 | tail -8
  fi
  lengths=() # CHECKPOINT_RESPONSE_TOKENS=N: every response N tokens, so that every step of
  # both runs trains the same tokens and only the time per step differs between them
  if [ -n "${CHECKPOINT_RESPONSE_TOKENS:-}" ]; then
    n=$CHECKPOINT_RESPONSE_TOKENS
    lengths=(--set "rollout.generate_kwargs={reward=\"confidence\", response_tokens=[$n, $n]}"
      --set "rollout.sampling.max_new_tokens=$n")
  fi
  timeout "${CHECKPOINT_TIMEOUT_S:-540}" python3 -m streamrl bench checkpoint \
    bench/configs/gpu_fullsize_checkpoint.toml --steps "${CHECKPOINT_STEPS:-11}" \
    --every "${CHECKPOINT_EVERY:-5}" --work-dir /tmp/bench-checkpoint --run-log-level info \
    --json "$OUT/fullsize_checkpoint_h200x1.json" "${lengths[@]}"
  status=$?
  for name in without with; do
    grep -v "^	decoder\." "/tmp/bench-checkpoint/$name.log" | gzip >"$OUT/fullsize_checkpoint_h200x1_$name.log.gz"
    cp "/tmp/bench-checkpoint/$name/metrics.jsonl" \
      "$OUT/fullsize_checkpoint_h200x1_${name}_metrics.jsonl" 2>/dev/null
  done
  exit $status
  ;;
router)
  sglang_env
  python3 -c "import sglang_router" || {
    echo "no sglang_router: run the checkpoint section with .router-whl carried first" >&2
    exit 1
  }
  draw qwen3-4b /tmp/qwen3-4b
  run=/tmp/run-fullsize_router_h200x1
  ( # each engine's version every 2 s, once engines.json names them
    while [ ! -f "$run/engines.json" ]; do sleep 2; done
    while sleep 2; do
      for url in $(python3 -c "import json; print(' '.join(e['url'] for e in json.load(open('$run/engines.json'))['engines']))" 2>/dev/null); do
        echo "$(date +%s) $url $(curl -sf "$url/get_model_info" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("weight_version"))' 2>/dev/null)"
      done
    done
  ) >"$OUT/fullsize_router_h200x1_engine_versions.txt" 2>&1 &
  poller=$!
  run_and_report fullsize_router_h200x1 bench/configs/gpu_fullsize_router.toml \
    "${ROUTER_TIMEOUT_S:-540}"
  status=$?
  kill "$poller" 2>/dev/null
  exit $status
  ;;
profile4b)
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import torch; print('torch', torch.__version__)" | tee "$OUT/versions.txt"
  draw qwen3-4b /tmp/qwen3-4b
  # shellcheck disable=SC2086
  timeout "${PROFILE_TIMEOUT_S:-540}" python3 bench/gpu/learner_profile.py --model /tmp/qwen3-4b \
    --out "$OUT/learner_profile_qwen3-4b_h200x1.json" ${PROFILE_ARGS:-} 2>&1 |
    tee "$OUT/learner_profile_qwen3-4b_h200x1.log.txt" | grep -E "^\[learner_profile\]|Error|error" | cut -c1-3000
  exit "${PIPESTATUS[0]}"
  ;;
colocated8b)
  sglang_env
  # The planner refuses Llama-3-8B colocated on one H200 with full Adam (its learner phase,
  # about 179 GB: docs/memory.md); its figures are kept, then the Qwen3-4B shape runs
  # colocated with the handoff's every phase timed (colocate/* step metrics).
  python3 -c "from streamrl.models.shapes import random_config as c; c('llama3-8b').save_pretrained('/tmp/llama3-8b-config')"
  python3 -m streamrl check bench/configs/gpu_fullsize_async4b.toml \
    --set 'model.path="/tmp/llama3-8b-config"' --set 'train.mode="sync"' \
    --set cluster.colocate=true --set 'learner.offload="all"' \
    --set cluster.gpu_memory_gb=150.8 >"$OUT/fullsize_colocated8b_check.txt" 2>&1
  echo "llama3-8b colocated check: rc $? (2 = refused)" | tee -a "$OUT/fullsize_colocated8b_check.txt"
  draw qwen3-4b /tmp/qwen3-4b
  pack=()
  if [ "${PACK:-1}" = 1 ] && has_key LearnerConfig pack_sequences; then
    pack=(--set learner.pack_sequences=true)
  fi
  run_and_report fullsize_colocated4b_h200x1 bench/configs/gpu_fullsize_async4b.toml \
    "${COLOCATED_TIMEOUT_S:-480}" "${pack[@]}" --set 'model.path="/tmp/qwen3-4b"' \
    --set 'train.mode="sync"' --set train.steps=5 --set cluster.colocate=true \
    --set 'learner.offload="all"' --set engine.mem_fraction_static=0.6 \
    --set 'rollout.generate_kwargs={reward="confidence", response_tokens=[256, 2048]}' \
    --set rollout.sampling.max_new_tokens=2048 --set engine.max_seq_len=2560 \
    --set learner.micro_batch_tokens=8192
  ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
