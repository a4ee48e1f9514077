#!/usr/bin/env bash
# Build, check and time the CUDA paths on a GPU host in one run:
#   Triton gather/scatter vs reference + GB/s vs device-to-device copy,
#   the pinned receive pool, and NIXL writes from VRAM.
# Usage: bash tests/gpu/check.sh    (installs the `gpu` + `transport` extras into .venv-gpu)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-gpu
[ -x $VENV/bin/python ] || python3 -m venv $VENV
$VENV/bin/python -m pip -q install -e ".[dev]" torch triton pyzmq msgspec xxhash nixl-cu12==1.5.1 >/dev/null
$VENV/bin/python -m pip -q install --no-deps nixl==1.5.1 >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv || true
$VENV/bin/python -m pytest -q tests/test_kernels.py -p no:cacheprovider
exec $VENV/bin/python tests/gpu/check_gpu.py
