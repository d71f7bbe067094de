"""Shared fixtures: Hugging Face checkpoints written by the tests themselves (nothing is
downloaded) and engines built on them."""
from __future__ import annotations

import os

import pytest

from engine.checkpoints import write_hf_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"))


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """An `ac-observe` command serving HTTP, in a subprocess on a free loopback port."""

    ready_path = "/health"

    def __init__(self, args: list[str], log_dir, env: dict | None = None):
        import subprocess
        import sys
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{args[0]}-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", *args, "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout=120.0):
        import time
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[3]} exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.proc.args[3]} did not become ready")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class EngineServer(ServerProcess):
    """`ac-observe engine`, writing telemetry into `telemetry_dir`."""

    def __init__(self, telemetry_dir, *args: str):
        self.telemetry_dir = telemetry_dir
        super().__init__(["engine", "--telemetry-dir", str(telemetry_dir), "--log-level",
                          "warning", *args], telemetry_dir.parent)


@pytest.fixture
def start_engine(tmp_path_factory):
    servers = []

    def start(*args: str) -> EngineServer:
        root = tmp_path_factory.mktemp("engine")
        server = EngineServer(root / "telemetry", *args).wait_ready()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    server = EngineServer(root / "telemetry", "--max-model-len", "1024", "--kv-blocks", "512",
                          "--max-body-mb", "1").wait_ready()
    yield server
    server.stop()


class DaemonProcess(ServerProcess):
    """`ac-observe daemon` reading `telemetry_root`."""

    ready_path = "/healthz"

    def __init__(self, telemetry_root, *args: str, env: dict | None = None):
        super().__init__(["daemon", "--telemetry-root", str(telemetry_root), *args],
                         telemetry_root.parent, env)

    def metrics(self, headers=None) -> dict:
        """{(sample name, frozenset(labels)): value} of /metrics."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=10, headers=headers).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

@pytest.fixture
def start_daemon(tmp_path_factory):
    daemons = []

    def start(telemetry_root=None, *args, env=None) -> DaemonProcess:
        root = telemetry_root or tmp_path_factory.mktemp("daemon") / "telemetry"
        root.mkdir(parents=True, exist_ok=True)
        daemon = DaemonProcess(root, *args, env=env).wait_ready()
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()


def sample_value(metrics: dict, name: str, **labels):
    """The one sample named `name` whose labels include `labels` (None if absent)."""
    found = [v for (n, lab), v in metrics.items()
             if n == name and all((k, val) in lab for k, val in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None
