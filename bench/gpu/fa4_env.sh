#!/usr/bin/env bash
# Sourced by the GPU scripts: FlashAttention-4 on the GPU machine (`learner.flash_attention`).
# `bench/gpu/attention_h200.sh fetch` splits its wheels into .fa4/1 .fa4/2 .fa4/3 (a call carries
# 64 MiB at most); each call that carries a part leaves it in /tmp/fa4-parts (`fa4_stage`),
# and once all three are there they are joined, checked and installed into /tmp/fa4-site.
# `fa4_pythonpath` prints what PYTHONPATH needs for it (nothing where it is not installed).

fa4_stage() {
  mkdir -p /tmp/fa4-parts
  local part
  for part in .fa4/1 .fa4/2 .fa4/3; do
    [ -d "$part" ] && cp "$part"/* /tmp/fa4-parts/
  done
  [ -f /tmp/fa4-site/.installed ] && return 0
  for part in aa ab ac; do
    [ -f "/tmp/fa4-parts/fa4-wheels.tar.part-$part" ] || return 0
  done
  (
    cd /tmp/fa4-parts || exit 1
    cat fa4-wheels.tar.part-* >fa4-wheels.tar && sha256sum -c joined.sha256 && tar xf fa4-wheels.tar ||
      exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4-site wheels/*.whl &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4-fallback \
        wheels/fallback/*.whl
  ) && touch /tmp/fa4-site/.installed
}

fa4_pythonpath() {
  [ -f /tmp/fa4-site/.installed ] || return 0
  # `--target` installs skip the cutlass-dsl wheel's .pth line, which puts dsl_packages on the
  # path; the fallback (cuda-bindings, protobuf) only where the machine has none of its own
  local path=/tmp/fa4-site:/tmp/fa4-site/nvidia_cutlass_dsl/dsl_packages
  python3 -c "import cuda.bindings.driver, google.protobuf" 2>/dev/null || path=$path:/tmp/fa4-fallback
  echo "$path"
}
