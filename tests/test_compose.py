"""`docker compose up` for real: a Docker engine (Debian docker.io), the shipped Dockerfile
and docker-compose.yml driven by Debian's docker-compose with a test override, no image
registry. The engine (as its image's non-root user), daemon, Prometheus and Alertmanager
containers run; Prometheus in
its container scrapes the daemon in its container over TLS (the certificates
scripts/compose-tls.sh makes, with the bearer token from the compose secret); the daemon's
image holds no torch and its HEALTHCHECK turns healthy; the engine's demo traffic makes
the four headline metrics non-empty through
`ac-observe --metric` against the published daemon port; the gateway (its compose
profile) relays a request to the engine and its telemetry reaches the daemon with
`kind="gateway"` and `upstream="engine-0"`; an alert Prometheus fires
(CollectorDown: no GPU for NVML in a container here) reaches a webhook receiver on the
host through Alertmanager with the shipped configuration.

Grafana is left out: its image cannot be had on these machines (no registry, no binary);
its dashboards are proven against a real Prometheus in tests/test_dashboards.py.

Offline images, because no image registry is reachable from these machines: the base is
`debootstrap --variant=minbase bookworm` with python3, Prometheus and Alertmanager from
Debian, imported under a local tag that the Dockerfile's BASE_IMAGE argument names; the
same image runs Prometheus and Alertmanager in place of prom/prometheus and
prom/alertmanager. pip in the build reaches PyPI only through this machine's intercepting
TLS proxy, so the build trusts this machine's CA bundle (PIP_CERT, an extra-CA file put in
the build context), and it takes the torch CPU wheel from pip's find-links folder (`pip
config list` names it), copied into the build context."""
from __future__ import annotations

import configparser
import glob
import json
import os
import secrets
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from support.receivers import WebhookReceiver
from support.servers import AC_OBSERVE, free_port, wait_for
from support.stack import REPO, delivery_of

# A Docker engine, image builds and the whole compose stack: minutes.
pytestmark = [pytest.mark.stack, pytest.mark.slow]

BASE = "ac-observe-test-base:bookworm"
IMAGE = "ac-observe:compose-test"
DAEMON_IMAGE = "ac-observe-daemon:compose-test"
PROJECT = "acobserve-test"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a Docker engine needs root")


