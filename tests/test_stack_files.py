"""The shipped stack files, checked without running them: docker-compose.yml and the GPU
override against the Compose Specification's schema, their wiring (the token secret, the
mounts eBPF needs, loopback-only ports, the provisioning Grafana reads), and the
Kubernetes manifests against the Kubernetes version they name (kubernetes-validate; the
Prometheus Operator's kinds by promtool and by their selectors)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from support.stack import REPO

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "compose-spec.json").read_text())
KUBERNETES_VERSION = "1.31.0"  # dashboards/kubernetes/README.md says so


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml",
                                  "docker-compose.vllm.yml"])
def test_compose_files_follow_the_compose_specification(name):
    document = yaml.safe_load((REPO / name).read_text())
    jsonschema.Draft7Validator(SCHEMA).validate(document)


def test_compose_wiring():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"engine", "gateway", "daemon", "prometheus", "alertmanager",
                             "grafana"}
    # The gateway: off unless its profile is asked for, in front of the engine, writing
    # beside it where the daemon reads.
    gateway = services["gateway"]
    assert gateway["profiles"] == ["gateway"]
    assert "--upstream=http://engine:8000" in gateway["command"]
    assert "telemetry:/telemetry" in gateway["volumes"]
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        for port in service.get("ports", []):  # published on loopback unless told otherwise
            assert port.startswith("${AC_PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)
    daemon = services["daemon"]
    assert daemon["pid"] == "host" and services["engine"]["pid"] == "host"
    assert "SYS_ADMIN" in daemon["cap_add"]
    mounts = {v.split(":")[1] for v in daemon["volumes"]}
    assert {"/sys/kernel/debug", "/lib/modules", "/usr/src", "/telemetry"} <= mounts
    assert "--token-file=/run/secrets/ac_observe_token" in daemon["command"]
    assert "ac_observe_token" in services["prometheus"]["secrets"]
    # Prometheus reads the same secret for its scrapes.
    prometheus = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml")
                                .read_text())
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "ac-observe"]
    assert job["authorization"]["credentials_file"] == "/run/secrets/ac_observe_token"
    assert job["static_configs"][0]["targets"] == ["daemon:9410"]
    # ... over TLS: the daemon's web-config file names the certificate and key secrets,
    # Prometheus trusts the CA secret (scripts/compose-tls.sh makes all three).
    assert job["scheme"] == "https"
    assert job["tls_config"]["ca_file"] == "/run/secrets/ac_observe_ca"
    assert "ac_observe_ca" in services["prometheus"]["secrets"]
    web = yaml.safe_load((REPO / "dashboards" / "ac-observe" / "web.yml").read_text())
    for key, secret in (("cert_file", "ac_observe_tls_cert"),
                        ("key_file", "ac_observe_tls_key")):
        assert web["tls_server_config"][key] == f"/run/secrets/{secret}"
        assert secret in daemon["secrets"]
    assert daemon["environment"]["AC_OBSERVE_WEB_CONFIG_FILE"] == "/etc/ac-observe/web.yml"
    assert "./dashboards/ac-observe:/etc/ac-observe:ro" in daemon["volumes"]
    # The daemon (and the gateway) run the image without torch, the engine the other.
    assert daemon["build"]["target"] == "daemon" and services["gateway"]["build"]["target"] \
        == "daemon" and services["engine"]["build"]["target"] == "engine"
    # Grafana: the provisioning and the dashboards it mounts exist, and it opens on the
    # overview.
    grafana = services["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (REPO / source).is_dir(), source
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "dashboards" / "grafana" / "dashboards" / Path(home).name).is_file()
    # The GPU override reserves the GPUs for the engine and the daemon.
    gpu = yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())["services"]
    # ... and collects NVML and eBPF there, where the CPU stack collects the engine alone
    # (no CollectorDown for what cannot exist without a GPU).
    assert daemon["environment"]["AC_OBSERVE_COLLECTORS"] == "${AC_COLLECTORS:-engine}"
    assert gpu["daemon"]["environment"]["AC_OBSERVE_COLLECTORS"] == \
        "${AC_COLLECTORS:-engine,nvml,ebpf}"
    for name in ("engine", "daemon"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


@pytest.mark.slow
def test_kubernetes_manifests_validate_for_their_version(tmp_path):
    manifests = sorted((REPO / "dashboards" / "kubernetes").glob("*.yaml"))
    # (the unprivileged daemon: in place of daemon.yaml, validated alike)
    variants = sorted((REPO / "dashboards" / "kubernetes" / "unprivileged").glob("*.yaml"))
    assert variants
    assert KUBERNETES_VERSION.rsplit(".", 1)[0] in \
        (REPO / "dashboards" / "kubernetes" / "README.md").read_text()
    validate = str(Path(sys.executable).with_name("kubernetes-validate"))
    out = subprocess.run([validate, "-k", KUBERNETES_VERSION, "--strict",
                          *map(str, manifests + variants)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for path in variants:  # every resource of theirs passed, none went unchecked (by
        for doc in yaml.safe_load_all(path.read_text()):  # path: daemon.yaml's names match)
            assert f"{path} passed for resource {doc['kind'].lower()}/" \
                f"{doc['metadata']['name']}" in out.stdout + out.stderr, (path, doc["kind"])
    kinds = {}
    for path in manifests:
        for doc in yaml.safe_load_all(path.read_text()):
            kinds[doc["kind"]] = doc
    assert {"DaemonSet", "Deployment", "Service", "ServiceMonitor", "PrometheusRule"} <= \
        set(kinds)
    # The Prometheus Operator's kinds (no schema in kubernetes-validate): the rules pass
    # promtool; the ServiceMonitor selects the daemon's Service by its labels and port.
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(
        {"groups": kinds["PrometheusRule"]["spec"]["groups"]}))
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    services = [doc for path in manifests for doc in yaml.safe_load_all(path.read_text())
                if doc["kind"] == "Service"]
    monitor = kinds["ServiceMonitor"]["spec"]
    selected = [s for s in services if monitor["selector"]["matchLabels"].items()
                <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["ac-observe-daemon"]
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    daemonset = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert daemonset["hostPID"] is True
    # vLLM and SGLang servers found by process: the host's pids, their /proc/PID/ns/net.
    (daemon,) = [c for c in daemonset["containers"] if c["name"] == "daemon"]
    assert "--discover-engines" in daemon["args"]
    assert "SYS_PTRACE" in daemon["securityContext"]["capabilities"]["add"]
    # Every series carries the Kubernetes node's name, set by the daemon (downward API),
    # and the ServiceMonitor honours it: no relabelling writes `node`, which the operator
    # would otherwise turn into `exported_node` on the daemon's series.
    (node,) = [e for e in daemon["env"] if e["name"] == "AC_OBSERVE_NODE_NAME"]
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    for endpoint in monitor["endpoints"]:
        assert endpoint["honorLabels"] is True
        assert all(r.get("targetLabel") != "node" for r in
                   endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []))


def test_the_global_prometheus_federates_every_recording_rule_and_keeps_labels():
    """dashboards/prometheus/global.yml passes promtool, keeps the cluster's labels
    (`node` above all) and its match[] selects every shipped recording rule and every
    family the Fleet board reads, and no bucket."""
    import re

    from ac_observe.dashboards import generate
    path = REPO / "dashboards" / "prometheus" / "global.yml"
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    (job,) = yaml.safe_load(path.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/federate" and job["honor_labels"] is True
    patterns = [re.fullmatch(r'\{__name__=~"(.*)"\}', m).group(1)
                for m in job["params"]["match[]"]]

    def federated(name: str) -> bool:
        return any(re.fullmatch(p, name) for p in patterns)
    records = [rule["record"] for group in generate.recording_rules()["groups"]
               for rule in group["rules"]]
    assert records and all(federated(name) for name in records)
    fleet = json.loads((REPO / "dashboards" / "grafana" / "dashboards" /
                        "ac-fleet.json").read_text())
    read = {name for panel in fleet["panels"] for t in panel.get("targets") or []
            for name in re.findall(r"\b(ac_[a-z0-9_]+)", t["expr"])}
    assert read and all(federated(name) for name in read), read
    assert not federated("ac_inference_latency_seconds_bucket")


def test_the_vllm_override_discovers_the_server_it_adds(tmp_path):
    """docker-compose.vllm.yml on top of the stack and its GPU file: a vLLM service whose
    command line discovery recognises, a daemon in the host's pid namespace told to
    discover it, with what reading another container's /proc/PID/net takes."""
    from ac_observe.collectors.scrape.discovery import engine_kind, port_of

    override = yaml.safe_load((REPO / "docker-compose.vllm.yml").read_text())["services"]
    vllm, daemon = override["vllm"], override["daemon"]
    # The image's entrypoint is `vllm serve`; the process reads `python3 .../vllm serve`.
    argv = ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", *vllm["command"]]
    assert engine_kind(argv) == "vllm" and port_of(argv, "vllm") == 8000
    assert vllm["ports"][0].startswith("${AC_PUBLISH_ADDRESS:-127.0.0.1}:")
    assert daemon["environment"]["AC_OBSERVE_DISCOVER_ENGINES"] == "1"
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed")
    token = tmp_path / "token"
    token.write_text("t")
    out = subprocess.run(
        [compose, "-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml",
         "-f", "docker-compose.vllm.yml", "config"], cwd=REPO, capture_output=True,
        text=True, env={"PATH": os.environ["PATH"], "AC_OBSERVE_TOKEN_FILE": str(token)})
    assert out.returncode == 0, out.stderr
    merged = yaml.safe_load(out.stdout)["services"]
    assert merged["daemon"]["pid"] == "host"
    assert "SYS_PTRACE" in merged["daemon"]["cap_add"]
    assert merged["daemon"]["environment"]["AC_OBSERVE_DISCOVER_ENGINES"] == "1"
    assert "vllm" in merged["daemon"]["depends_on"]
    (device,) = merged["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"


@pytest.mark.parametrize("url, refused", [
    ("https://hooks.example.com/x?a=1&b=%2F#frag", None),
    ("http://[::1]:9/alert", None),
    ('https://hooks.example.com/"\n  - name: injected', "only a URL's characters"),
    ("https://hooks.example.com/a b", "only a URL's characters"),
    ("https://h/$(id)", "only a URL's characters"),
    ("ftp://h/x", "an http:// or https:// URL is needed"),
    ("", "an http:// or https:// URL is needed"),
])
def test_the_alertmanager_entrypoint_writes_a_checked_url_into_its_config(tmp_path, url,
                                                                           refused):
    """The compose service's entrypoint, run by sh here (paths moved into tmp): a URL lands
    in the config verbatim; anything that could break out of the YAML string is refused."""
    command = yaml.safe_load((REPO / "docker-compose.yml").read_text()
                             )["services"]["alertmanager"]["command"][0]
    script = (command.replace("$$", "$")
              .replace("/etc/alertmanager/alertmanager.yml",
                       str(REPO / "dashboards" / "alertmanager" / "alertmanager.yml"))
              .replace("/tmp/alertmanager.yml", str(tmp_path / "out.yml")))
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "AC_ALERT_WEBHOOK_URL": url,
                              "ALERTMANAGER_BINARY": "true"})
    if refused:
        assert out.returncode == 2 and refused in out.stderr, out.stderr
        assert not (tmp_path / "out.yml").exists()
        return
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load((tmp_path / "out.yml").read_text())
    (hook,) = config["receivers"][0]["webhook_configs"]
    assert hook["url"] == url


