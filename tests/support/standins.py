"""Stand-in native libraries for what only a GPU machine has, built here from C: the real
pynvml and the real eBPF probes use them exactly as they use NVIDIA's."""
from __future__ import annotations

import subprocess
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "standins"
CC = ("gcc", "-O2", "-Wall")


def build_nvml(folder: Path) -> Path:
    """libnvidia-ml.so.1 in `folder` (load it through LD_LIBRARY_PATH)."""
    subprocess.run([*CC, "-shared", "-fPIC", "-o", folder / "libnvidia-ml.so.1",
                    SOURCES / "nvml_standin.c"], check=True)
    return folder


def build_cuda(folder: Path) -> Path:
    """libcuda.so.1, libcudart.so.12 (calling the former) and `cuda_pattern`, a program
    driving them on command (tests/standins/cuda_pattern.c), in `folder`."""
    subprocess.run([*CC, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    folder / "libcuda.so.1", SOURCES / "cuda_standin.c"], check=True)
    subprocess.run([*CC, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o",
                    folder / "libcudart.so.12", SOURCES / "cudart_standin.c",
                    folder / "libcuda.so.1"], check=True)
    subprocess.run([*CC, "-o", folder / "cuda_pattern", SOURCES / "cuda_pattern.c",
                    folder / "libcudart.so.12", folder / "libcuda.so.1",
                    f"-Wl,-rpath,{folder}"], check=True)
    return folder


class Pattern:
    """A `cuda_pattern` process, driven line by line."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen([folder / "cuda_pattern"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.pid = str(self.proc.pid)

    def run(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def exit(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
