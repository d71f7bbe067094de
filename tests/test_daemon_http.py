"""The daemon's HTTP side under careless and hostile clients, and the CLI's answers when
the daemon cannot give one."""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import time

import httpx
import pytest

from support.servers import AC_OBSERVE, ServerProcess, free_port, run_cli, wait_for


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_300_concurrent_scrapes_and_500_idle_connections(start_daemon):
    daemon = start_daemon(None, "--collectors", "engine")

    async def scrape_all(n: int):
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30, limits=limits) as client:
            return await asyncio.gather(*(client.get("/metrics") for _ in range(n)))

    baseline = _fds(daemon.proc.pid)
    started = time.monotonic()
    responses = asyncio.run(scrape_all(300))
    assert time.monotonic() - started < 10
    assert [r.status_code for r in responses] == [200] * 300
    assert all(b"ac_collector_up" in r.content for r in responses)

    wait_for(lambda: _fds(daemon.proc.pid) <= baseline, 10, "the scrapes' sockets to close")
    idle = []
    try:
        for _ in range(500):  # connected, never sending a byte
            idle.append(socket.create_connection(("127.0.0.1", daemon.port)))
        wait_for(lambda: _fds(daemon.proc.pid) >= baseline + 400, 10, "the daemon to accept")
        started = time.monotonic()
        response = httpx.get(daemon.url + "/metrics", timeout=5)
        assert response.status_code == 200
        assert time.monotonic() - started < 1.0
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: _fds(daemon.proc.pid) <= baseline, 10, "descriptors back to baseline")


@pytest.mark.slow
def test_methods_heads_and_absurd_queries_get_clear_answers(start_daemon):
    daemon = start_daemon(None, "--collectors", "engine")
    post = httpx.post(daemon.url + "/metrics", content=b"")
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    assert "not allowed" in post.json()["error"]
    scrape = httpx.get(daemon.url + "/metrics")  # httpx asks for gzip, as Prometheus does
    assert scrape.headers["content-encoding"] == "gzip" and b"ac_collector_up" in scrape.content
    plain = httpx.get(daemon.url + "/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and b"ac_collector_up" in plain.content
    head = httpx.head(daemon.url + "/metrics")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0
    for window in ("9" * 400 + "s", "0s", "-5m", "soon", "367d"):
        answer = httpx.get(daemon.url + "/api/v1/query",
                           params={"metric": "kv_cache_hit_rate", "window": window})
        assert answer.status_code == 400, window
        assert "duration" in answer.json()["error"]
    for labels in ("strem=low_latency", "stream=", "stream=a,stream=b", "==x"):
        answer = httpx.get(daemon.url + "/api/v1/query",
                           params={"metric": "inference_latency_ns", "labels": labels})
        assert answer.status_code == 400, labels  # never an empty answer, as if no data
        assert "bad label filter" in answer.json()["error"], labels
    for at in ("yesterday", "nan", "inf", "-1", "0", str(time.time() + 3600),
               "2999-01-01T00:00:00"):
        answer = httpx.get(daemon.url + "/api/v1/query",
                           params={"metric": "kv_cache_hit_rate", "window": "60s", "at": at})
        assert answer.status_code == 400, at
        assert "bad time" in answer.json()["error"], at
    past = time.time() - 60
    for at in (repr(time.time() - 1), time.strftime("%Y-%m-%dT%H:%M:%S"),
               time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(past)),
               time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(past))):
        answer = httpx.get(daemon.url + "/api/v1/query",
                           params={"metric": "kv_cache_hit_rate", "window": "60s", "at": at})
        assert answer.status_code == 200, (at, answer.text)
    assert httpx.get(daemon.url + "/nowhere").status_code == 404
    big = httpx.get(daemon.url + "/metrics", headers={"x-junk": "a" * 20000})
    assert big.status_code == 431
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    assert httpx.get(daemon.url + "/healthz").status_code == 200  # still serving