def _documents(path: Path) -> dict[str, dict]:
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc
            for doc in yaml.safe_load_all(path.read_text())}


def _container(daemonset: dict, name: str) -> dict:
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]
                    if c["name"] == name]
    return container


def test_the_engines_run_as_the_user_the_root_daemon_reads():
    kubernetes = REPO / "dashboards" / "kubernetes"
    engine = _documents(kubernetes / "engine.yaml")["Deployment/ac-observe-engine"]
    pod = engine["spec"]["template"]["spec"]
    for container in pod["containers"]:  # the engine and the gateway
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, container
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
    # Their directories under the node's root-owned telemetry root, made theirs first.
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    # All of them: a reused name may hold an older release's root-owned files.
    assert "chown -R -h 10001:10001" in " ".join(init["args"])
    daemon = _documents(kubernetes / "daemon.yaml")["DaemonSet/ac-observe-daemon"]
    env = {e["name"]: e.get("value") for e in _container(daemon, "daemon")["env"]}
    assert env["AC_OBSERVE_TELEMETRY_OWNER"] == "10001"
    # And compose: the engine image's user (Dockerfile), the daemon told it.
    assert "USER 10001:10001" in (REPO / "Dockerfile").read_text().split(
        "AS engine")[1]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert compose["daemon"]["environment"]["AC_OBSERVE_TELEMETRY_OWNER"] == "10001"


