"""How ac-observe installs and how its parts depend on each other.

- One top-level package, `ac_observe`, that lives beside python-daemon's `daemon`.
- Dependencies run one way: the contract (`ac_observe.metrics`, `.telemetry_format`) is a
  leaf; the engine and the collectors read it and nothing of each other or the daemon; the
  daemon reads the collectors and the contract, and never imports torch.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ac_observe
from support.imports import imports_of, installed_modules
from support.servers import run_cli

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ac_observe.engine", "ac_observe.daemon", "ac_observe.collectors",
            "ac_observe.gateway")
# The engine's modules the gateway shares: each torch-free.
GATEWAY_SHARES = ("ac_observe.engine.api_wire", "ac_observe.engine.skeleton",
                  "ac_observe.engine.telemetry")
CONTRACT = ("ac_observe", "ac_observe.metrics", "ac_observe.telemetry_format", "ac_observe.auth")


def _graph():
    modules = installed_modules()
    return modules, {name: imports_of(path, name) for name, path in modules.items()}


def _part(name: str) -> str:
    for package in PACKAGES:
        if name == package or name.startswith(package + "."):
            return package
    return "contract" if name.startswith("ac_observe") else "third-party"


def test_the_contract_is_a_leaf_of_the_standard_library():
    _, graph = _graph()
    for name in CONTRACT:
        _, anywhere = graph[name]
        outside = {i for i in anywhere if i.split(".")[0] not in sys.stdlib_module_names}
        assert not outside, f"{name} imports {sorted(outside)}"


def test_engine_and_collectors_never_import_the_daemon_or_each_other():
    _, graph = _graph()
    forbidden = {"ac_observe.engine": ("ac_observe.daemon", "ac_observe.collectors"),
                 "ac_observe.collectors": ("ac_observe.daemon", "ac_observe.engine")}
    for name, (_, anywhere) in graph.items():
        part = _part(name)
        if part in forbidden:
            bad = {i for i in anywhere if i.startswith(forbidden[part])}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_daemon_side_never_imports_torch():
    """No module-level import chain from the daemon or a collector reaches torch; the CLI
    loads engine code only inside the commands that run it (`engine`, `skeleton`)."""
    modules, graph = _graph()
    runs_engine_code = {"ac_observe.daemon.cli.engine", "ac_observe.daemon.cli.skeleton"}
    assert runs_engine_code <= set(graph)  # the CLI's modules are looked at
    for name, (top, anywhere) in graph.items():
        if _part(name) == "ac_observe.daemon":
            assert not {i for i in top if i.startswith("ac_observe.engine")}, name
            if name not in runs_engine_code:
                assert not {i for i in anywhere if i.startswith("ac_observe.engine")}, name
    for start in (n for n in modules if _part(n) in ("ac_observe.daemon",
                                                      "ac_observe.collectors")):
        seen, stack = set(), [start]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            for imported in graph.get(current, (set(), set()))[0]:
                assert imported.split(".")[0] != "torch", f"{start} reaches torch via {current}"
                if imported in graph:
                    stack.append(imported)
    code = ("import sys, ac_observe.daemon.cli, ac_observe.daemon.service, "
            "ac_observe.daemon.http_api, ac_observe.collectors.engine, ac_observe.collectors.nvml, "
            "ac_observe.engine, ac_observe.engine.config, ac_observe.engine.skeleton, "
            "ac_observe.engine.telemetry; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_gateway_never_reaches_torch():
    """`ac-observe gateway` runs on `pip install ac-observe`: no import of the gateway's,
    at module level or inside a function, reaches torch or an engine module beyond the
    three it shares."""
    modules, graph = _graph()
    starts = [n for n in modules if _part(n) == "ac_observe.gateway"]
    assert {"ac_observe.gateway.proxy", "ac_observe.gateway.serve"} <= set(starts)
    seen, stack = set(), list(starts) + ["ac_observe.daemon.cli.gateway"]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for imported in graph.get(current, (set(), set()))[1]:
            assert imported.split(".")[0] != "torch", f"the gateway reaches torch via {current}"
            if imported.startswith("ac_observe.engine."):
                assert any(imported == share or imported.startswith(share + ".")
                           for share in GATEWAY_SHARES), f"{current} imports {imported}"
            if imported in graph:
                stack.append(imported)
    code = ("import sys, ac_observe.gateway.serve, ac_observe.daemon.cli.gateway; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tests_import_the_installed_package_not_the_repository():
    repo = Path(__file__).resolve().parents[1]
    assert all(Path(p or ".").resolve() != repo for p in sys.path)
    assert importlib.util.find_spec("daemon") is None  # the folder is not a package here
    assert importlib.util.find_spec("engine") is None


def test_console_script_is_installed():
    out = run_cli("--version", check=True)
    assert out.stdout.strip() == f"ac-observe {ac_observe.__version__}"


def _bare_venv(path: Path) -> Path:
    """A virtual environment without pip that sees this one's packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/site-packages"))
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "zz_test_deps.pth").write_text(ours + "\n")  # read last: its own come first
    return path / "bin" / "python"


