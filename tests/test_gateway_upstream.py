"""The gateway against an upstream whose answers are known: a stream paced with distinct
gaps (the gateway's inter-token histogram against the gaps a client saw, gap for gap),
and an https upstream with a private CA (trusted through --upstream-ca-file, refused
with a clear 502 and a counted reason under another CA, a bad CA file refused at start)."""
from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import struct
import threading
import time
from functools import partial

import httpx
import pytest

from ac_observe.metrics import INTER_TOKEN_LATENCY
from support.bad_upstream import BURST, CONTENT_EVENT, PACED_GAPS_S, BadUpstream
from support.certs import TestCA
from support.servers import GatewayServer, run_cli, wait_for
from support.telemetry import gateway_failures, read_with_multiprocess_collector

CHAT = {"model": "tiny", "max_tokens": 12, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}
EVENT_END = CONTENT_EVENT[-8:]  # `}}]}\n\n`: ends a content event and nothing else here
ITL = INTER_TOKEN_LATENCY.name


def _started(upstream: str, directory, *args: str) -> GatewayServer:
    gateway = GatewayServer(upstream, directory, *args)

    def answers() -> bool:
        if gateway.proc.poll() is not None:
            raise AssertionError(gateway.log_path.read_text()[-2000:])
        try:
            httpx.get(gateway.url + "/", headers={"x-bad": "5xx"}, timeout=30)
            return True
        except httpx.HTTPError:
            return False
    wait_for(answers, 60, "the gateway")
    return gateway


def _client_gaps(port: int, fault: bytes = b"paced") -> list[float]:
    """One stream (the upstream's `fault`) read through the gateway on a bare socket: the
    gaps between the `recv`s that completed successive content events (0 for events
    completed by the same `recv`: the bytes came together)."""
    body = json.dumps(CHAT).encode()
    stamps: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-bad: %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (fault, len(body), body))
        received = b""
        while b"[DONE]" not in received:
            chunk = sock.recv(65536)
            now = time.perf_counter()
            assert chunk, "the gateway closed the stream early"
            received += chunk
            stamps += [now] * (received.count(EVENT_END) - len(stamps))
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def _itl(directory) -> dict:
    """The gateway's inter-token histogram: {"sum", "count", le: cumulative count}."""
    found: dict = {}
    families = read_with_multiprocess_collector(directory)
    for name, labels, value in families[ITL]["samples"]:
        key = float(labels["le"]) if name.endswith("_bucket") else name.rsplit("_", 1)[1]
        found[key] = found.get(key, 0.0) + value
    return found


def _requests(directory) -> float:
    families = read_with_multiprocess_collector(directory)
    return sum(v for _, _, v in families["ac_requests"]["samples"])


def test_the_gateways_inter_token_histogram_matches_the_clients_gaps(tmp_path):
    """The upstream paces content events 10, 60 and 200 ms apart; what the gateway recorded
    is compared with what the client saw, never with those constants: the same number of
    gaps (none for the first event), the same total (the first and last events' stamps
    aside), and as many gaps on each side of two bucket bounds that fall between the
    paces (a slack of two for a loaded 2-core machine's scheduling)."""
    upstream = BadUpstream()
    (tmp_path / "t").mkdir(mode=0o700)
    gateway = _started(upstream.url, tmp_path / "t" / "g")
    try:
        streams = 3
        client: list[float] = []
        for _ in range(streams):
            client += _client_gaps(gateway.port)
        wait_for(lambda: _requests(gateway.telemetry_dir) == streams, 10, "the streams written")
        recorded = _itl(gateway.telemetry_dir)
    finally:
        gateway.stop()
        upstream.stop()
    assert len(client) == streams * len(PACED_GAPS_S)
    assert recorded["count"] == len(client)
    assert recorded["sum"] == pytest.approx(sum(client), rel=0.1, abs=0.1), \
        (recorded["sum"], sum(client))
    bounds = INTER_TOKEN_LATENCY.buckets
    # Bounds far from the paces: a loaded machine's scheduling moves a stamp by ms, not 20.
    for between in (0.03, 0.12):  # 10 | 60 ms, 60 | 200 ms
        bound = min(b for b in bounds if b >= between)
        seen = sum(1 for gap in client if gap <= bound)
        assert abs(recorded[bound] - seen) <= 2, (bound, recorded[bound], sorted(client))


