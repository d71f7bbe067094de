"""The gateway against an upstream whose answers are known: a stream paced with distinct
gaps (the gateway's inter-token histogram against the gaps a client saw, gap for gap)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from ac_observe.metrics import INTER_TOKEN_LATENCY
from support.bad_upstream import CONTENT_EVENT, PACED_GAPS_S, BadUpstream
from support.servers import GatewayServer, wait_for
from support.telemetry import read_with_multiprocess_collector

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
            httpx.get(gateway.url + "/", headers={"x-bad": "5xx"}, timeout=2)
            return True
        except httpx.HTTPError:
            return False
    wait_for(answers, 60, "the gateway")
    return gateway


def _client_gaps(port: int) -> list[float]:
    """One paced stream read through the gateway on a bare socket: the gaps between the
    `recv`s that completed successive content events (0 for events completed by the same
    `recv`: the bytes came together)."""
    body = json.dumps(CHAT).encode()
    stamps: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-bad: paced\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
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
    """The upstream paces content events 5, 25 and 80 ms apart; what the gateway recorded
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
    assert recorded["sum"] == pytest.approx(sum(client), rel=0.1, abs=0.03), \
        (recorded["sum"], sum(client))
    bounds = INTER_TOKEN_LATENCY.buckets
    for between in (0.012, 0.045):  # 5 | 25 ms, 25 | 80 ms
        bound = min(b for b in bounds if b >= between)
        seen = sum(1 for gap in client if gap <= bound)
        assert abs(recorded[bound] - seen) <= 2, (bound, recorded[bound], sorted(client))