def test_the_unprivileged_daemon_needs_no_root_and_matches_the_privileged_one():
    kubernetes = REPO / "dashboards" / "kubernetes"
    privileged = _documents(kubernetes / "daemon.yaml")
    unprivileged = _documents(kubernetes / "unprivileged" / "daemon.yaml")
    assert set(unprivileged) == set(privileged)
    # In place of daemon.yaml: its ConfigMaps and Service the same, applied either way.
    for name, doc in unprivileged.items():
        if not name.startswith("DaemonSet/"):
            assert doc == privileged[name], name
    pod = unprivileged["DaemonSet/ac-observe-daemon"]["spec"]["template"]["spec"]
    daemon = _container(unprivileged["DaemonSet/ac-observe-daemon"], "daemon")
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert "ebpf" not in env["AC_OBSERVE_COLLECTORS"].split(",")
    assert env["AC_OBSERVE_POD_RESOURCES_SOCKET"] == ""  # root's socket: not asked
    # Never the network-facing engines' uid (10001, engine.yaml) under hostPID: they could
    # read its environ and root (token, TLS key). It reads their telemetry through their
    # group, as their directories' owner told it.
    context = daemon["securityContext"]
    engine = _documents(kubernetes / "engine.yaml")["Deployment/ac-observe-engine"]
    engine_uids = {c["securityContext"]["runAsUser"]
                   for c in engine["spec"]["template"]["spec"]["containers"]}
    assert engine_uids == {10001}
    assert context["runAsNonRoot"] is True and context["runAsUser"] not in engine_uids
    assert context["runAsGroup"] == context["runAsUser"] == 10002
    assert pod["securityContext"]["supplementalGroups"] == [10001]
    assert env["AC_OBSERVE_TELEMETRY_OWNER"] == "10001"
    (state_owner,) = pod["initContainers"]
    assert state_owner["command"][-2] == "10002:10002"
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False and not context.get("privileged")
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert "--discover-engines" not in daemon["args"]  # SYS_PTRACE: not for a non-root
    for container in pod["containers"]:
        assert container["securityContext"]["runAsNonRoot"] is True, container["name"]
    # Root only to hand the state directory to the daemon's user, with CAP_CHOWN alone.
    for init in pod.get("initContainers", []):
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                           "add": ["CHOWN"]}
    mounted = {v["name"] for v in pod["volumes"]}
    assert not mounted & {"debugfs", "tracefs", "modules", "usr-src", "pod-resources"}
    # The key is readable by the daemon's own group (fsGroup), not the engines' nor others.
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10002
    # Everything else as the privileged daemon runs it.
    theirs = _container(privileged["DaemonSet/ac-observe-daemon"], "daemon")
    assert [a for a in theirs["args"] if a != "--discover-engines"] == daemon["args"]
    for key in ("image", "ports", "readinessProbe", "livenessProbe"):
        assert daemon[key] == theirs[key], key


def test_the_unprivileged_daemon_asks_no_pod_resources_socket(start_daemon):
    """The manifest's setting as the daemon reads it (an empty variable is no value to
    click): the socket switched off, not the kubelet's default path tried."""
    kubernetes = REPO / "dashboards" / "kubernetes"
    daemon = _container(_documents(kubernetes / "unprivileged" / "daemon.yaml")
                        ["DaemonSet/ac-observe-daemon"], "daemon")
    env = {e["name"]: e["value"] for e in daemon["env"]
           if e["name"] == "AC_OBSERVE_POD_RESOURCES_SOCKET"}
    assert env == {"AC_OBSERVE_POD_RESOURCES_SOCKET": ""}
    running = start_daemon(None, "--collectors", "engine", env=env)
    status = httpx.get(running.url + "/api/v1/status", timeout=30).json()
    assert "pod-resources socket is switched off" in status["attribution"]["reason"], \
        status["attribution"]
