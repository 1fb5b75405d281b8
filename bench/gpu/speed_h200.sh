#!/usr/bin/env bash
# Issue 28's measurements on the one-GPU H200 (speed: engine decode over HTTP against SGLang,
# weight updates by reference, the digest, graphs against eager, the Megatron learner), in
# calls of at most 10 minutes on one warm machine:
#
#   bench/gpu/speed_h200.sh weights OUT    carry .whl: `streamrl bench weight-sync` by
#                                          reference (qwen2-0.5b and qwen2-1.5b, 32 requests of
#                                          load), the digest's cost per GB, and engine_check's
#                                          graphs_vs_eager section (~5 min)
#   bench/gpu/speed_h200.sh kept OUT       carry .whl: the CUDA variants of the weight tests,
#                                          then `streamrl bench weight-sync` by reference with
#                                          the engine keeping the staged buckets mapped
#                                          (qwen2-0.5b with 32 requests of load and with none,
#                                          qwen2-1.5b with 32), then 12 steps of
#                                          bench/configs/gpu_1gpu.toml with the torch learner
#                                          (the publish metrics of a run) (~5 min)
#   bench/gpu/speed_h200.sh megatron OUT   carry .whl: bench/gpu/megatron_check.py (its
#                                          default sections, or MEGATRON_ARGS; MEGATRON_TIMEOUT
#                                          seconds, 560 by default); MEGATRON_TESTS=1 runs the
#                                          learner kernels' CUDA tests first (~5 min)
#   bench/gpu/speed_h200.sh kernels OUT    carry .whl: bench/gpu/kernel_check.py, the learner's
#                                          Triton kernels against what they replace (~2 min)
#   bench/gpu/speed_h200.sh engine OUT     carry .sgl: `streamrl bench engine`, the embedded
#                                          engine over HTTP (in two processes), SGLang and
#                                          in-process, 64/256/512
#                                          requests x 128 + 256 tokens, a warm-up round and 3
#                                          measured rounds per count; CLIENTS=N sends from N
#                                          client processes (~6 min)
#   bench/gpu/speed_h200.sh http OUT       `streamrl bench engine` for the embedded engine over
#                                          HTTP only, 64/256/512 requests: in one process, in
#                                          two (--http-process on), in two with a GIL switch
#                                          interval of 0.1 ms; with HTTP_CLIENTS="1 4" instead
#                                          in two processes, from 1 and from 4 client
#                                          processes; with HTTP_VARIANTS='NAME=FLAGS|...' the
#                                          split engine with each variant's serve flags (from
#                                          CLIENTS client processes); then in-process (~5 min)
#   bench/gpu/speed_h200.sh decode OUT     the engine's CUDA unit tests, engine_check's attention,
#                                          graphs_vs_eager and logprobs_vs_teacher sections, then
#                                          bench/gpu/decode_profile.py: GPU time, loop time and
#                                          kernels of one decode step at 64/256/512 lanes, per
#                                          runner variant in DECODE_VARIANTS (~5 min)
#
# Run from the repository root on the GPU machine. Every figure lands in OUT (at most 8 files
# come back per call). Pass STREAMRL_COMMIT=$(git rev-parse --short HEAD) from this machine.
set -uo pipefail
PART=${1:?usage: speed_h200.sh weights|kept|megatron|kernels|engine|http|decode OUT}
OUT=$(mkdir -p "${2:?usage: speed_h200.sh PART OUT}" && cd "$2" && pwd)
cd "$(dirname "$0")/../.."
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 STREAMRL_CACHE_DIR=/tmp/streamrl-cache

if [ ! -f /tmp/site/.installed ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    touch /tmp/site/.installed
fi
[ -f /tmp/site/.installed ] || { echo "no wheels in /tmp/site: carry .whl" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"
status=0
run() { (set -x; "$@") || status=$?; }

case "$PART" in
weights)
  for shape in qwen2-0.5b qwen2-1.5b; do
    run timeout 200 python3 -m streamrl --log-level warning bench weight-sync --shape "$shape" \
      --backend ipc --engines 1 --repeats 5 --load-requests 32 --work-dir /tmp/wsb \
      --json "$OUT/weight_sync_${shape}_h200x1_ipc.json"
  done
  run timeout 120 python3 bench/gpu/digest_check.py --out "$OUT/digest_h200x1.json"
  run timeout 200 python3 bench/gpu/engine_check.py --sections graphs_vs_eager \
    --out "$OUT/engine_check_graphs_h200x1.json" >/dev/null
  ;;
kept)
  run timeout 150 python3 -m pytest -q -p no:cacheprovider tests/weights/test_weight_sync.py \
    tests/weights/test_weight_digest.py -k cuda 2>&1 | tail -5
  for load in "qwen2-0.5b 32" "qwen2-0.5b 0" "qwen2-1.5b 32"; do
    set -- $load
    run timeout 200 python3 -m streamrl --log-level warning bench weight-sync --shape "$1" \
      --backend ipc --engines 1 --repeats 5 --load-requests "$2" --work-dir /tmp/wsb \
      --json "$OUT/weight_sync_${1}_h200x1_ipc_kept_load$2.json"
  done
  run timeout 300 python3 -m streamrl run bench/configs/gpu_1gpu.toml --set learner.backend=torch \
    --set train.steps=12 --set train.output_dir=/tmp/run-kept >"$OUT/run_kept.log.txt" 2>&1
  cp /tmp/run-kept/metrics.jsonl "$OUT/run_kept_metrics.jsonl" 2>/dev/null
  tail -5 "$OUT/run_kept.log.txt"
  ;;
