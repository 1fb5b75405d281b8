#!/usr/bin/env bash
# Issue 31 on the one-GPU H200: the price of staleness on `builtin:world_capitals` with
# SmolLM2-135M-Instruct, and `buffer.max_staleness = "auto"` against fixed bounds. Calls on
# one warm machine (the carry limit is 64 MiB and SmolLM2's GGUF is 98 MB, in the parts that
# `bash bench/gpu/gguf_parts.sh split` makes):
#
#   bench/gpu/staleness_h200.sh stash OUT   carry .whl .gguf/part.aa: wheels into /tmp/site,
#                                           the carried GGUF parts into /tmp; again with
#                                           .gguf/part.ab
#   bench/gpu/staleness_h200.sh a OUT       carry .gguf/part.ac: join the GGUF (its SHA-256
#                                           checked), convert
#                                           it once, then per seed (0, 1, 2, side by side),
#                                           in this order until 540 s have passed: eta 0 and
#                                           4 (decoupled PPO), 4 (no correction), auto, 2, 2
#                                           (none), 1, 1 (none); ~80 s a run (PAIRS and
#                                           SWEEP_NAME replace that list and the part's name)
#   bench/gpu/staleness_h200.sh b OUT       the pairs in $PAIRS (what part a had no time for;
#                                           SWEEP_NAME names the part, SEEDS its seeds)
#
# Each part first runs WARMUP_STEPS (default 8; 0 skips it) steps at eta 1 per seed, not
# measured, so that no measured setting pays the machine's first-run cost.
#
# Each part merges its runs into OUT/<config's name>_h200x1_<part>.json (+ PNG, + its logs as
# one .tgz); on the CPU, `streamrl bench merge` joins the parts. CONFIG picks another config
# (the first sweep ran configs/gpu/staleness_multistep.toml).
#
# The three seeds run side by side on the one GPU (the sweep would take an hour one run at a
# time): each run shares the GPU with the two other seeds' runs of the same setting, which
# start together, so throughputs compare across settings at a third of the machine each.
# Run from the repository root on the GPU machine; each part stays within 10 minutes.
set -uo pipefail
PART=${1:?usage: staleness_h200.sh stash|a|b OUT}
OUT=$(mkdir -p "${2:?usage: staleness_h200.sh PART OUT}" && cd "$2" && pwd)
cd "$(dirname "$0")/../.."
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export STREAMRL_CACHE_DIR=/tmp/streamrl-cache STREAMRL_SMOLLM2_GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
CONFIG=${CONFIG:-configs/gpu/staleness_world_capitals.toml}
NAME=$(basename "$CONFIG" .toml)
PY=${PYTHON:-python3}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-40}
DEADLINE=$(($(date +%s) + ${BUDGET_S:-540}))  # a part's runs end by then (a device call: 600 s)
PARTS=/tmp/staleness-parts
# shellcheck source=bench/gpu/gguf_parts.sh
source bench/gpu/gguf_parts.sh
mkdir -p "$PARTS"

warm_up() {  # WARMUP_STEPS steps at eta 1 per seed, side by side, measured by nothing
  # A machine's first run pays a cost that later processes do not (kernels built and cached on
  # first use): without this, the first setting of a part paid up to 4 s more in steps 2-4
  # than the others (part `e`, docs/benchmarks.md).
  local steps=${WARMUP_STEPS:-8} pids=()
  [ "$steps" -gt 0 ] || return 0
  for seed in $SEEDS; do
    timeout 240 "$PY" -m streamrl --log-level warning bench staleness "$CONFIG" --eta 1 \
      --corrections decoupled_ppo --seeds "$seed" --steps "$steps" \
      --work-dir "/tmp/staleness/warmup-s$seed" --run-timeout-s 200 \
      >"$PARTS/warmup_s$seed.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || echo "warm-up $pid failed (see $PARTS/warmup_s*.log)"; done
}

sweep() {  # sweep NAME ETAS:CORRECTIONS...: per seed, side by side, each pair in turn
  local name=$1 pids=()
  shift
  warm_up
  for seed in $SEEDS; do
    (
      part=0
      for pair in "$@"; do
        part=$((part + 1))
        left=$((DEADLINE - $(date +%s)))
        [ "$left" -gt 60 ] || { echo "no time left for $pair"; break; }
        timeout "$left" "$PY" -m streamrl --log-level warning bench staleness "$CONFIG" \
          --eta "${pair%%:*}" --corrections "${pair#*:}" --seeds "$seed" --steps "$STEPS" \
          --work-dir "/tmp/staleness/$name-s$seed" --run-timeout-s 300 \
          --json "$PARTS/${name}${part}_s$seed.json"
      done
    ) >"$PARTS/${name}_s$seed.log" 2>&1 &
    pids+=($!)
  done
  local status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  for seed in $SEEDS; do echo "== seed $seed"; tail -12 "$PARTS/${name}_s$seed.log"; done
  # The device returns at most 8 files: one merged result, its plot, and the logs in one file.
  "$PY" -m streamrl bench merge "$PARTS"/"$name"*_s*.json \
    --json "$OUT/${NAME}_h200x1_$name.json"
  tar czf "$OUT/${NAME}_h200x1_${name}_logs.tgz" --exclude='*.json' \
    --exclude='*.png' --exclude='*.safetensors' --exclude='*.pt' -C "$PARTS" . /tmp/staleness
  return $status
}

case "$PART" in
stash)
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  fi
  gguf_stash
  ;;
a)
  gguf_join | tee "$OUT/gguf_sha256.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  # Convert once, before the three processes would race to do it.
  python3 -c "from streamrl.models import smollm2_model_dir; print(smollm2_model_dir())" || exit 1
  python3 -c "import torch, transformers, sys; print(sys.version, torch.__version__, transformers.__version__)" \
    | tee "$OUT/versions.txt"
  # shellcheck disable=SC2086
  sweep "${SWEEP_NAME:-a}" ${PAIRS:-0,4:decoupled_ppo 4:none auto:decoupled_ppo 2:decoupled_ppo \
    2:none 1:decoupled_ppo 1:none}
  ;;
b)  # what part a had no time for (set in PAIRS), e.g. PAIRS="1:decoupled_ppo 1:none"
  # shellcheck disable=SC2086
  sweep "${SWEEP_NAME:-b}" ${PAIRS:-1:decoupled_ppo 1:none} ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
