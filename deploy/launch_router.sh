#!/usr/bin/env bash
# Start the OpenAI-compatible PD router in front of existing pools.
#
#   deploy/launch_router.sh --router.prefill '[http://h1:8100]' \
#       --router.decode '["http://h2:8200=tcp://h2:9100"]' [--router.port 8000] [--config FILE]
#
# Runs the kvrelay that is installed (./.venv's, else the one on PATH; a router host needs only
# `pip install kvrelay`) and never installs anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/kvrelay ]; then
    exec .venv/bin/kvrelay router "$@"
fi
command -v kvrelay >/dev/null 2>&1 || { echo "launch_router.sh: kvrelay is not installed: pip install kvrelay" >&2; exit 2; }
exec kvrelay router "$@"
