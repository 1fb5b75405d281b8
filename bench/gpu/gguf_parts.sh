#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GGUF (98 MB) reaches the GPU machine in parts: a call carries at most
# 64 MiB, the working tree included, so a part travels with each call of a warm machine and
# waits in /tmp until the last one arrives. Sourced by sglang_h200.sh and staleness_h200.sh.
#
#   on this machine, once:   bash bench/gpu/gguf_parts.sh split [PART_MB]   (default 33)
#                            writes .gguf/part.aa, part.ab, ... (git-ignored)
#   on the GPU machine:      gguf_stash   copies the carried .gguf/part.* into /tmp
#                            gguf_join    stashes, joins every part in order, and checks the
#                                         file's SHA-256; a missing part is an error
GGUF_STASH=/tmp/smollm2.gguf  # the parts wait here as $GGUF_STASH.aa, .ab, ...
GGUF_DIR=/tmp/smollm2
GGUF_FILE=$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

gguf_stash() {
  local part
  for part in .gguf/part.*; do
    [ -f "$part" ] || continue
    cp "$part" "$GGUF_STASH.${part##*.}" || return 1
  done
  ls -la "$GGUF_STASH".* 2>/dev/null || echo "no GGUF part stashed yet"
}

gguf_join() {
  gguf_stash >/dev/null || return 1
  mkdir -p "$GGUF_DIR" && cat "$GGUF_STASH".* >"$GGUF_FILE" 2>/dev/null || {
    echo "no GGUF parts in $(dirname "$GGUF_STASH"): carry .gguf/part.* in earlier calls" >&2
    return 1
  }
  local sha
  sha=$(sha256sum "$GGUF_FILE" | cut -d' ' -f1)
  if [ "$sha" != "$GGUF_SHA256" ]; then
    echo "the joined GGUF's SHA-256 is $sha, not $GGUF_SHA256: a part is missing" \
      "(stashed: $(echo "$GGUF_STASH".*))" >&2
    return 1
  fi
  echo "$sha  $(basename "$GGUF_FILE")"
}

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = split ]; then
  cd "$(dirname "$0")/../.." || exit 1
  source=$(python3 -c "from streamrl.models import smollm2_gguf_path; print(smollm2_gguf_path())" 2>/dev/null ||
    .venv/bin/python -c "from streamrl.models import smollm2_gguf_path; print(smollm2_gguf_path())") || exit 1
  rm -f .gguf/part.* && mkdir -p .gguf && split -b "${2:-33}M" "$source" .gguf/part. &&
    ls -la .gguf
fi