@pytest.mark.slow
def test_bearer_tokens_per_rfc_and_from_file_or_environment(tmp_path, start_daemon):
    token = "s3cret-ünïcode"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    daemon = start_daemon(None, "--collectors", "engine", "--token-file", str(token_file),
                          env={"AC_OBSERVE_TOKEN": ""})
    url = daemon.url + "/api/v1/status"
    raw = token.encode()
    assert httpx.get(url).status_code == 401
    assert httpx.get(url).headers["www-authenticate"].startswith("Bearer")
    for scheme in (b"Bearer", b"bearer", b"BEARER"):
        assert httpx.get(url, headers={"Authorization": scheme + b" " + raw}).status_code == 200
    assert httpx.get(url, headers={"Authorization": b"Bearer " + raw[:-1]}).status_code == 401
    assert httpx.get(url, headers={"Authorization": b"Basic " + raw}).status_code == 401
    assert httpx.get(daemon.url + "/healthz").status_code == 200  # liveness needs no token
    # /metrics: rendered once, then answered from the event loop, and still guarded there.
    metrics = daemon.url + "/metrics"
    for _ in range(3):
        assert httpx.get(metrics, headers={"Authorization": b"Bearer " + raw}).status_code == 200
    assert httpx.get(metrics).status_code == 401
    assert httpx.get(metrics, headers={"Authorization": b"Bearer " + raw[:-1]}).status_code == 401

    # The CLI, through the same token in the environment.
    ok = run_cli("--daemon", daemon.url, "status", "--json",
                 env={**os.environ, "AC_OBSERVE_TOKEN": token})
    assert ok.returncode == 0 and json.loads(ok.stdout)["collectors"]

    # An empty or blank token is refused at start, whatever the bind address.
    for blank in ("", "   "):
        (tmp_path / "blank").write_text(blank)
        refused = run_cli("daemon", "--telemetry-root", str(tmp_path), "--port",
                          str(free_port()), "--token-file", str(tmp_path / "blank"))
        assert refused.returncode == 2 and "blank" in refused.stderr


