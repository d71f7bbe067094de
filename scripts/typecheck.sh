#!/usr/bin/env bash
# mypy over the typed parts of the installed package (the contract, collectors, daemon,
# gateway), as
# the tests import it: run from a temporary folder, so that the source folders (contract/
# is `ac_observe`) do not shadow it. Installs nothing: scripts/install.sh first, and
# `pip install --no-deps .` after a change. Exits non-zero on any error.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
outside="$(mktemp -d)"
trap 'rm -rf "$outside"' EXIT
cd "$outside"
"$repo/.venv/bin/mypy" --python-executable "$repo/.venv/bin/python" \
    --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" \
    -p ac_observe.daemon -p ac_observe.collectors -p ac_observe.gateway -p ac_observe.metrics \
    -p ac_observe.friendly -p ac_observe.telemetry_format -p ac_observe.auth "$@"
