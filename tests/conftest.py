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


class EngineServer:
    """`ac-observe engine` in a subprocess on a free loopback port."""

    def __init__(self, telemetry_dir, *args: str):
        import subprocess
        import sys
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.telemetry_dir = telemetry_dir
        self.log = open(telemetry_dir.parent / f"engine-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "engine", "--port", str(self.port),
             "--telemetry-dir", str(telemetry_dir), "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout=120.0):
        import time
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("engine did not become healthy")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def start_engine(tmp_path_factory):
    servers = []

    def start(*args: str) -> EngineServer:
        root = tmp_path_factory.mktemp("engine")
        server = EngineServer(root / "telemetry", *args).wait_healthy()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    server = EngineServer(root / "telemetry", "--max-model-len", "1024", "--kv-blocks", "512",
                          "--max-body-mb", "1").wait_healthy()
    yield server
    server.stop()