def _run(*args, timeout=900, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _mirror() -> str:
    for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
        for line in Path(path).read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


def _base_image(tmp: Path) -> None:
    """The offline base: debootstrap, then docker import (skipped when it exists)."""
    if subprocess.run(["docker", "image", "inspect", BASE], capture_output=True).returncode == 0:
        return
    rootfs = tmp / "rootfs"
    _run("debootstrap", "--variant=minbase",
         "--include=python3,python3-venv,ca-certificates,prometheus,prometheus-alertmanager",
         "bookworm", str(rootfs), _mirror(), timeout=900)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    _run("docker", "import", "-", BASE, stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def _context(tmp: Path) -> Path:
    """The repository's files (as committed, plus the working tree's edits) with this
    machine's CA bundle and the torch CPU wheel put into docker/."""
    context = tmp / "context"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, context / name)
    pip = configparser.ConfigParser()
    pip.read(["/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.expanduser("~/.pip/pip.conf"),
              os.path.expanduser("~/.config/pip/pip.conf")])
    cert = os.environ.get("PIP_CERT") or pip.get("global", "cert", fallback="") or \
        "/etc/ssl/certs/ca-certificates.crt"
    shutil.copy(cert, context / "docker" / "ca.pem")
    links = os.environ.get("PIP_FIND_LINKS") or pip.get("global", "find-links", fallback="")
    wheels = [w for d in links.split() for w in glob.glob(f"{d}/torch-2.13.0*cpu*.whl")]
    for wheel in wheels[:1]:
        shutil.copy(wheel, context / "docker" / "wheels")
    (context / "secrets").mkdir(mode=0o700)  # as the README says
    (context / "secrets" / "ac-observe.token").write_text(secrets.token_hex(32) + "\n")
    (context / "secrets" / "ac-observe.token").chmod(0o644)
    _run(str(context / "scripts" / "compose-tls.sh"), cwd=context)  # as the README says
    return context


def _gateway() -> str:
    """The host's address on Docker's default bridge (host.docker.internal)."""
    config = json.loads(_run("docker", "network", "inspect", "bridge").stdout)[0]["IPAM"]
    if config["Config"] and config["Config"][0].get("Gateway"):
        return config["Config"][0]["Gateway"]
    out = _run("ip", "-4", "-o", "addr", "show", "docker0").stdout  # (not always listed)
    return out.split("inet ")[1].split("/")[0]


@pytest.fixture(scope="module")
def stack(dockerd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compose")
    _base_image(tmp)
    context = _context(tmp)
    hook = WebhookReceiver(host=_gateway())
    ports = {name: free_port() for name in ("ENGINE", "DAEMON", "PROMETHEUS", "ALERTMANAGER",
                                            "GATEWAY")}
    env = {**os.environ, "AC_BASE_IMAGE": BASE, "AC_OBSERVE_IMAGE": IMAGE,
           "AC_OBSERVE_DAEMON_IMAGE": DAEMON_IMAGE,
           "AC_TORCH_SPEC": "torch==2.13.0+cpu", "AC_TORCH_INDEX_URL": "https://pypi.org/simple",
           "AC_PIP_CERT": "docker/ca.pem", "AC_WITH_BCC": "0",
           # The forced alert: NVML collected on a machine without a GPU is down.
           "AC_COLLECTORS": "engine,nvml",
           "AC_ALERT_WEBHOOK_URL": f"http://host.docker.internal:{hook.port}/hook",
           **{f"AC_{name}_PORT": str(port) for name, port in ports.items()}}
    # The test's override: Prometheus and Alertmanager from the offline base (Debian's
    # binaries) instead of the registry's images. (The engine runs as shipped: the tiny
    # model with demo traffic.)
    (context / "docker-compose.test.yml").write_text(yaml.safe_dump({"services": {
        "prometheus": {"image": BASE, "entrypoint": ["/usr/bin/prometheus"]},
        "alertmanager": {"image": BASE,
                         "environment": {"ALERTMANAGER_BINARY":
                                         "/usr/bin/prometheus-alertmanager"},
                         "extra_hosts": ["host.docker.internal:host-gateway"]},
    }}))
    # The gateway's profile on, so that up, ps, logs and down all see its service (it runs
    # the daemon's image: nothing more to build).
    compose = ["docker-compose", "-p", PROJECT, "--profile", "gateway", "-f",
               "docker-compose.yml", "-f", "docker-compose.test.yml"]
    try:
        _run(*compose, "build", "engine", "daemon", cwd=context, env=env, timeout=1200)
        _run(*compose, "up", "-d", "engine", "daemon", "prometheus", "alertmanager",
             "gateway", cwd=context, env=env, timeout=600)
        yield {"context": context, "ports": ports, "hook": hook, "compose": compose,
               "env": env, "token": context / "secrets" / "ac-observe.token",
               "ca": context / "secrets" / "tls" / "ca.crt"}
    finally:
        logs = subprocess.run([*compose, "logs", "--no-color", "--tail=60"], cwd=context,
                              env=env, capture_output=True, text=True)
        print(logs.stdout[-8000:])
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], cwd=context, env=env,
                       capture_output=True, timeout=300)
        hook.down()


