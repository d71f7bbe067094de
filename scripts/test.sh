#!/usr/bin/env bash
# Fresh machine to green tests: install everything, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# pytest's own script, not `python -m`: the repository root stays off sys.path.
exec .venv/bin/pytest -q "$@"
