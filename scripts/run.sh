#!/usr/bin/env bash
# Fresh machine to a running stack: install, then start the engine (tiny model, loopback)
# with demo traffic. Extra arguments go to `ac-observe`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/ac-observe engine --demo-load "$@"
