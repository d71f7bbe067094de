"""TLS and basic auth on the daemon's port, from exporter-toolkit's web-config file
(`--web-config-file`): a real Prometheus scrapes over TLS and mutual TLS, refusals are
refused and counted, a bad file is refused at start naming the field, and a rotated
certificate is served without a restart. Certificates are made by a test CA
(tests/support/certs.py)."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import textwrap
from pathlib import Path

import bcrypt
import httpx
import pytest
import yaml

from support.certs import TestCA, served_serial
from support.servers import free_port, run_cli, wait_for
from support.stack import _Process

TOKEN = "tls-test-token"


def _web_config(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path


def _env() -> dict[str, str]:
    """This environment less any AC_OBSERVE_* a developer has set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AC_OBSERVE_")}


def _refused(daemon) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {daemon.token}"} if daemon.token else None
    return {dict(labels)["reason"]: value for (name, labels), value in
            daemon.metrics(headers=headers).items() if name == "ac_http_refused_total"}


def _start(start_daemon, tmp_path, web: Path, ca: TestCA, client=None, token=True):
    return start_daemon(None, "--collectors", "engine", "--interval", "0.2s",
                        "--state-dir", str(tmp_path / "state"), "--web-config-file", str(web),
                        env={**_env(), **({"AC_OBSERVE_TOKEN": TOKEN} if token else {})},
                        verify=ca.client_context(client))


