#!/usr/bin/env bash
# Shared body of launch_prefill_pool.sh / launch_decode_pool.sh: start N `kvrelay serve` nodes of
# one role on this host, forward Ctrl-C (stop now) / SIGTERM (graceful drain) to all of them, exit
# when any of them exits. It runs the kvrelay that is installed (./.venv's, else the one on PATH)
# and never installs anything: install first with deploy/setup.sh (CPU) or deploy/setup.sh --gpu.
# --dry-run prints each node's environment and command instead (its own devices on a GPU host).
set -euo pipefail
role=$1; shift
n=1
dry=0
args=()
while [ $# -gt 0 ]; do
    case $1 in
        -n) n=$2; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -h|--help) grep '^# ' "$(dirname "$0")/launch_${role}_pool.sh" | cut -c3-; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
cd "$(dirname "$0")/.."
if [ -x .venv/bin/kvrelay ]; then
    kvrelay=.venv/bin/kvrelay
elif command -v kvrelay >/dev/null 2>&1; then
    kvrelay=$(command -v kvrelay)
else
    echo "launch_${role}_pool.sh: kvrelay is not installed: bash deploy/setup.sh (CPU hosts) or" \
         "bash deploy/setup.sh --gpu (GPU hosts), or pip install 'kvrelay[gpu]'" >&2
    exit 2
fi
if [ "$dry" = 1 ]; then
    for ((i = 0; i < n; i++)); do
        "$kvrelay" serve --role "$role" --index "$i" --deploy."$role" "$n" "${args[@]}" --dry-run
    done
    exit 0
fi
pids=()
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait' INT
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' TERM
for ((i = 0; i < n; i++)); do
    "$kvrelay" serve --role "$role" --index "$i" --deploy."$role" "$n" "${args[@]}" &
    pids+=($!)
done
wait -n "${pids[@]}"
kill -INT "${pids[@]}" 2>/dev/null || true
wait
