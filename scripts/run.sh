#!/usr/bin/env bash
# Fresh machine to a running stack: install what running needs (none of the test tools),
# then `ac-observe up` starts the engine (tiny model, 127.0.0.1:8000) and the daemon
# (127.0.0.1:9410) with demo traffic. Ctrl-C stops both. Extra arguments go to
# `ac-observe up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/ac-observe up --demo-load "$@"