@pytest.mark.slow
def test_cli_says_in_one_line_what_is_wrong(tmp_path, start_daemon):
    daemon = start_daemon(None, "--collectors", "engine", env={"AC_OBSERVE_TOKEN": "right"})
    env = {k: v for k, v in os.environ.items() if k != "AC_OBSERVE_TOKEN"}
    not_a_daemon = ServerProcess(["engine", "--telemetry-dir", str(tmp_path / "t")], tmp_path)
    not_a_daemon.wait_ready()
    try:
        cases = [
            (["--daemon", daemon.url, "status"], "wants a bearer token"),
            (["--daemon", daemon.url, "--token", "wrong", "status"], "refused the token"),
            (["--daemon", daemon.url, "--list"], None),  # falls back to the built-in list
            (["--daemon", daemon.url.removeprefix("http://"), "--token", "right", "status"],
             None),  # host:port alone is http://host:port
            (["--daemon", daemon.url, "--metric", "kv_cache_hit_rate"], "wants a bearer"),
            (["--daemon", not_a_daemon.url, "status"], "does not answer like an ac-observe"),
            (["--daemon", not_a_daemon.url, "--metric", "kv_cache_hit_rate"],
             "does not answer like an ac-observe"),
            (["--daemon", f"http://127.0.0.1:{free_port()}", "status"], "cannot reach"),
        ]
        for args, expected in cases:
            out = run_cli(*args, env=env)
            text = out.stdout + out.stderr
            assert "Traceback" not in text, (args, text)
            if expected is None:
                assert out.returncode == 0, text
                continue
            # 3: nothing answered; 1: something answered no.
            assert out.returncode == (3 if expected == "cannot reach" else 1), (args, text)
            assert expected in text, (args, text)
            assert len(text.strip().splitlines()) == 1, (args, text)
        for at in ("yesterday", "2999-01-01T00:00:00"):  # read by the CLI, in its own zone
            out = run_cli("--daemon", daemon.url, "--token", "right", "--metric",
                          "kv_cache_hit_rate", "--at", at, env=env)
            assert out.returncode == 2 and out.stderr.startswith("error: --at: bad time"), \
                out.stderr
        clock = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 2))
        out = run_cli("--daemon", daemon.url, "--token", "right", "--metric",
                      "kv_cache_hit_rate", "--at", clock, "--json", env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["window_seconds"] == 60
    finally:
        not_a_daemon.stop()


@pytest.mark.parametrize("host", ["0.0.0.0"])
def test_off_loopback_without_a_token_refuses_to_start(tmp_path, host):
    out = run_cli("daemon", "--host", host, "--telemetry-root", str(tmp_path), "--port",
                  str(free_port()), env={**os.environ, "AC_OBSERVE_TOKEN": ""})
    assert out.returncode == 2 and "token" in out.stderr
    assert AC_OBSERVE  # the installed script ran


def test_clients_that_never_read_are_cut_off_and_connections_stay_bounded():
    from ac_observe.daemon.http_server import HttpServer, Response

    body = b"x" * (4 << 20)
    server = HttpServer(lambda request: Response(200, body, "text/plain"), "127.0.0.1", 0,
                        write_timeout=0.5, max_connections=8, read_timeout=1.0)
    stop = server.start_in_thread()
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    clients = []
    try:
        for _ in range(20):  # pipelined requests, answers never read
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
            clients.append(sock)
        time.sleep(0.3)
        assert server._connections <= 8  # the rest wait in the backlog, unaccepted
        # Cut off after the write timeout (or the read timeout for those still queued):
        # only the test's own 20 client sockets remain open in this process.
        wait_for(lambda: fds() <= before + 20, 15, "the server to drop stuck clients")
        fresh = socket.create_connection(("127.0.0.1", server.port))
        fresh.sendall(b"GET /x HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert fresh.recv(20).startswith(b"HTTP/1.1 200")
        fresh.close()
    finally:
        for sock in clients:
            sock.close()
        stop()


def test_a_rendered_scrape_is_answered_on_the_event_loop_and_nothing_else_is(tmp_path):
    """`inline` answers GET or HEAD of /metrics with the render of the latest cycle only
    (or its gzip, once made); before that, with a query string, or for any other route it
    hands the request to the pool (None), where every check runs."""
    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.http_api import make_handler
    from ac_observe.daemon.http_server import Request
    from ac_observe.daemon.service import Daemon
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, collectors=("engine",)))
    handle = make_handler(daemon, None)
    inline = handle.inline

    def request(path="/metrics", query="", method="GET"):
        return Request(method, path, query, {})
    zipped = Request("GET", "/metrics", "", {"accept-encoding": "deflate, gzip;q=0.9"})
    unstarted = Daemon(DaemonConfig(telemetry_root=tmp_path, collectors=("engine",)))
    # Before the first cycle (the server listens already): an empty body, still gzip.
    empty = make_handler(unstarted, None)(zipped).body
    assert empty[:2] == b"\x1f\x8b" and gzip.decompress(empty) == b""
    unstarted.close()
    daemon.run_cycle()
    assert inline(request()) is None  # not rendered yet: the pool renders it
    body = daemon.render_metrics()
    answer = inline(request())
    assert answer.status == 200 and answer.body == body and b"ac_collector_up" in body
    assert inline(request(method="HEAD")).body == body  # (the server sends the head only)
    for other in (request(query="x=1"), request("/api/v1/status"), request(method="POST")):
        assert inline(other) is None
    # gzip, as Prometheus asks: made by the pool once a snapshot, then answered inline.
    assert inline(zipped) is None
    pooled = handle(zipped)
    assert pooled.headers["Content-Encoding"] == "gzip" and gzip.decompress(pooled.body) == body
    assert inline(zipped).body == pooled.body
    for refusing in ("gzip;q=0, br", "gzip;level=1;q=0", "identity"):
        refused = Request("GET", "/metrics", "", {"accept-encoding": refusing})
        assert "Content-Encoding" not in handle(refused).headers
        assert handle(refused).body == body
    daemon.run_cycle()
    fresh = inline(request())
    assert fresh is not None  # scraped lately: the cycle rendered ahead
    assert fresh.body != body  # the new cycle's (its collector duration moved)
    assert gzip.decompress(inline(zipped).body) == fresh.body  # and compressed ahead
