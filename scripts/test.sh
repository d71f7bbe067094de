#!/usr/bin/env bash
# Fresh machine to green tests: install what running and testing need, then run the whole
# suite (what CI runs). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
# pytest's own script, not `python -m`: the repository root stays off sys.path.
exec .venv/bin/pytest -q "$@"
