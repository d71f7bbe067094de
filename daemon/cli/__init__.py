"""The `ac-observe` command line (typer): one app (app.py), a module per command group.

- query.py: the bare form, `ac-observe --metric NAME --window 60s`, and `--list`
- status.py, top.py: what the daemon sees; one live screen per engine and lane
- daemon.py, up.py, engine.py: run the daemon, engine + daemon supervised, the engine
- alerts.py, rules.py: drift alerts (list, defaults, test), the rules for Prometheus
- dashboards.py: generate, push, and the path of the installed dashboard and stack files
- skeleton.py: a prompt's structural skeleton
- gateway.py: the pass-through gateway (ac_observe.gateway)
- client.py: the daemon's HTTP API (get_json, DaemonError, DaemonUnreachable)
- render.py: figures scaled for reading, sparklines, tables that fit, error lines

Exit codes, the same for every command (also in `ac-observe --help`):
  0  ok
  1  the daemon answered no (an error body, a refused token), a failed delivery in
     `alerts test`, stale files in `dashboards generate --check`
  2  usage: a bad option value, an unreadable file
  3  the daemon cannot be reached

NOTE: torch-free at import: engine code loads inside the `engine`, `skeleton` and
`gateway` commands only (the gateway's own never reaches torch), and the alerting code
inside the alerts and rules commands.
"""
from __future__ import annotations

# Every command module, so that every command is registered on the app whatever the entry
# point (the console script, `python -m ac_observe.daemon.cli`). Commands list in --help in
# the order they are registered: the order of this import.
# isort: off
from ac_observe.daemon.cli import (  # noqa: F401 - imported to register their commands
    query, status, top, daemon, alerts, up, skeleton, engine, gateway, dashboards, rules)
# isort: on
from ac_observe.daemon.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
