"""Servers the tests start for real: `ac-observe engine` and `ac-observe daemon` in
subprocesses on free loopback ports, run through the installed console script."""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.processes import start_process, stop_process

# The installed console script, as a user runs it.
AC_OBSERVE = str(Path(sys.executable).with_name("ac-observe"))
if not os.path.exists(AC_OBSERVE):
    AC_OBSERVE = shutil.which("ac-observe") or AC_OBSERVE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """`ac-observe ARGS` to completion, output captured as text."""
    return subprocess.run([AC_OBSERVE, *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll until `predicate()` is truthy; its value. AssertionError naming `what` if not."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class ServerProcess:
    """An `ac-observe` command serving HTTP, in a subprocess on a free loopback port."""

    ready_path = "/health"
    # How httpx checks the server: True (plain HTTP, or the system's CAs), or the TLS
    # context of a test CA (tests/support/certs.py) for a daemon serving TLS.
    verify: ssl.SSLContext | bool = True

    def __init__(self, args: list[str], log_dir, env: dict | None = None,
                 scheme: str = "http"):
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{args[0]}-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = start_process([AC_OBSERVE, *args, "--port", str(self.port)],
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})

    def wait_ready(self, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[1]} exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2,
                             verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.proc.args[1]} did not become ready")

    def stop(self):
        stop_process(self.proc)
        self.log.close()


class EngineServer(ServerProcess):
    """`ac-observe engine`, writing telemetry into `telemetry_dir`."""

    def __init__(self, telemetry_dir, *args: str, env: dict | None = None):
        self.telemetry_dir = Path(telemetry_dir)
        super().__init__(["engine", "--telemetry-dir", str(telemetry_dir), "--log-level",
                          "warning", *args], self.telemetry_dir.parent, env)


class DaemonProcess(ServerProcess):
    """`ac-observe daemon` reading `telemetry_root`."""

    ready_path = "/healthz"

    def __init__(self, telemetry_root, *args: str, env: dict | None = None,
                 verify: ssl.SSLContext | None = None):
        if verify is not None:
            self.verify = verify
        super().__init__(["daemon", "--telemetry-root", str(telemetry_root), *args],
                         Path(telemetry_root).parent, env,
                         scheme="http" if verify is None else "https")
        self.token = (env or {}).get("AC_OBSERVE_TOKEN", os.environ.get("AC_OBSERVE_TOKEN"))
        if "--token" in args:
            self.token = args[args.index("--token") + 1]
        if "--token-file" in args:
            self.token = Path(args[args.index("--token-file") + 1]).read_text().strip()

    def wait_ready(self, timeout=120.0):
        """Serving, and its first cycle done (until then /metrics holds no collector)."""
        super().wait_ready(timeout)
        wait_for(lambda: self.status()["as_of"] is not None, timeout,
                 "the daemon's first cycle")
        return self

    def status(self) -> dict:
        """/api/v1/status's answer (`as_of`: the newest cycle's time)."""
        headers = {"Authorization": b"Bearer " + self.token.encode()} if self.token else None
        response = httpx.get(self.url + "/api/v1/status", headers=headers, timeout=5,
                             verify=self.verify)
        assert response.status_code == 200, f"status: {response.status_code} {response.text}"
        return response.json()

    def wait_cycles(self, count: int, timeout: float = 30.0) -> None:
        """Until `count` cycles that began after this call are done: what they read
        happened after it. (A cycle missed between two polls only makes the wait longer.)"""
        since = time.time()
        seen = set()

        def done() -> bool:
            as_of = self.status()["as_of"]
            if as_of is not None and as_of > since:
                seen.add(as_of)
            return len(seen) >= count
        wait_for(done, timeout, f"{count} daemon cycles after {since:.3f}", interval=0.1)

    def metrics(self, headers=None) -> dict:
        """{(sample name, frozenset(labels)): value} of /metrics."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10, headers=headers,
                                       verify=self.verify).text)


def parse_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample_value(metrics: dict, name: str, **labels):
    """The one sample named `name` whose labels include `labels` (None if absent)."""
    found = [v for (n, lab), v in metrics.items()
             if n == name and all((k, val) in lab for k, val in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def serve_in_thread(service, log_level: str = "critical"):
    """The engine app of `service` (an EngineService) on a free port in this process, for
    tests that reach into the engine while it serves. Returns (url, stop)."""
    import threading

    import uvicorn

    from ac_observe.engine.server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 60, "the app to start", interval=0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://127.0.0.1:{port}", stop


class GatewayServer(ServerProcess):
    """`ac-observe gateway --upstream URL`, writing telemetry into `telemetry_dir`."""

    def __init__(self, upstream: str, telemetry_dir, *args: str, ready_path="/health"):
        self.ready_path = ready_path
        self.telemetry_dir = telemetry_dir
        super().__init__(["gateway", "--upstream", upstream, "--telemetry-dir",
                          str(telemetry_dir), "--log-level", "warning", *args],
                         telemetry_dir.parent)