@needs_root
def test_the_stack_runs_scrapes_answers_and_alerts(stack):
    ports, token, ca = stack["ports"], stack["token"], stack["ca"]
    daemon = f"https://127.0.0.1:{ports['DAEMON']}"
    headers = {"authorization": f"Bearer {token.read_text().strip()}"}
    wait_for(lambda: _status(daemon + "/healthz", headers, ca) == 200, 180,
             "the daemon's port")
    # Off loopback in its container, the daemon asks for its token, over TLS only.
    assert _status(daemon + "/metrics", {}, ca) == 401
    assert _status(daemon.replace("https:", "http:") + "/metrics", headers, ca) == 400
    # Its image holds no torch; the engine's does.
    for image, has_torch in ((DAEMON_IMAGE, False), (IMAGE, True)):
        probe = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", image,
                                "-c", "import importlib.util as u; "
                                      "print(u.find_spec('torch') is not None)"],
                               capture_output=True, text=True, timeout=300)
        assert probe.stdout.strip() == str(has_torch), (image, probe.stdout, probe.stderr)
    services = {"engine", "daemon", "prometheus", "alertmanager", "gateway"}

    def running() -> set[str]:
        return set(_run(*stack["compose"], "ps", "--services", "--filter", "status=running",
                        cwd=stack["context"], env=stack["env"]).stdout.split())
    wait_for(lambda: running() == services, 60, f"{services} running")
    # The engine runs as the image's non-root user, which owns its telemetry directory;
    # the root daemon, told that owner, reads it (the engine-0 series below).
    ids = _run(*stack["compose"], "exec", "-T", "engine", "sh", "-c",
               "id -u; id -g; stat -c %u /telemetry/engine-0", cwd=stack["context"],
               env=stack["env"]).stdout.split()
    assert ids == ["10001", "10001", "10001"], ids

    # The four headline metrics, through the CLI against the published port.
    for metric in ("inference_latency_ns", "kv_cache_hit_rate", "skeleton_complexity",
                   "cuda_stream_utilization"):
        def answered(metric=metric):
            out = subprocess.run([AC_OBSERVE, "--daemon", daemon, "--token-file", str(token),
                                  "--cacert", str(ca), "--metric", metric, "--window", "60s",
                                  "--json"],
                                 capture_output=True, text=True, timeout=60)
            return out.returncode == 0 and json.loads(out.stdout)["series"]
        series = wait_for(answered, 240, f"{metric} from the demo traffic")
        assert {s["labels"]["engine"] for s in series} == {"engine-0"}

    # A request through the gateway's published port reaches the engine, and the gateway's
    # telemetry (its volume shared with the daemon) answers as an engine of kind gateway.
    gateway = f"http://127.0.0.1:{ports['GATEWAY']}"

    def relay() -> httpx.Response | None:
        try:
            return httpx.post(gateway + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
        except httpx.TransportError:  # its port not yet published or listening
            return None
    relayed = wait_for(relay, 60, "the gateway to take a request")
    assert relayed.status_code == 200 and relayed.json()["choices"], relayed.text[:500]
    assert relayed.headers["x-ac-trace-id"] and int(relayed.headers["x-ac-gateway-ttft-ns"]) > 0

    def through_gateway():
        out = subprocess.run([AC_OBSERVE, "--daemon", daemon, "--token-file", str(token),
                              "--cacert", str(ca), "--metric", "inference_latency_ns",
                              "--window", "60s", "--labels", "kind=gateway", "--json"],
                             capture_output=True, text=True, timeout=60)
        return out.returncode == 0 and json.loads(out.stdout)["series"]
    series = wait_for(through_gateway, 60, "the gateway's TTFT through the daemon")
    assert [(s["labels"]["engine"], s["labels"]["upstream"]) for s in series] == \
        [("gateway-0", "engine-0")]

    # Prometheus, in its container, scrapes the daemon in its container (token and all).
    prometheus = f"http://127.0.0.1:{ports['PROMETHEUS']}"

    def scraped():
        targets = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()
        job = [t for t in targets["data"]["activeTargets"]
               if t["labels"]["job"] == "ac-observe"]
        return job and job[0]["health"] == "up"
    wait_for(scraped, 120, "Prometheus to scrape the daemon")
    wait_for(lambda: httpx.get(prometheus + "/api/v1/query", params={
        "query": 'ac_inference_latency_seconds_count{engine="engine-0"}'}, timeout=10)
        .json()["data"]["result"], 60, "the engine's series in Prometheus")

    # An alert Prometheus fires reaches the host's receiver through Alertmanager.
    hook = stack["hook"]
    body = wait_for(lambda: delivery_of(hook, "CollectorDown"), 240,
                    "Alertmanager's delivery of CollectorDown")
    assert body["version"] == "4" and body["receiver"] == "ac-observe-webhook"

    # The daemon image's HEALTHCHECK (over TLS, as its web-config file says) is healthy.
    container = _run(*stack["compose"], "ps", "-q", "daemon", cwd=stack["context"],
                     env=stack["env"]).stdout.strip()

    def healthy() -> bool:
        return _run("docker", "inspect", "--format", "{{.State.Health.Status}}",
                    container).stdout.strip() == "healthy"
    wait_for(healthy, 180, "the daemon container's HEALTHCHECK", interval=2)


def _status(url: str, headers: dict, ca: Path) -> int:
    try:
        return httpx.get(url, headers=headers, timeout=5,
                         verify=ssl.create_default_context(cafile=str(ca))).status_code
    except httpx.HTTPError:
        return 0
