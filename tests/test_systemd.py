"""The systemd unit (deploy/systemd/ac-observe.service), checked by systemd's own
`systemd-analyze verify`, and the readiness protocol it relies on (Type=notify): a real
daemon sends READY=1 to $NOTIFY_SOCKET once it serves, RELOADING=1 then READY=1 around a
SIGHUP (the unit's ExecReload), STOPPING=1 at the end."""
from __future__ import annotations

import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.servers import DaemonProcess
from support.stack import REPO

UNIT = REPO / "deploy" / "systemd" / "ac-observe.service"


def _service_lines(text: str) -> dict[str, str]:
    """KEY -> value of the unit (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    return dict(line.split("=", 1) for line in joined.splitlines()
                if "=" in line and not line.startswith("#"))


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/install.sh --test installs systemd"
    ac_observe = Path(sys.executable).with_name("ac-observe")
    # The unit names pip's path for root; verify checks the binary exists: this venv's.
    unit = tmp_path / "ac-observe.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/ac-observe", str(ac_observe)))
    run = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                         timeout=60)
    # verify exits 0 on an unknown key or section, warning only: any line is a failure.
    assert run.returncode == 0 and not run.stderr.strip() and not run.stdout.strip(), \
        run.stderr + run.stdout
    keys = _service_lines(UNIT.read_text())
    assert keys["Type"] == "notify" and keys["ExecReload"] == "/bin/kill -HUP $MAINPID"
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                      "CapabilityBoundingSet", "RestrictAddressFamilies"):
        assert hardening in keys
    # Every option ExecStart passes is one the daemon takes.
    argv = shlex.split(keys["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/ac-observe", "daemon"]
    help_text = subprocess.run([str(ac_observe), "daemon", "--help"], capture_output=True,
                               text=True, timeout=60, env={"COLUMNS": "200"}).stdout
    for option in argv[2:]:
        assert option.split("=")[0] in help_text, option


def test_a_daemon_under_type_notify_says_ready_reloading_and_stopping(tmp_path):
    notify_path = tmp_path / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(60)
    root = tmp_path / "telemetry"
    root.mkdir()
    alerting = tmp_path / "alerting.yaml"
    alerting.write_text("rules: defaults\n")
    daemon = DaemonProcess(root, "--collectors", "engine", "--alerting", str(alerting),
                           "--state-dir", str(tmp_path / "state"),
                           env={"NOTIFY_SOCKET": str(notify_path)})
    try:
        messages = [listener.recv(4096).decode()]
        assert messages[0].splitlines()[0] == "READY=1"
        daemon.wait_ready()
        daemon.proc.send_signal(signal.SIGHUP)
        messages += [listener.recv(4096).decode(), listener.recv(4096).decode()]
        assert messages[1].startswith("RELOADING=1\nMONOTONIC_USEC=")
        assert messages[2] == "READY=1"
        daemon.proc.send_signal(signal.SIGTERM)
        assert listener.recv(4096).decode() == "STOPPING=1"
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.stop()
        listener.close()
    log = daemon.log_path.read_text()
    assert "configuration reloaded" in log and "Traceback" not in log


@pytest.mark.parametrize("address", ["", "relative/path"])
def test_without_a_notify_socket_nothing_is_sent(monkeypatch, address):
    from ac_observe.daemon import sd_notify
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sd_notify.notify("READY=1") is False
