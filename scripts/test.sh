#!/usr/bin/env bash
# Fresh machine to green tests: install what running and testing need, then run the tests.
#   scripts/test.sh           every test (what CI runs)
#   scripts/test.sh --fast    the fast tier: no `stack`, `bench` or `slow` test (the markers
#                             in pyproject.toml), nor the system packages only they need
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then fast=1; else pytest_args+=("$arg"); fi
done
if [ "$fast" = 1 ]; then
  scripts/install.sh --test --fast
  pytest_args=(-m "not stack and not bench and not slow" "${pytest_args[@]}")
else
  scripts/install.sh --test
fi
# Lint and types first: a minute, and a red one says more than a test that trips on it.
.venv/bin/ruff check --quiet .
scripts/typecheck.sh
# pytest's own script, not `python -m`: the repository root stays off sys.path.
exec .venv/bin/pytest -q "${pytest_args[@]}"
