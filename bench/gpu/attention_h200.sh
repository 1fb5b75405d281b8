#!/usr/bin/env bash
# The learner's attention and RoPE kernels on the H200 (issues 27 and 28, the MFU lines):
# FlashAttention-4 (`learner.flash_attention`) against torch's FlashAttention-2, and
# megatron-core's RoPE torch.compile'd (`learner.megatron.compile`). One warm one-GPU
# machine, one section a call (each <= 10 minutes), in this order:
#
#   fetch                (CPU machine, not a device call) the flash-attn-4 wheel and its CuTe
#                        DSL wheels for Python 3.12 (106 MiB) as one tar split in three,
#                        .fa4/1 .fa4/2 .fa4/3, since a call carries 64 MiB at most
#   stage OUT            carry .fa4/1 .whl (bench/results moved aside), then (a second call)
#                        .fa4/2: each part waits in /tmp/fa4-parts; the first draws the
#                        Qwen3-4B shape into /tmp/qwen3-4b meanwhile
#   kernels OUT          carry .fa4/3: joins the parts, installs into /tmp/fa4-site, then
#                        bench/gpu/flash_check.py (accuracy against float32 and speed of both
#                        kernels on the 4B packed, 0.5B and 1.5B row shapes), then the 4B
#                        learner's step per kernel and RoPE (bench/gpu/learner_profile.py,
#                        PROFILE_VARIANTS; PROFILE_BUDGET: micro-batch tokens, 16,384;
#                        FLASH_CHECK=0 leaves flash_check.py out)
#   megatron OUT         carry nothing: megatron_check.py's throughput at 0.5B and 1.5B, the
#                        default (FlashAttention-4 and the compiled RoPE) beside torch's
#                        attention and compile off, and its 32k-token micro-batches
#
# Pass STREAMRL_COMMIT=$(git rev-parse --short HEAD). Results: OUT/* (tar them: a call
# returns 8 files at most); they go to bench/results/gpu/attention/.
set -uo pipefail
PART=${1:?usage: attention_h200.sh fetch|stage|kernels|megatron OUT}
cd "$(dirname "$0")/../.."
FA4_VERSION=4.0.0b40
CUTLASS_DSL_VERSION=4.8.1

if [ "$PART" = fetch ]; then
  rm -rf .fa4 /tmp/fa4-fetch && mkdir -p .fa4/1 .fa4/2 .fa4/3 /tmp/fa4-fetch/wheels || exit 1
  download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d /tmp/fa4-fetch/wheels "$@"
  }
  download --pre "flash-attn-4==$FA4_VERSION" "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.15.post2" \
    "torch-c-dlpack-ext==0.1.5" "einops==0.8.1" "nvidia-cutlass-dsl==$CUTLASS_DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL_VERSION" \
    "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL_VERSION" || exit 1
  # the CuTe DSL's own dependencies, installed only where the machine lacks them
  mkdir -p /tmp/fa4-fetch/wheels/fallback &&
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d /tmp/fa4-fetch/wheels/fallback "cuda-bindings==13.0.3" "cuda-pathfinder==1.9.1" \
      "protobuf==6.33.6" || exit 1
  tar cf /tmp/fa4-fetch/fa4-wheels.tar -C /tmp/fa4-fetch wheels || exit 1
  size=$(stat -c %s /tmp/fa4-fetch/fa4-wheels.tar)
  split -b $(((size + 2) / 3)) /tmp/fa4-fetch/fa4-wheels.tar /tmp/fa4-fetch/fa4-wheels.tar.part- &&
    mv /tmp/fa4-fetch/fa4-wheels.tar.part-aa .fa4/1/ && mv /tmp/fa4-fetch/fa4-wheels.tar.part-ab .fa4/2/ &&
    mv /tmp/fa4-fetch/fa4-wheels.tar.part-ac .fa4/3/ || exit 1
  (cd /tmp/fa4-fetch && sha256sum fa4-wheels.tar) | tee .fa4/1/joined.sha256 .fa4/2/joined.sha256 \
    .fa4/3/joined.sha256
  du -sh .fa4/*
  exit 0
fi

OUT=$(mkdir -p "${2:?usage: attention_h200.sh PART OUT}" && cd "$2" && pwd)
export STREAMRL_COMMIT=${STREAMRL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
export STREAMRL_CACHE_DIR=/tmp/streamrl-cache

if [ ! -f /tmp/site/.installed ] && [ -d .whl ]; then # megatron-core, msgspec, pyzmq
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    touch /tmp/site/.installed
fi
# shellcheck source=bench/gpu/fa4_env.sh
source bench/gpu/fa4_env.sh
fa4_stage
FA4_PATH=$(fa4_pythonpath)
export PYTHONPATH="/tmp/site${FA4_PATH:+:$FA4_PATH}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
  python3 -c "from streamrl.backends import flash; import torch; \
print('flash-attn-4:', flash.fa4_problem(torch.device('cuda', 0)) or 'usable')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee -a "$OUT/versions.txt"

case "$PART" in
stage)
  [ -f /tmp/qwen3-4b/config.json ] ||
    python3 -c "from streamrl.models import save_random_model; save_random_model('qwen3-4b', '/tmp/qwen3-4b')"
  ls /tmp/fa4-parts /tmp/qwen3-4b | tee -a "$OUT/versions.txt"
  ;;
kernels)
  [ -f /tmp/fa4-site/.installed ] || { echo "flash-attn-4 is not installed: run stage first"; exit 1; }
  if [ "${FLASH_CHECK:-1}" = 1 ]; then # FLASH_CHECK=0: the learner's profile alone
    timeout "${FLASH_TIMEOUT_S:-150}" python3 bench/gpu/flash_check.py \
      --out "$OUT/flash_check_h200x1.json" 2>&1 | tee "$OUT/flash_check.log.txt" |
      grep -E "^\[flash_check\]|Error" | cut -c1-1500
  fi
  # shellcheck disable=SC2086
  timeout "${PROFILE_TIMEOUT_S:-400}" python3 bench/gpu/learner_profile.py --model /tmp/qwen3-4b \
    --out "$OUT/learner_profile_qwen3-4b_h200x1.json" --steps 2 \
    --variants "${PROFILE_VARIANTS:-full/torch/eager,full/torch/compiled,full/fa4/compiled,half/fa4/compiled}" \
    --budget "${PROFILE_BUDGET:-16384}" \
    2>&1 | tee "$OUT/learner_profile.log.txt" | grep -E "^\[learner_profile\]|Error" | cut -c1-1200
  ;;
megatron)
  timeout "${MEGATRON_TIMEOUT_S:-560}" python3 bench/gpu/megatron_check.py \
    --out "$OUT/megatron_check_h200x1.json" --sections "${MEGATRON_SECTIONS:-throughput,micro_batch_32k}" \
    2>&1 | tee "$OUT/megatron_check.log.txt" | grep -E "^\[megatron_check\]|Error" | cut -c1-1500
  ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