def _handshake(port: int, context: ssl.SSLContext) -> bytes:
    """A GET /healthz over TLS with `context`; the answer's first bytes, or raises."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = tls.recv(100)
    if not answer:  # (TLS 1.3: the server refuses the client's certificate after the
        raise ConnectionResetError("closed without an answer")  # client's handshake)
    return answer


def test_refusals_are_refused_and_counted(start_daemon, tmp_path):
    ca, stranger = TestCA(tmp_path / "ca"), TestCA(tmp_path / "other", "not trusted")
    ca.server()
    prometheus, intruder = ca.client("prometheus", dns=("prometheus",)), ca.client("intruder")
    forged = stranger.client("prometheus", dns=("prometheus",))
    hashed = bcrypt.hashpw(b"right password", bcrypt.gensalt(4)).decode()
    web = _web_config(tmp_path / "ca" / "web.yml", tls_server_config={
        "cert_file": "server.crt", "key_file": "server.key", "client_ca_file": "ca.crt",
        "client_auth_type": "RequireAndVerifyClientCert",
        "client_allowed_sans": ["prometheus"]}, basic_auth_users={"scraper": hashed},
        http_server_config={"headers": {"X-Content-Type-Options": "nosniff"}})
    daemon = _start(start_daemon, tmp_path, web, ca, prometheus)
    assert _refused(daemon) == dict.fromkeys(
        ["tls_handshake", "plain_http_on_tls", "client_cert_name", "missing_credentials",
         "bad_credentials"], 0)

    # A certificate from a CA the daemon does not trust, and none at all: no handshake.
    for context in (ca.client_context(forged), ca.client_context(None)):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _handshake(daemon.port, context)
    # Signed by the CA, but its names are not in client_allowed_sans: cut off.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _handshake(daemon.port, ca.client_context(intruder))
    assert _handshake(daemon.port, ca.client_context(prometheus)).startswith(b"HTTP/1.1 200")

    # Plain HTTP on the TLS port: Go's answer, then the connection closes.
    answer = httpx.get(daemon.url.replace("https://", "http://") + "/metrics", timeout=10)
    assert answer.status_code == 400
    assert answer.text == "Client sent an HTTP request to an HTTPS server.\n"

    # Basic auth beside the bearer token: either admits; a wrong password does not.
    url = daemon.url + "/api/v1/status"
    assert httpx.get(url, verify=daemon.verify, auth=("scraper", "right password"),
                     timeout=10).status_code == 200
    refused = httpx.get(url, verify=daemon.verify, auth=("scraper", "wrong"), timeout=10)
    assert refused.status_code == 401 and 'Basic realm="ac-observe"' in \
        refused.headers["www-authenticate"]
    assert refused.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(url, verify=daemon.verify, auth=("nobody", "right password"),
                     timeout=10).status_code == 401
    assert httpx.get(url, verify=daemon.verify, timeout=10).status_code == 401
    scrape = httpx.get(daemon.url + "/metrics", verify=daemon.verify, timeout=10,
                       auth=("scraper", "right password"))
    assert scrape.status_code == 200 and "ac_http_refused_total" in scrape.text

    expected = {"tls_handshake": 2, "plain_http_on_tls": 1, "client_cert_name": 1,
                "missing_credentials": 1, "bad_credentials": 2}
    try:
        wait_for(lambda: _refused(daemon) == expected, 15, "the refusals counted")
    except AssertionError:
        raise AssertionError(f"counted {_refused(daemon)}, not {expected}") from None
    assert daemon.proc.poll() is None
    log = daemon.log_path.read_text()
    assert "Traceback" not in log and "right password" not in log and hashed not in log


BAD_FILES = [
    ({"tls_server_config": {"cert_fil": "x"}}, "tls_server_config.cert_fil: unknown field"),
    ({"tls_server_confg": {}}, "tls_server_confg: unknown field"),
    ({"tls_server_config": {"cert_file": "server.crt"}},
     "tls_server_config.key_file: missing"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}},
     "tls_server_config.cipher_suites: unknown or unsupported cipher suite "
     "'TLS_RSA_WITH_RC4_128_SHA'"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequestClientCert"}},
     "tls_server_config.client_auth_type: RequestClientCert is not supported"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequireAndVerifyClientCert"}},
     "tls_server_config.client_ca_file: missing"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "min_version": "TLS14"}},
     "tls_server_config.min_version: 'TLS14' is not one of"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "ca.crt"}},
     "tls_server_config.cert_file: cannot load the certificate (server.crt) with its key "
     "(ca.crt)"),
    ({"basic_auth_users": {"scraper": "plain-text"}}, "basic_auth_users: 'scraper': not a "
                                                      "bcrypt hash"),
    # the form of one (prefix, length) with a cost that is no number
    ({"basic_auth_users": {"scraper": "$2y$xx$" + "a" * 53}},
     "basic_auth_users: 'scraper': not a bcrypt hash"),
    ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
     "http_server_config.headers.X-Frame-Options: 'allow' is not one of"),
]


@pytest.mark.parametrize("document,message", BAD_FILES,
                         ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in
                              enumerate(BAD_FILES)])
def test_a_bad_web_config_is_refused_at_start_naming_the_field(tmp_path, document, message):
    ca = TestCA(tmp_path)
    ca.server()
    web = _web_config(tmp_path / "web.yml", **document)
    result = run_cli("daemon", "--collectors", "engine", "--web-config-file", str(web),
                     "--state-dir", str(tmp_path / "state"), "--port", str(free_port()),
                     "--telemetry-root", str(tmp_path / "telemetry"))
    assert result.returncode == 2, result.stderr
    assert f"error: {web}: {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_off_loopback_the_web_config_must_guard_the_daemon(tmp_path):
    ca = TestCA(tmp_path)
    ca.server()
    web = _web_config(tmp_path / "web.yml", tls_server_config={
        "cert_file": "server.crt", "key_file": "server.key"})
    result = run_cli("daemon", "--host", "0.0.0.0", "--collectors", "engine",
                     "--web-config-file", str(web), "--port", str(free_port()),
                     "--state-dir", str(tmp_path / "state"), env=_env())
    assert result.returncode == 2
    assert "basic_auth_users or client_auth_type RequireAndVerifyClientCert must guard it" \
        in result.stderr


def test_a_rotated_certificate_is_served_without_a_restart(start_daemon, tmp_path):
    ca = TestCA(tmp_path / "ca")
    first = ca.server()
    web = _web_config(tmp_path / "ca" / "web.yml", tls_server_config={
        "cert_file": "server.crt", "key_file": "server.key"})
    daemon = _start(start_daemon, tmp_path, web, ca)
    assert served_serial("127.0.0.1", daemon.port, ca) == first.serial

    second = ca.server()  # the same files, rewritten
    wait_for(lambda: served_serial("127.0.0.1", daemon.port, ca) == second.serial, 20,
             "the rotated certificate served")

    # A broken key keeps the certificate in force, says why, and a reload fails loudly.
    key = second.key.read_bytes()
    (tmp_path / "ca" / "server.key").write_text("not a key\n")

    def logged() -> bool:  # (files are looked at when a connection opens)
        assert served_serial("127.0.0.1", daemon.port, ca) == second.serial
        return "does not load, the previous settings stay" in daemon.log_path.read_text()
    wait_for(logged, 20, "the failed read logged")
    answer = httpx.post(daemon.url + "/-/reload", verify=daemon.verify, timeout=10)
    assert answer.status_code == 400 and "tls_server_config.cert_file" in answer.text
    (tmp_path / "ca" / "server.key").write_bytes(key)  # the key mended: SIGHUP takes it
    reloads = daemon.log_path.read_text().count("configuration reloaded")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: daemon.log_path.read_text().count("configuration reloaded") > reloads,
             20, "SIGHUP's reload")
    assert served_serial("127.0.0.1", daemon.port, ca) == second.serial

    third = ca.server()
    answer = httpx.post(daemon.url + "/-/reload", verify=daemon.verify, timeout=10)
    assert answer.status_code == 200 and answer.json()["web_config"] is True
    assert served_serial("127.0.0.1", daemon.port, ca) == third.serial
    assert daemon.proc.poll() is None


PROMETHEUS_JOBS = """\
global: {scrape_interval: 2s, scrape_timeout: 2s}
scrape_configs:
  - job_name: tls
    scheme: https
    tls_config: {ca_file: CA}
    authorization: {credentials: TOKEN}
    static_configs: [{targets: ["127.0.0.1:TLS_PORT"]}]
  - job_name: mtls
    scheme: https
    tls_config: {ca_file: CA, cert_file: CLIENT.crt, key_file: CLIENT.key}
    static_configs: [{targets: ["127.0.0.1:MTLS_PORT"]}]
  - job_name: forged
    scheme: https
    tls_config: {ca_file: CA, cert_file: FORGED.crt, key_file: FORGED.key}
    static_configs: [{targets: ["localhost:MTLS_PORT"]}]
