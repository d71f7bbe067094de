"""The daemon side installs without torch: its modules must not import it."""
from __future__ import annotations

import subprocess
import sys


def test_daemon_cli_and_shared_modules_never_import_torch():
    code = ("import sys, daemon.cli, daemon.catalog, engine, engine.config, engine.skeleton, "
            "engine.telemetry, collectors; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.startswith("ac-observe ")
