#!/usr/bin/env bash
# Verify and time the device paths on a GPU host in one run (at most a few minutes):
#   Triton gather/scatter of whole blocks and of head ranges (NHD, HND) vs the torch reference,
#   the pinned receive pool, NIXL writes from VRAM, and the connectors' worker halves on caches
#   laid out as vLLM lays them out on GPUs, equal and mixed TP. One table; JSON in $OUT.
# Usage:
#   bash tests/gpu/check.sh              # on the GPU host
#   bash tests/gpu/check.sh --rehearse   # the same script on CPU with ./.venv, nothing installed
#   online:  installs the `dev` extra + torch, triton, nixl into .venv-gpu
#   offline: if .whl/ holds wheels (nixl, nixl-cu13, pyzmq, msgspec), they go into
#            /tmp/kvrelay-site on top of the host's python3 (which must have torch + triton)
set -euo pipefail
cd "$(dirname "$0")/../.."
export UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KVRELAY_SECRET=${KVRELAY_SECRET:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}
if [ "${1:-}" = "--rehearse" ]; then
    [ -x .venv/bin/python ] || { echo "check.sh --rehearse: run bash deploy/setup.sh first" >&2; exit 2; }
    export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
    exec .venv/bin/python tests/gpu/check_gpu.py --device cpu --json "${OUT:-/tmp}/gpu_rehearsal.json"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    PY=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvrelay-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/kvrelay-site"
else
    VENV=.venv-gpu
    [ -x $VENV/bin/python ] || python3 -m venv $VENV
    $VENV/bin/python -m pip -q install -e ".[dev]" torch triton pyzmq msgspec xxhash nixl-cu12==1.5.1 >/dev/null
    $VENV/bin/python -m pip -q install --no-deps nixl==1.5.1 >/dev/null
    PY=$VENV/bin/python
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -m pytest -q tests/kernels/test_kernels.py -p no:cacheprovider
exec $PY tests/gpu/check_gpu.py
