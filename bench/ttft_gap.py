"""What time to first token leaves out of a client's wait: the client's time to the first
streamed event minus the engine's own TTFT (its `x-ac-model-latency-ns` header, from the
request's first byte to the first token), for sequential requests on one connection.

Two clients time the same engine, turn about:
  raw    a bare socket (tests/support/rawhttp.py): the clock stops at the recv that
         brings the first event, so the figure is the server's own way in and out;
  httpx  httpx's streaming API, as a Python client meets it: its parsing adds its own.
The issue's bar (issue 16): the raw median under 1 ms, never negative.

Usage: python bench/ttft_gap.py [--requests 60] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.rawhttp import RawStreamClient  # noqa: E402  (test helpers, not shipped)
from support.servers import EngineServer  # noqa: E402


def _body(i: int) -> dict:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"<q>{i}</q> " * (1 + i % 7)}]}


def _httpx_gap(client: httpx.Client, url: str, i: int) -> float:
    started = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/messages", json=_body(i)) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("event: "):
                first = time.perf_counter()
        ttft = int(response.headers["x-ac-model-latency-ns"]) / 1e9
    return first - started - ttft


def _summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {"median_ms": round(statistics.median(ordered) * 1e3, 3),
            "min_ms": round(ordered[0] * 1e3, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3),
            "requests": len(ordered)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ttft-gap-"))
    server = EngineServer(root / "telemetry", "--max-model-len", "1024", "--kv-blocks",
                          "512").wait_ready()
    raw, via_httpx = [], []
    try:
        with RawStreamClient(server.url) as sock, httpx.Client(timeout=60) as client:
            for i in range(10):  # a fresh engine's first requests take its colder paths
                sock.post_stream("/v1/messages", _body(i))
                _httpx_gap(client, server.url, i)
            for i in range(args.requests):
                seconds, _, headers, _ = sock.post_stream("/v1/messages", _body(i))
                raw.append(seconds - int(headers["x-ac-model-latency-ns"]) / 1e9)
                via_httpx.append(_httpx_gap(client, server.url, i))
    finally:
        server.stop()
    result = {"raw": _summary(raw), "httpx": _summary(via_httpx)}
    if args.json:
        print(json.dumps(result))
    else:
        for name, figures in result.items():
            print(f"{name:6s} client - engine TTFT: median {figures['median_ms']} ms, "
                  f"min {figures['min_ms']} ms, p90 {figures['p90_ms']} ms "
                  f"({figures['requests']} requests)")
    return 0 if min(raw) >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