megatron)
  if [ -n "${MEGATRON_TESTS:-}" ]; then  # the learner kernels' CUDA tests first
    run timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs \
      tests/backends/megatron/test_megatron_speed.py tests/backends/megatron/test_logprob_kernels.py \
      -k cuda >"$OUT/megatron_cuda_tests_h200x1.txt" 2>&1
    tail -3 "$OUT/megatron_cuda_tests_h200x1.txt"
  fi
  run timeout "${MEGATRON_TIMEOUT:-560}" python3 bench/gpu/megatron_check.py ${MEGATRON_ARGS:-} \
    --out "$OUT/megatron_check_h200x1.json"
  ;;
kernels)
  run timeout 300 python3 bench/gpu/kernel_check.py --out "$OUT/kernel_check_h200x1.json"
  ;;
engine)
  if [ -n "${ENGINE_CHECKS:-}" ]; then  # the engine's CUDA tests and step profile first
    run timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_core.py \
      -k cuda -rfEs >"$OUT/cuda_tests_h200x1.txt" 2>&1
    tail -3 "$OUT/cuda_tests_h200x1.txt"
    run timeout 120 python3 bench/gpu/decode_profile.py --out "$OUT/decode_profile_h200x1.json"
  fi
  if [ -f .sgl/run-server.sh ]; then
    # shellcheck disable=SC1091
    source .sgl/run-server.sh --env || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site:$PWD"
  fi
  run timeout 570 python3 -m streamrl --log-level warning bench engine \
    --shape qwen2-0.5b-smolvocab --device cuda --dtype bfloat16 --requests 64,256,512 \
    --prompt-tokens 128 --max-new-tokens 256 --repeats 3 --warmup-rounds 1 --ttft-probes 8 \
    --client-processes "${CLIENTS:-1}" --embedded-args "${EMBEDDED_ARGS:---http-process on}" --sglang-args "--attention-backend triton --sampling-backend pytorch --grammar-backend none \
--cuda-graph-max-bs 512 --mem-fraction-static 0.8" \
    --work-dir /tmp/bench-engine --json "$OUT/engine_h200x1.json"
  for name in embedded sglang; do
    tail -30 "/tmp/bench-engine/$name.log" >"$OUT/engine_h200x1_$name.log.txt" 2>/dev/null
  done
  ;;
http)
  bench_http() {  # NAME EXTRA-ENGINE-ARGS [ENGINES [EXTRA-BENCH-ARGS]]
    run timeout 150 python3 -m streamrl --log-level warning bench engine \
      --shape qwen2-0.5b-smolvocab --device cuda --dtype bfloat16 --requests 64,256,512 \
      --prompt-tokens 128 --max-new-tokens 256 --repeats 3 --warmup-rounds 1 --ttft-probes 8 \
      --engines "${3:-embedded}" --embedded-args "$2" --work-dir /tmp/bench-engine ${4:-} \
      --json "$OUT/engine_http_$1_h200x1.json"
  }
  if [ -n "${HTTP_VARIANTS:-}" ]; then  # NAME=ENGINE-ARGS|...: the split engine, per variant
    IFS='|' read -ra variants <<<"$HTTP_VARIANTS"
    for variant in "${variants[@]}"; do
      bench_http "${variant%%=*}" "--http-process on ${variant#*=}" embedded \
        "--client-processes ${CLIENTS:-1}"
    done
  elif [ -n "${HTTP_CLIENTS:-}" ]; then  # the split engine from 1 and more client processes
    for clients in $HTTP_CLIENTS; do
      bench_http "clients$clients" "--http-process on" embedded "--client-processes $clients"
    done
  else
    bench_http one-process "--http-process off"
    bench_http two-processes "--http-process on"
    bench_http two-processes-switch0.1 "--http-process on --switch-interval-ms 0.1"
  fi
  bench_http in-process "" in-process
  ;;
decode)
  run timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_core.py \
    -k cuda -rfEs >"$OUT/cuda_tests_h200x1.txt" 2>&1
  tail -4 "$OUT/cuda_tests_h200x1.txt"
  run timeout 200 python3 bench/gpu/engine_check.py \
    --sections attention,graphs_vs_eager,logprobs_vs_teacher \
    --out "$OUT/engine_check_decode_h200x1.json" >/dev/null
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['summary']))" \
    "$OUT/engine_check_decode_h200x1.json"
  run timeout 200 python3 bench/gpu/decode_profile.py --variants "${DECODE_VARIANTS:-base}" \
    --out "$OUT/decode_profile_h200x1.json"
  ;;
*)
  echo "unknown part '$PART' (see the header of $0)" >&2
  exit 2
  ;;
esac
exit $status
