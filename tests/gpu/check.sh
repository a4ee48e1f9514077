#!/usr/bin/env bash
# Build, check and time the CUDA paths on a GPU host in one run:
#   Triton gather/scatter vs reference + GB/s vs device-to-device copy,
#   the pinned receive pool, and NIXL writes from VRAM.
# Usage: bash tests/gpu/check.sh
#   online:  installs the `dev` extra + torch, triton, nixl into .venv-gpu
#   offline: if .whl/ holds wheels (nixl, nixl-cu13, pyzmq, msgspec), they go into
#            /tmp/kvrelay-site on top of the host's python3 (which must have torch + triton)
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    PY=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvrelay-site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/kvrelay-site${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV=.venv-gpu
    [ -x $VENV/bin/python ] || python3 -m venv $VENV
    $VENV/bin/python -m pip -q install -e ".[dev]" torch triton pyzmq msgspec xxhash nixl-cu12==1.5.1 >/dev/null
    $VENV/bin/python -m pip -q install --no-deps nixl==1.5.1 >/dev/null
    PY=$VENV/bin/python
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
export UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
$PY -m pytest -q tests/kernels/test_kernels.py -p no:cacheprovider
exec $PY tests/gpu/check_gpu.py
