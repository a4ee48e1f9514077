#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, static checks (ruff, mypy, import-linter), then
# pytest. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
# Static checks first (seconds): lint, types across the package, the import contracts.
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
