#!/usr/bin/env bash
# Start the OpenAI-compatible PD router in front of existing pools.
#
#   deploy/launch_router.sh --router.prefill '[http://h1:8100]' \
#       --router.decode '["http://h2:8200=tcp://h2:9100"]' [--router.port 8000] [--config FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/kvrelay router "$@"
