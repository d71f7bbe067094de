"""The exit codes every command shares (the `ac_observe.daemon.cli` docstring and the
epilog of `ac-observe --help`), from the installed script: 0 ok, 1 the daemon answered
no, 2 usage, 3 no daemon answers. And every command is there however the CLI starts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.servers import free_port, run_cli

EXIT_CODES = ("0  ok", "1  the daemon answered no", "2  usage", "3  the daemon cannot be reached")


@pytest.mark.slow
def test_each_exit_code_against_a_live_daemon_and_a_closed_port(start_daemon):
    daemon = start_daemon(None, "--collectors", "engine", env={"AC_OBSERVE_TOKEN": "right"})
    query = ("--metric", "kv_cache_hit_rate", "--window", "60s")

    ok = run_cli("--daemon", daemon.url, "--token", "right", *query, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["metric"] == "kv_cache_hit_rate"

    # The daemon answers no: a label its series do not have, a wrong token.
    unknown_label = run_cli("--daemon", daemon.url, "--token", "right", *query,
                            "--labels", "no_such_label=x")
    assert unknown_label.returncode == 1, unknown_label.stderr
    assert "no label 'no_such_label'" in unknown_label.stderr
    wrong_token = run_cli("--daemon", daemon.url, "--token", "wrong", *query)
    assert wrong_token.returncode == 1 and "refused the token" in wrong_token.stderr

    # Usage: a window that is no duration, told before any daemon is asked.
    bad_window = run_cli("--daemon", daemon.url, "--token", "right", "--metric",
                         "kv_cache_hit_rate", "--window", "5 fortnights")
    assert bad_window.returncode == 2, bad_window.stderr
    assert bad_window.stderr.startswith("error: --window: bad duration")

    # Nothing listens: every command that asks the daemon says so, with 3.
    closed = f"http://127.0.0.1:{free_port()}"
    for args in ((*query,), ("status",), ("alerts",), ("top",)):
        out = run_cli("--daemon", closed, *args)
        assert out.returncode == 3, (args, out.stderr)
        assert "cannot reach the ac-observe daemon" in out.stderr, (args, out.stderr)


def test_help_lists_the_exit_codes():
    out = run_cli("--help")
    assert out.returncode == 0
    for line in EXIT_CODES:
        assert line in out.stdout, (line, out.stdout)


def test_python_dash_m_has_every_command():
    """`python -m ac_observe.daemon.cli` (how `up` starts its children) registers the
    groups as the console script does."""
    for group in ("dashboards", "rules", "alerts"):
        out = subprocess.run([sys.executable, "-m", "ac_observe.daemon.cli", group, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (group, out.stderr)
        assert f"ac_observe.daemon.cli {group} [OPTIONS] COMMAND" in out.stdout, out.stdout
    listed = subprocess.run([sys.executable, "-m", "ac_observe.daemon.cli", "--help"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    script = run_cli("--help").stdout
    commands = lambda text: text.split("Commands:")[1].split("Exit codes:")[0]  # noqa: E731
    assert commands(listed) == commands(script)
