#!/usr/bin/env bash
# Fresh machine to green tests: install everything, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
