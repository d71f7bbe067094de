"""The daemon side installs without torch: its modules must not import it."""
from __future__ import annotations

import subprocess
import sys

from support.servers import run_cli


def test_daemon_cli_and_shared_modules_never_import_torch():
    code = ("import sys, ac_observe.daemon.cli, ac_observe.metrics, ac_observe.telemetry_format, "
            "ac_observe.engine, ac_observe.engine.config, ac_observe.engine.skeleton, "
            "ac_observe.engine.telemetry, ac_observe.collectors; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_console_script_is_installed():
    out = run_cli("--version", check=True)
    assert out.stdout.startswith("ac-observe ")
