"""A CUDA process inside a real Docker container: its eBPF and NVML series carry the
container's id as Docker names it (`docker inspect`), read from its real cgroup.

The image is made offline from this machine's files: the stand-in CUDA libraries and
`cuda_pattern` (tests/standins/) with the C library they link, `docker import`ed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from support.servers import sample_value, wait_for
from support.standins import build_cuda, build_nvml

pytestmark = [pytest.mark.stack, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("dockerd") is None,
                                 reason="a Docker engine needs root and dockerd")]


def _image(folder: Path, tag: str) -> None:
    """An image holding `folder` (the stand-ins, at the same absolute path: their rpath)
    and the shared libraries its programs load."""
    files = {p for p in folder.iterdir() if p.is_file()}
    linked = subprocess.run(["ldd", str(folder / "cuda_pattern")], capture_output=True,
                            text=True, check=True).stdout
    files |= {Path(word) for word in linked.split() if word.startswith("/")}
    with tarfile.open(folder / "rootfs.tar", "w") as tar:
        for path in sorted(files):
            if path.name != "rootfs.tar":
                tar.add(os.path.realpath(path), arcname=str(path).lstrip("/"))
    with open(folder / "rootfs.tar", "rb") as rootfs:
        subprocess.run(["docker", "import", "-", tag], stdin=rootfs, check=True,
                       capture_output=True, timeout=300)


def test_a_process_in_a_docker_container_carries_its_container_id(dockerd, start_daemon,
                                                                   tmp_path_factory):
    cuda = build_cuda(tmp_path_factory.mktemp("cuda"))
    nvml = build_nvml(tmp_path_factory.mktemp("nvml"))
    tag = f"ac-observe-attribution-test:{uuid.uuid4().hex[:8]}"
    _image(cuda, tag)
    cidfile = tmp_path_factory.mktemp("cid") / "cid"
    container = subprocess.Popen(
        ["docker", "run", "-i", "--rm", "--cidfile", str(cidfile), tag,
         str(cuda / "cuda_pattern")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert container.stdout.readline().strip() == "ready"
        container_id = cidfile.read_text().strip()
        host_pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", container_id],
                                  capture_output=True, text=True, check=True).stdout.strip()
        daemon = start_daemon(None, "--collectors", "ebpf,nvml", "--interval", "0.5s",
                              "--pod-resources-socket", "",
                              env={"LD_LIBRARY_PATH": str(nvml),
                                   "AC_NVML_STANDIN_PIDS": host_pid})

        def ebpf_up():
            import httpx
            status = httpx.get(daemon.url + "/api/v1/status", timeout=10).json()
            return next(c for c in status["collectors"] if c["name"] == "ebpf")["up"]
        wait_for(ebpf_up, 60, "probes on the container's libraries")
        container.stdin.write("round 1\n")
        container.stdin.flush()
        assert container.stdout.readline().strip() == "done"
        mine = {"pid": host_pid, "container_id": container_id}
        metrics = wait_for(lambda: (got := daemon.metrics()) and sample_value(
            got, "ac_cuda_graph_launches_total", **mine) == 1 and got, 30,
            "the container's counts")
        assert len(container_id) == 64
        assert sample_value(metrics, "ac_cuda_kernel_launches_total", stream="0x1000",
                            **mine) == 3
        assert sample_value(metrics, "ac_ebpf_map_entries", **mine) > 0
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", **mine) == 512 << 20
        assert sample_value(metrics, "ac_gpu_process_sm_utilization_ratio",
                            **mine) == pytest.approx(0.30)
    finally:
        if container.poll() is None:
            container.stdin.write("exit\n")
            container.stdin.flush()
            container.wait(timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
