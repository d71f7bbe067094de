"""Latency isolation under load: does the low_latency lane keep its time to first token
while the throughput lane is flooded?

One engine (`ac-observe engine`, the tiny preset, served over HTTP as in production). For
each count of latency-sensitive clients (8, 32, 64 by default), three phases, in this
order:
  unloaded   those clients alone, on the low_latency lane;
  lanes      the same clients on the low_latency lane while --flood clients keep the
             throughput lane full (long generations, re-sent as each ends);
  one lane   the same flood, and the same clients sent without a lane (everything in the
             throughput lane: an engine without lanes).
Each latency client sends --requests streaming OpenAI chat completions one after another
(--tokens new tokens); TTFT is measured at the client, from the request to the first
streamed chunk (the engine sends it with the first token). The aim: the lanes phase's p99
within 2x the unloaded p99 at the same client count; the one-lane phase shows what the
lanes buy. All clients are asyncio tasks of one process (httpx), apart from the engine's.

Usage: python bench/latency_isolation.py [--clients 8,32,64] [--requests 4] [--rounds 3]
       [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ac_observe.metrics import LANE_HEADER, LOW_LATENCY, THROUGHPUT  # noqa: E402
from support.servers import EngineServer  # noqa: E402  (test helper, not shipped)


def _body(i: int, tokens: int) -> dict:
    return {"model": "tiny", "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Question {i}: say something."}]}


async def _ttft(client: httpx.AsyncClient, i: int, tokens: int, lane: str | None) -> float:
    headers = {LANE_HEADER: lane} if lane else {}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=_body(i, tokens),
                             headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - start
    assert first is not None, "no streamed chunk"
    return first


async def _phase(url: str, clients: int, requests: int, tokens: int, lane: str | None,
                 flood: int, flood_tokens: int) -> list[float]:
    limits = httpx.Limits(max_connections=clients + flood + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        stop = asyncio.Event()

        async def flooder(k: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                await _ttft(client, 1_000_000 + k * 1000 + n, flood_tokens, THROUGHPUT)

        async def latency_client(k: int) -> list[float]:
            return [await _ttft(client, k * 100 + r, tokens, lane) for r in range(requests)]

        floods = [asyncio.create_task(flooder(k)) for k in range(flood)]
        if flood:
            await asyncio.sleep(3.0)  # the throughput lane full before the clients start
        results = await asyncio.gather(*(latency_client(k) for k in range(clients)))
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)
    return sorted(t for r in results for t in r)


def _p(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


PHASES = (("unloaded", LOW_LATENCY, False), ("lanes", LOW_LATENCY, True),
          ("one_lane", None, True))


def measure(clients_list: list[int], requests: int, tokens: int, flood: int,
            flood_tokens: int, rounds: int = 1) -> dict:
    """Per client count, the three phases `rounds` times (the order reversed every other
    round, so a host getting busier or quieter weighs on all alike), each phase's TTFTs
    pooled over the rounds before its p50 and p99 are taken."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "telemetry").mkdir()
        engine = EngineServer(Path(tmp) / "telemetry" / "e1", "--engine-name", "e1")
        try:
            engine.wait_ready()
            asyncio.run(_phase(engine.url, 4, 2, tokens, LOW_LATENCY, 0, 0))  # warm-up
            out = {}
            for clients in clients_list:
                pooled: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
                for r in range(rounds):
                    for name, lane, flooded in (PHASES if r % 2 == 0 else PHASES[::-1]):
                        pooled[name] += asyncio.run(_phase(
                            engine.url, clients, requests, tokens, lane,
                            flood if flooded else 0, flood_tokens))
                row = {}
                for name, ttfts in pooled.items():
                    ttfts.sort()
                    row[name] = {"p50_ms": statistics.median(ttfts) * 1e3,
                                 "p99_ms": _p(ttfts, 0.99) * 1e3, "n": len(ttfts)}
                row["lanes_p99_ratio"] = row["lanes"]["p99_ms"] / row["unloaded"]["p99_ms"]
                row["one_lane_p99_ratio"] = (row["one_lane"]["p99_ms"]
                                             / row["unloaded"]["p99_ms"])
                out[str(clients)] = row
        finally:
            engine.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="8,32,64")
    parser.add_argument("--requests", type=int, default=4, help="per latency client")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per latency request")
    parser.add_argument("--flood", type=int, default=32, help="throughput-lane clients")
    parser.add_argument("--flood-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1,
                        help="Times each phase runs per client count (TTFTs pooled).")
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    args = parser.parse_args()
    result = measure([int(c) for c in args.clients.split(",")], args.requests, args.tokens,
                     args.flood, args.flood_tokens, args.rounds)
    print(f"low_latency TTFT (client-side), {args.flood} throughput clients flooding, "
          f"{args.requests} requests per latency client, {args.rounds} round(s) pooled")
    print(f"{'clients':>7} {'unloaded p50/p99 ms':>20} {'lanes p50/p99 ms':>18} "
          f"{'one lane p50/p99 ms':>20} {'lanes/unl. p99':>15} {'one lane/unl.':>14}")
    for clients, row in result.items():
        print(f"{clients:>7} {row['unloaded']['p50_ms']:>9.1f}/{row['unloaded']['p99_ms']:<9.1f}"
              f" {row['lanes']['p50_ms']:>8.1f}/{row['lanes']['p99_ms']:<8.1f}"
              f" {row['one_lane']['p50_ms']:>9.1f}/{row['one_lane']['p99_ms']:<9.1f}"
              f" {row['lanes_p99_ratio']:>14.2f}x {row['one_lane_p99_ratio']:>13.2f}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
