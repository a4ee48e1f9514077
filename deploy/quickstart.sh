#!/usr/bin/env bash
# The main job on a fresh machine: install, bring up a local 1-prefill/1-decode stack on the
# built-in tiny model (two vLLM CPU servers + the router), serve one request through it, stop.
#
#   bash deploy/quickstart.sh                      # one request, then everything stops
#   bash deploy/quickstart.sh --keep               # stay up (Ctrl-C stops); try the curl from README.md
#   bash deploy/quickstart.sh --transport.backend tcp   # any `kvrelay up` flag passes through
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
keep=0
args=()
for a in "$@"; do
    if [ "$a" = "--keep" ]; then keep=1; else args+=("$a"); fi
done
prompt="The prefill node computes this prompt once and pushes its KV cache to the decode node, chunk by chunk."
if [ $keep = 1 ]; then
    exec .venv/bin/kvrelay up --request "$prompt" "${args[@]}"
fi
exec .venv/bin/kvrelay up --request "$prompt" --exit-after-request "${args[@]}"
