"""`ac-observe up`: an engine and a daemon as supervised child processes.

A child that exits is started again, with a backoff that doubles (1 s up to 30 s) while
it keeps dying young and resets once it has run a while; the other child keeps running,
so the daemon keeps serving (and shows the restart) while the engine comes back. Only
Ctrl-C or SIGTERM stops both. Children get SIGTERM when `up` exits by any path, and the
kernel kills them if `up` itself dies (PR_SET_PDEATHSIG), so no orphan outlives it.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ac_observe.auth import FAULT_TOKEN_ENV

PR_SET_PDEATHSIG = 1
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 30.0  # a child that ran this long starts its next backoff afresh


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent:  # `up` died before prctl took effect
        os._exit(1)


@dataclass(slots=True)
class Child:
    name: str
    args: list[str]
    env: dict
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = FIRST_BACKOFF_SECONDS
    restart_at: float | None = None

    def start(self) -> None:
        parent = os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-m", "ac_observe.daemon.cli", *self.args],
                                     env=self.env, preexec_fn=lambda: _die_with_parent(parent))
        self.started, self.restart_at = time.monotonic(), None

    def check(self, now: float) -> None:
        """Schedule a restart when the child has exited; start it when its time comes."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restarts += 1
                self.start()
            return
        assert self.proc is not None  # started before its first check
        code = self.proc.poll()
        if code is None:
            return
        ran = now - self.started
        if ran >= HEALTHY_AFTER_SECONDS:
            self.backoff = FIRST_BACKOFF_SECONDS
        why = f"signal {-code}" if code < 0 else f"code {code}"
        print(f"ac-observe up: the {self.name} exited ({why}) after {ran:.1f}s; restarting it "
              f"in {self.backoff:g}s (restart {self.restarts + 1})"
              + ("; it keeps exiting young, see its output above" if self.restarts and
                 ran < HEALTHY_AFTER_SECONDS else ""), file=sys.stderr, flush=True)
        self.restart_at = now + self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_SECONDS)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


def run_up(engine_port: int, daemon_port: int, model: str, demo_load: bool,
           telemetry_root: str, engine_args: list[str], daemon_args: list[str],
           demo_drift: tuple[float, float] | None = None, daemon_scheme: str = "http",
           demo_drift_cause: str = "steps") -> int:
    """demo_drift: (calm, drifting) seconds of the demo's drift cycle (daemon/demo_drift.py),
    or None; demo_drift_cause: what drifts (demo_drift.CAUSES). daemon_scheme: https when
    the daemon has a web-config file that sets TLS."""
    from ac_observe.telemetry_format import default_telemetry_root
    root = telemetry_root or str(default_telemetry_root())
    env = {**os.environ, "AC_OBSERVE_TELEMETRY_DIR": root}
    # Quiet children by default: the terminal shows where to look, not access logs.
    engine_cmd = ["engine", "--port", str(engine_port), "--model", model, "--log-level",
                  "warning", *engine_args]
    if demo_load and not demo_drift:  # the drift's driver sends (and shapes) the traffic
        engine_cmd.append("--demo-load")
    daemon_cmd = ["daemon", "--port", str(daemon_port), "--telemetry-root", root, "--log-level",
                  "warning", *daemon_args]
    driver = None
    if demo_drift:
        from ac_observe.daemon.demo_drift import DriftDriver, demo_engine_args, write_demo_alerting
        engine_cmd += demo_engine_args(demo_drift_cause, engine_args)
        daemon_cmd += ["--alerting", str(write_demo_alerting()), "--alert-interval", "2s"]
        fault_token = os.environ.get(FAULT_TOKEN_ENV) or secrets.token_urlsafe(24)
        engine_env = {**env, FAULT_TOKEN_ENV: fault_token}  # the engine's alone
        driver = DriftDriver(f"http://127.0.0.1:{engine_port}",
                             f"http://127.0.0.1:{daemon_port}", *demo_drift,
                             fault_token=fault_token, cause=demo_drift_cause)
    else:
        engine_env = env
    children = [Child("daemon", daemon_cmd, env), Child("engine", engine_cmd, engine_env)]
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for child in children:
        child.start()
    print(_banner(engine_port, daemon_port, daemon_scheme), file=sys.stderr, flush=True)
    if driver is not None:
        driver.start()
    try:
        while not stopping:
            now = time.monotonic()
            for child in children:
                child.check(now)
            time.sleep(0.2)
    finally:
        if driver is not None:
            driver.close()
        _stop_all(children)
    return 0


def _banner(engine_port: int, daemon_port: int, daemon_scheme: str = "http") -> str:
    """Where to look once the children are started."""
    daemon = f"{daemon_scheme}://127.0.0.1:{daemon_port}"
    # (over TLS, the CLI wants the CA that signed the daemon's certificate)
    cli = f"--daemon {daemon}" + (" --cacert CA.crt" if daemon_scheme == "https" else "")
    return ("\nac-observe is up\n"
            f"  engine   http://127.0.0.1:{engine_port}   "
            "(Anthropic /v1/messages, OpenAI /v1/chat/completions)\n"
            f"  daemon   {daemon}/metrics\n"
            f"  try      ac-observe {cli} --metric cuda_stream_utilization "
            "--window 60s\n"
            f"           ac-observe {cli} status\n"
            "  stop     Ctrl-C\n")


def _stop_all(children: list[Child]) -> None:
    """SIGTERM to every child, then 15 s in all for them to exit before SIGKILL."""
    for child in children:
        child.stop()
    deadline = time.monotonic() + 15
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