def test_events_that_arrive_together_count_a_gap_each(tmp_path):
    """BURST events come in one write and leave the gateway in one: the client reads them
    0 apart, and the gateway records as many gaps as the client saw (one a content event
    after the first), the burst's at 0, not one gap for the lot."""
    upstream = BadUpstream()
    (tmp_path / "t").mkdir(mode=0o700)
    gateway = _started(upstream.url, tmp_path / "t" / "g")
    try:
        client = _client_gaps(gateway.port, b"burst")
        wait_for(lambda: _requests(gateway.telemetry_dir) == 1, 10, "the stream written")
        recorded = _itl(gateway.telemetry_dir)
    finally:
        gateway.stop()
        upstream.stop()
    assert len(client) == BURST + 1  # the first event has no gap
    assert recorded["count"] == len(client)
    smallest = INTER_TOKEN_LATENCY.buckets[0]
    # the burst's own gaps: 0 on both sides (the client's within one recv, or nearly)
    assert recorded[smallest] >= BURST - 1
    assert recorded["sum"] == pytest.approx(sum(client), rel=0.2, abs=0.02)


@pytest.fixture(scope="module")
def https_upstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    ca = TestCA(folder / "ca")
    server = ca.server()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(server.cert), str(server.key))
    upstream = BadUpstream(tls=context)
    yield upstream, ca, folder
    upstream.stop()


def test_an_https_upstream_is_reached_through_its_private_ca(https_upstream, tmp_path):
    upstream, ca, _ = https_upstream
    assert upstream.url.startswith("https://")
    (tmp_path / "t").mkdir(mode=0o700)
    gateway = _started(upstream.url, tmp_path / "t" / "g", "--upstream-ca-file", str(ca.path))
    try:
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                            headers={"x-bad": "paced"}, timeout=30)
        assert answer.status_code == 200
        assert answer.content.count(CONTENT_EVENT) == len(PACED_GAPS_S) + 1
        assert answer.content.endswith(b"data: [DONE]\n\n")
        assert gateway_failures(gateway.telemetry_dir)["tls"] == 0
    finally:
        gateway.stop()


def test_an_untrusted_upstream_certificate_is_a_clear_502_counted_as_tls(https_upstream,
                                                                         tmp_path):
    upstream, _, folder = https_upstream
    other = TestCA(folder / "other", name="another CA")
    (tmp_path / "t").mkdir(mode=0o700)
    # The system's CAs do not know the test CA either: both ways the handshake is refused.
    for args in (("--upstream-ca-file", str(other.path)), ()):
        gateway = GatewayServer(upstream.url, tmp_path / "t" / f"g{len(args)}", *args)
        try:
            wait_for(partial(_answers, gateway), 60, "the gateway")
            for path, shape in (("/v1/messages", "type"), ("/v1/chat/completions", "error")):
                refused = httpx.post(gateway.url + path, json=CHAT, timeout=30)
                assert refused.status_code == 502 and shape in refused.json()
                message = json.dumps(refused.json())
                assert "certificate is not trusted" in message, message
                assert "upstream-ca-file" not in message  # the operator's hint: for the log
            assert gateway.proc.poll() is None  # still up
            said = gateway.log_path.read_text()
            assert said.count("--upstream-ca-file names the CAs") == 1, said[-2000:]
            wait_for(partial(_failures, gateway.telemetry_dir, "tls", 3), 10,
                     "three TLS failures")  # the two above and the readiness probe's
        finally:
            gateway.stop()


def _answers(gateway: GatewayServer) -> bool:
    try:
        # Never cut short once taken in: a second probe would be a second failure counted.
        httpx.get(gateway.url + "/", timeout=30)
        return True
    except httpx.HTTPError:
        return False


