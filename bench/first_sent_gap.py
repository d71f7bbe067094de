"""Time to first token three ways at 1, 4 and 16 concurrent streams: as the engine sees
it (first token ready, `model_latency_ns`), as it leaves the server (`first_sent_ns`:
the first content bytes handed to the socket), and as a client sees it, from a bare
asyncio socket client (tests/support/sse_streams.py) and, with --guidellm, guidellm.

The figure the issue (28) aims at: the client's first content chunk minus
`first_sent_ns`, a median under 1 ms and a p95 under 3 ms at each level.

Usage: python bench/first_sent_gap.py [--requests 48] [--levels 1,4,16] [--guidellm]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.servers import EngineServer  # noqa: E402  (test helpers, not shipped)
from support.sse_streams import gaps_ms, run_streams  # noqa: E402


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(results: list[dict]) -> dict:
    gaps = gaps_ms(results)
    ms = {"engine_ttft": [r["model_latency_ns"] / 1e6 for r in results],
          "sent": [r["first_sent_ns"] / 1e6 for r in results],
          "client": [r["client_first_content_s"] * 1e3 for r in results]}
    row = {f"{k}_median_ms": round(statistics.median(v), 2) for k, v in ms.items()}
    row.update(gap_median_ms=round(statistics.median(gaps), 3),
               gap_p95_ms=round(_p(gaps, 0.95), 3), requests=len(results))
    return row


def _guidellm(url: str, streams: int, root: Path) -> float:
    from test_guidellm import run_guidellm, write_byte_tokenizer  # the test's own runner
    tokenizer = write_byte_tokenizer(root / "tokenizer")
    report = run_guidellm(url, tokenizer, root / f"guidellm-{streams}.json", 20, streams, root)
    return round(report["metrics"]["time_to_first_token_ms"]["successful"]["median"], 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48, help="per level")
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--guidellm", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="first-sent-"))
    server = EngineServer(root / "telemetry", "--max-model-len", "1024", "--kv-blocks",
                          "1024").wait_ready()
    rows = {}
    try:
        run_streams(server.url, 4, 3)  # a fresh engine's first requests take colder paths
        for streams in (int(x) for x in args.levels.split(",")):
            per_stream = max(2, args.requests // streams)
            rows[streams] = _row(run_streams(server.url, streams, per_stream))
            if args.guidellm:
                rows[streams]["guidellm_ttft_median_ms"] = _guidellm(server.url, streams, root)
    finally:
        server.stop()
    if args.json:
        print(json.dumps(rows))
    else:
        for streams, row in rows.items():
            print(f"{streams:3d} streams: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
