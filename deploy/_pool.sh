#!/usr/bin/env bash
# Shared body of launch_prefill_pool.sh / launch_decode_pool.sh: start N `kvrelay serve` nodes of
# one role on this host, forward Ctrl-C (stop now) / SIGTERM (graceful drain) to all of them, exit
# when any of them exits.
set -euo pipefail
role=$1; shift
n=1
args=()
while [ $# -gt 0 ]; do
    case $1 in
        -n) n=$2; shift 2 ;;
        -h|--help) grep '^# ' "$(dirname "$0")/launch_${role}_pool.sh" | cut -c3-; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
cd "$(dirname "$0")/.."
bash deploy/setup.sh
pids=()
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait' INT
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' TERM
for ((i = 0; i < n; i++)); do
    .venv/bin/kvrelay serve --role "$role" --index "$i" "${args[@]}" &
    pids+=($!)
done
wait -n "${pids[@]}"
kill -INT "${pids[@]}" 2>/dev/null || true
wait