"""


@pytest.mark.stack
def test_prometheus_scrapes_over_tls_and_mutual_tls(start_daemon, tmp_path):
    ca, stranger = TestCA(tmp_path / "ca"), TestCA(tmp_path / "other", "not trusted")
    ca.server()
    client = ca.client("prometheus")
    forged = stranger.client("prometheus")
    tls = _start(start_daemon, tmp_path / "a", _web_config(
        tmp_path / "ca" / "tls.yml", tls_server_config={
            "cert_file": "server.crt", "key_file": "server.key", "min_version": "TLS12",
            "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]}), ca)
    mtls = _start(start_daemon, tmp_path / "b", _web_config(
        tmp_path / "ca" / "mtls.yml", tls_server_config={
            "cert_file": "server.crt", "key_file": "server.key", "client_ca_file": "ca.crt",
            "client_auth_type": "RequireAndVerifyClientCert"}), ca, client, token=False)
    config = (PROMETHEUS_JOBS.replace("CLIENT", str(client.cert.with_suffix("")))
              .replace("FORGED", str(forged.cert.with_suffix("")))
              .replace("CA", str(ca.path)).replace("TOKEN", TOKEN)
              .replace("MTLS_PORT", str(mtls.port)).replace("TLS_PORT", str(tls.port)))
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    prometheus = _Process(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                           f"--storage.tsdb.path={tmp_path / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}"],
                          tmp_path / "prometheus.log")
    try:
        prometheus.wait_ready(f"http://127.0.0.1:{port}/-/ready")

        def targets() -> dict[str, dict]:
            answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=10).json()
            return {t["labels"]["job"]: t for t in answer["data"]["activeTargets"]}

        def settled() -> bool:
            seen = targets()
            return seen.get("tls", {}).get("health") == "up" and \
                seen.get("mtls", {}).get("health") == "up" and \
                seen.get("forged", {}).get("health") == "down"
        try:
            wait_for(settled, 60, "Prometheus' TLS and mutual-TLS scrapes up, the forged "
                                  "one down")
        except AssertionError:
            raise AssertionError({job: (t["health"], t["lastError"])
                                  for job, t in targets().items()}) from None

        def query(expr: str) -> list:
            answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=10,
                               params={"query": expr}).json()
            return answer["data"]["result"]
        wait_for(lambda: len(query('ac_build_info{job=~"tls|mtls"}')) == 2, 30,
                 "the daemons' series in Prometheus")
        assert targets()["forged"]["lastError"]  # (Go's words: "EOF", "bad certificate")
        wait_for(lambda: query('ac_http_refused_total{job="mtls",reason="tls_handshake"}'
                               ' > 0'), 30, "the forged scrapes counted, seen by Prometheus")
    finally:
        prometheus.stop()


def test_the_cli_reaches_a_tls_daemon_with_its_ca_and_client_certificate(
        start_daemon, tmp_path):
    ca = TestCA(tmp_path / "ca")
    ca.server()
    client = ca.client("operator")
    web = _web_config(tmp_path / "ca" / "web.yml", tls_server_config={
        "cert_file": "server.crt", "key_file": "server.key", "client_ca_file": "ca.crt",
        "client_auth_type": "RequireAndVerifyClientCert"})
    daemon = _start(start_daemon, tmp_path, web, ca, client)
    options = ["--daemon", daemon.url, "--token", TOKEN]
    ok = run_cli(*options, "--cacert", str(ca.path), "--cert", str(client.cert),
                 "--key", str(client.key), "status")
    assert ok.returncode == 0, ok.stderr
    assert "engine" in ok.stdout
    by_env = run_cli("status", env={**_env(), "AC_OBSERVE_URL": daemon.url,
                                    "AC_OBSERVE_TOKEN": TOKEN,
                                    "AC_OBSERVE_CACERT": str(ca.path),
                                    "AC_OBSERVE_CERT": str(client.cert),
                                    "AC_OBSERVE_KEY": str(client.key)})
    assert by_env.returncode == 0, by_env.stderr
    # Without the CA: the daemon's certificate is not trusted, said in one line.
    untrusted = run_cli(*options, "status")
    assert untrusted.returncode == 3
    assert "--cacert" in untrusted.stderr and "Traceback" not in untrusted.stderr
    # The CA but no client certificate: the daemon refuses the handshake.
    no_cert = run_cli(*options, "--cacert", str(ca.path), "status")
    assert no_cert.returncode == 3 and "--cert" in no_cert.stderr
    missing = run_cli(*options, "--cacert", str(tmp_path / "nope.crt"), "status")
    assert missing.returncode == 2 and "nope.crt" in missing.stderr


def test_the_web_config_parser_takes_exporter_toolkits_sample(tmp_path):
    from ac_observe.daemon.web_config import parse_web_config
    sample = yaml.safe_load(textwrap.dedent("""\
        tls_server_config:
          cert_file: server.crt
          key_file: server.key
          client_auth_type: VerifyClientCertIfGiven
          client_ca_file: ca.crt
          min_version: TLS12
          max_version: TLS13
          cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, TLS_AES_128_GCM_SHA256]
          prefer_server_cipher_suites: true
          curve_preferences: [CurveP256]
        http_server_config:
          http2: true
          headers: {X-Frame-Options: deny, Strict-Transport-Security: max-age=31536000}
        basic_auth_users:
          alice: $2y$10$mDwo.lAisC94iLAyP81MCesa29IzH37oigHC/42V2pdJlUprsJPze
        """))
    config = parse_web_config(sample, "web.yml")
    assert config.tls and config.headers()["X-Frame-Options"] == "deny"
    assert not config.authenticates or config.basic_auth_users
    assert "mDwo" not in repr(config)  # hashes are secrets: never in a repr or a log


def test_the_kubernetes_manifests_serve_tls():
    """The DaemonSet's web-config file loads in the daemon's own parser, names the files
    the Secret is mounted as, and the ServiceMonitor scrapes over HTTPS with its CA."""
    from ac_observe.daemon.web_config import parse_web_config
    folder = Path(__file__).resolve().parents[1] / "dashboards" / "kubernetes"
    docs = {(d["kind"], d["metadata"]["name"]): d for path in folder.glob("*.yaml")
            for d in yaml.safe_load_all(path.read_text())}
    web_text = docs["ConfigMap", "ac-observe-web-config"]["data"]["web.yml"]
    web = parse_web_config(yaml.safe_load(web_text), "web.yml").tls_server_config
    assert web is not None
    pod = docs["DaemonSet", "ac-observe-daemon"]["spec"]["template"]["spec"]
    (daemon,) = [c for c in pod["containers"] if c["name"] == "daemon"]
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (arg,) = [a for a in daemon["args"] if a.startswith("--web-config-file=")]
    assert Path(arg.split("=", 1)[1]).parent == Path(mounts["web-config"])
    assert volumes["web-config"]["configMap"]["name"] == "ac-observe-web-config"
    assert volumes["tls"]["secret"]["secretName"] == "ac-observe-tls"
    for name in (web.cert_file, web.key_file):
        assert name is not None and Path(name).parent == Path(mounts["tls"])
    assert daemon["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    endpoint = docs["ServiceMonitor", "ac-observe-daemon"]["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "ac-observe-tls", "key": "ca.crt"}
    service = docs["Service", "ac-observe-daemon"]["metadata"]
    assert endpoint["tlsConfig"]["serverName"] == \
        f"{service['name']}.{service['namespace']}.svc"


def test_bcrypt_never_runs_on_the_event_loop_and_a_verified_password_is_remembered():
    """The inline /metrics path asks with may_hash=False: an unverified password is sent
    to the handlers' pool (NEEDS_HASH); once verified there, the event loop admits it."""
    import base64

    from ac_observe.daemon.credentials import BasicUsers, Credentials, Verdict
    users = BasicUsers({"scraper": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()})
    credentials = Credentials("a-token")

    def basic(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    good, bad = basic("scraper", "pw"), basic("scraper", "nope")
    assert credentials.verdict(good, users, may_hash=False) is Verdict.NEEDS_HASH
    assert credentials.verdict(good, users) is Verdict.ADMIT
    assert credentials.verdict(good, users, may_hash=False) is Verdict.ADMIT
    assert credentials.verdict(bad, users, may_hash=False) is Verdict.NEEDS_HASH
    assert credentials.verdict(bad, users) is Verdict.BAD
    # a failure is never remembered: wrong guesses cannot push out the scrapers' logins
    assert credentials.verdict(bad, users, may_hash=False) is Verdict.NEEDS_HASH
    assert credentials.verdict(basic("other", "pw"), users) is Verdict.BAD
    assert credentials.verdict("Basic !!not-base64", users) is Verdict.BAD
    assert credentials.verdict(basic("scraper", "x" * 100), users) is Verdict.BAD  # > 72 B
    assert credentials.verdict("Bearer a-token", users, may_hash=False) is Verdict.ADMIT
    assert credentials.verdict("Bearer wrong", users) is Verdict.BAD
    assert credentials.verdict(None, users) is Verdict.MISSING
    assert Credentials(None).verdict(None, None) is Verdict.ADMIT
