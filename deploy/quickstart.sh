#!/usr/bin/env bash
# The main job on a fresh machine: install, then run the transfer benchmark on defaults.
# Prints the table; writes bench_results/transfer.json and bench_results/transfer.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/kvrelay bench transfer "$@"