def _pip(python: Path, *args: str) -> None:
    # --ignore-installed: the packages of this venv, visible through the .pth file, must
    # not count as already installed there.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--ignore-installed", "--disable-pip-version-check", *args], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of the repository, built once for the tests that read or install it."""
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(REPO)], check=True,
                   capture_output=True)
    (built,) = wheels.glob("ac_observe-*.whl")
    return built


@pytest.mark.slow
def test_installs_beside_python_daemon_wheel_and_editable(tmp_path, wheel):
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert top == {"ac_observe", f"ac_observe-{ac_observe.__version__}.dist-info"}
    for mode, target in (("wheel", [str(wheel)]), ("editable", ["-e", str(REPO)])):
        python = _bare_venv(tmp_path / mode)
        _pip(python, "python-daemon==3.1.2")  # first, as on a node that already runs it
        _pip(python, "--no-deps", *target)
        version = subprocess.run([str(python.parent / "ac-observe"), "--version"],
                                 capture_output=True, text=True, check=True, cwd=tmp_path)
        assert version.stdout.strip() == f"ac-observe {ac_observe.__version__}", mode
        probe = subprocess.run(
            [str(python), "-c", "import daemon, ac_observe.daemon.cli; "
             "print(daemon.DaemonContext.__module__, daemon.__file__)"],
            capture_output=True, text=True, check=True, cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        module, path = probe.stdout.split()
        assert module == "daemon.daemon" and f"{mode}/lib" in path, (mode, probe.stdout)


# The stack's files, as package data of ac_observe.dashboards: what Grafana, Prometheus,
# Alertmanager, the daemon's alerting file and Kubernetes read (paths under dashboards/).
STACK_FILES = ("grafana/dashboards/ac-overview.json", "grafana/dashboards/ac-kv-cache.json",
               "grafana/dashboards/ac-gpu-cuda.json", "grafana/dashboards/ac-drift.json",
               "grafana/provisioning/dashboards/ac-observe.yml",
               "grafana/provisioning/datasources/prometheus.yml",
               "prometheus/prometheus.yml", "prometheus/rules/drift.rules.yml",
               "prometheus/rules/recording.rules.yml", "prometheus/tests/drift.rules.test.yml",
               "prometheus/tests/fast.rules.test.yml", "alertmanager/alertmanager.yml",
               "ac-observe/alerting.yaml", "kubernetes/namespace.yaml",
               "kubernetes/daemon.yaml", "kubernetes/engine.yaml",
               "kubernetes/servicemonitor.yaml", "kubernetes/prometheusrule.yaml",
               "kubernetes/unprivileged/daemon.yaml", "kubernetes/README.md")


def test_the_wheel_carries_the_stack_files_and_the_license(wheel):
    """Every file of the stack under dashboards/ is in the wheel, byte for byte, under
    ac_observe/dashboards/; LICENSE is in its dist-info."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    shipped = REPO / "dashboards"
    in_repository = {path.relative_to(shipped).as_posix()
                     for folder in ("grafana", "prometheus", "alertmanager", "ac-observe",
                                    "kubernetes")
                     for path in (shipped / folder).rglob("*") if path.is_file()}
    assert set(STACK_FILES) <= in_repository  # (a file named here that moved or went)
    for path in sorted(in_repository):
        name = f"ac_observe/dashboards/{path}"
        assert name in names, f"{path} is not in {wheel.name}"
        assert archive.read(name) == (shipped / path).read_bytes(), path
    license_name = f"ac_observe-{ac_observe.__version__}.dist-info/licenses/LICENSE"
    assert license_name in names, sorted(n for n in names if ".dist-info/" in n)
    assert archive.read(license_name) == (REPO / "LICENSE").read_bytes()
    assert "Apache License\n                           Version 2.0" in \
        archive.read(license_name).decode()


def test_the_installed_package_has_the_stack_files():
    import importlib.resources
    data = importlib.resources.files("ac_observe.dashboards")
    for path in STACK_FILES:
        assert data.joinpath(path).is_file(), path