def test_a_bad_upstream_ca_file_is_refused_at_start(tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n")
    missing = tmp_path / "missing.pem"
    fifo = tmp_path / "ca.fifo"  # OpenSSL would wait on it for ever
    os.mkfifo(fifo)
    (tmp_path / "t").mkdir(mode=0o700)
    for ca_file, env in ((garbage, {}), (missing, {}), (fifo, {}), (tmp_path, {}), (None, {
            "AC_OBSERVE_UPSTREAM_CA_FILE": str(garbage)})):
        args = ["gateway", "--upstream", "https://127.0.0.1:9", "--telemetry-dir",
                str(tmp_path / "t" / "g")]
        if ca_file is not None:
            args += ["--upstream-ca-file", str(ca_file)]
        out = run_cli(*args, env={**os.environ, **env}, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --upstream-ca-file "), lines
        assert str(ca_file or garbage) in lines[0]
    # ... and on a plain http upstream it is a mistake said as such.
    out = run_cli("gateway", "--upstream", "http://127.0.0.1:9", "--upstream-ca-file",
                  str(garbage), "--telemetry-dir", str(tmp_path / "t" / "g"))
    assert out.returncode == 2 and "is not https" in out.stderr


@pytest.fixture
def hanging_port():
    """A port whose connects hang: a listener with a backlog of 0 that one held connection
    fills and nobody accepts from (Linux then drops the SYNs that follow)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = socket.create_connection(("127.0.0.1", port), timeout=5)
    probe = socket.socket()
    probe.settimeout(0.3)
    with pytest.raises(TimeoutError):  # else this kernel queues more: the test would lie
        probe.connect(("127.0.0.1", port))
    probe.close()
    yield port
    held.close()
    listener.close()


def test_a_connect_that_hangs_is_a_502_counted_as_connect_timeout(hanging_port, tmp_path):
    (tmp_path / "t").mkdir(mode=0o700)
    gateway = GatewayServer(f"http://127.0.0.1:{hanging_port}", tmp_path / "t" / "g",
                            "--connect-timeout", "0.5")
    try:
        wait_for(partial(_answers, gateway), 60, "the gateway")
        started = time.monotonic()
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30)
        took = time.monotonic() - started
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["message"] == "upstream unreachable: connect timed out"
        assert 0.45 <= took < 5, took  # the option's 0.5 s, not the default 5 s
        wait_for(partial(_failures, gateway.telemetry_dir, "connect_timeout", 2), 10,
                 "two connect timeouts")  # this one and the readiness probe's
        assert gateway.proc.poll() is None
    finally:
        gateway.stop()


def _resetting_server() -> socket.socket:
    """Takes connections, reads what comes (a TLS hello) and resets them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def run() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.settimeout(5)
            try:
                conn.recv(4096)
            except OSError:
                pass
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
    threading.Thread(target=run, daemon=True).start()
    return listener


def test_a_handshake_cut_off_by_the_upstream_is_counted_as_tls(tmp_path):
    listener = _resetting_server()
    port = listener.getsockname()[1]
    (tmp_path / "t").mkdir(mode=0o700)
    # https: the reset comes mid-handshake (tls); http: the request was sent and no
    # answer came (bad_response), as before this upstream ever spoke TLS.
    for scheme, reason, message in (
            ("https", "tls", "upstream refused: the TLS handshake failed"),
            ("http", "bad_response", "upstream answered with no valid HTTP response: "
                                     "the upstream closed the connection")):
        gateway = GatewayServer(f"{scheme}://127.0.0.1:{port}", tmp_path / "t" / scheme)
        try:
            wait_for(partial(_answers, gateway), 60, "the gateway")
            answer = httpx.post(gateway.url + "/v1/messages", json=CHAT, timeout=30)
            assert answer.status_code == 502 and answer.json()["type"] == "error"
            assert answer.json()["error"]["message"] == message
            said = gateway.log_path.read_text()
            assert said.count("during the TLS handshake") == (scheme == "https"), said[-2000:]
            wait_for(partial(_failures, gateway.telemetry_dir, reason, 2), 10,
                     f"two {reason} failures")
            assert gateway.proc.poll() is None
        finally:
            gateway.stop()
    listener.close()


def _failures(directory, reason: str, count: int) -> bool:
    """`count` failures for `reason`, and none for any other."""
    found = gateway_failures(directory)
    return found[reason] == count and sum(found.values()) == count


def test_a_sigterm_lets_a_stream_end_and_a_second_one_ends_it_now(tmp_path):
    """The first SIGTERM: no new connections, the stream in flight relayed whole, the
    process gone with status 0. A second one cuts a silent upstream's wait short at once
    (not after the 5 s grace)."""
    upstream = BadUpstream()
    try:
        for fault in ("paced", "silent"):
            gateway = _started(upstream.url, tmp_path / fault)
            got: dict = {}

            def ask(url: str = gateway.url, fault: str = fault, got: dict = got) -> None:
                try:
                    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT,
                                      headers={"x-bad": fault}, timeout=30) as answer:
                        got["body"] = b"".join(answer.iter_bytes())
                except httpx.HTTPError as exc:
                    got["error"] = exc
            client = threading.Thread(target=ask)
            seen = len(upstream.faults)
            client.start()
            wait_for(lambda seen=seen: len(upstream.faults) > seen, 10, "the request upstream")
            gateway.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            if fault == "silent":
                time.sleep(0.2)
                gateway.proc.send_signal(signal.SIGTERM)
            assert gateway.proc.wait(10) == 0
            client.join(10)
            took = time.monotonic() - signalled
            if fault == "paced":  # 1.1 s of events after the signal, every one relayed
                assert got["body"].count(EVENT_END) == len(PACED_GAPS_S) + 1
                assert got["body"].endswith(b"data: [DONE]\n\n")
            else:  # the 5 s grace cut short
                assert "error" in got and took < 4.0, (got, took)
    finally:
        upstream.stop()
