"""Shared fixtures: Hugging Face checkpoints written by the tests themselves (nothing is
downloaded), and real engine and daemon servers (tests/support/servers.py)."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from support.checkpoints import write_hf_checkpoint
from support.docker import docker_engine
from support.postgres import PostgresServer
from support.servers import DaemonProcess, EngineServer

# The benchmarks' load generators (bench/daemon_cost.py's `traffic`) serve tests too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Daemons keep history in a store under the state directory: never the user's own.
os.environ["AC_OBSERVE_STATE_DIR"] = tempfile.mkdtemp(prefix="ac-observe-state-")


# Marks of the tests that race live processes on a shared 2-core machine: one retry each,
# an R in the progress line and "N rerun" in the summary, so that a host's hiccup does not
# sink a run while a real fault still fails twice; a rerun in CI's log is a flake to fix.
_RETRIED_TIERS = ("stack", "slow", "bench")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(tier) for tier in _RETRIED_TIERS) \
                and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1))


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path, monkeypatch):
    """Each test's daemons keep their history apart from every other test's."""
    monkeypatch.setenv("AC_OBSERVE_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"))


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


@pytest.fixture
def start_daemon(tmp_path_factory):
    daemons = []

    def start(telemetry_root=None, *args, env=None, verify=None) -> DaemonProcess:
        root = telemetry_root or tmp_path_factory.mktemp("daemon") / "telemetry"
        root.mkdir(parents=True, exist_ok=True)
        daemon = DaemonProcess(root, *args, env=env, verify=verify).wait_ready()
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (one per test session; a fresh database per store)."""
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.stack)])
def store(request, tmp_path):
    """The daemon's store on SQLite and on a real PostgreSQL server (the stack tier's)."""
    from ac_observe.daemon.store import Store
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres").new_database()
    store = Store(url, state_dir=tmp_path / "state")
    yield store
    store.close()


@pytest.fixture(scope="session")
def dockerd(tmp_path_factory):
    """The Docker engine (one for the session: the compose and container tests share it)."""
    yield from docker_engine(tmp_path_factory.mktemp("dockerd"))
