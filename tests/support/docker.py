"""The Docker engine the tests that run containers need."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

from support.processes import start_process
from support.servers import wait_for


def docker_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def docker_engine(log_dir: Path) -> Iterator[None]:
    """The running Docker engine, or one started here and stopped after."""
    if docker_up():
        yield
        return
    log = open(log_dir / "dockerd.log", "w")
    proc = start_process(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(docker_up, 60, "dockerd")
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
