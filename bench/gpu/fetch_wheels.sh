#!/usr/bin/env bash
# Download the CPython 3.12 wheels that the GPU machine lacks, pinned by requirements/gpu.txt,
# into ./.whl (git-ignored). On the GPU machine, install them first in the device command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && ...
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl -r requirements/gpu.txt
du -sh .whl && ls .whl
