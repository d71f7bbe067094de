"""The delivery stamp: arrival to the first content bytes handed to the socket, what a
client at 4 concurrent streams sees against it, and its families by value."""
from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest

from support.servers import EngineServer, wait_for
from support.sse_streams import gaps_ms, run_streams
from support.telemetry import family_value, read_with_multiprocess_collector


@pytest.mark.slow
@pytest.mark.bench
def test_four_streams_see_the_first_chunk_within_3_ms_of_the_stamp(tmp_path):
    """A bare asyncio client at 4 streams: its first content chunk minus `first_sent_ns`
    is the way in (send to the parser's first byte) and out (the kernel to the client's
    recv), nothing of the engine's. The aim is a median under 1 ms
    (bench/first_sent_gap.py); 3 ms here for a busy 2-core machine. And the families
    hold exactly what the streams' traces say."""
    engine = EngineServer(tmp_path / "telemetry", "--max-model-len", "1024",
                          "--kv-blocks", "1024").wait_ready()
    try:
        for _ in range(4):  # warm, with answers sent whole: not in the histograms
            httpx.post(engine.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 8,
                "messages": [{"role": "user", "content": "warm"}]})
        started = time.monotonic()
        results = run_streams(engine.url, 4, 10)
        whole = httpx.post(engine.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
        wait_for(lambda: family_value(read_with_multiprocess_collector(engine.telemetry_dir),
                                      "ac_first_token_sent_seconds",
                                      "ac_first_token_sent_seconds_count") == 40,
                 10, "every stream's stamp written")
        families = read_with_multiprocess_collector(engine.telemetry_dir)
        elapsed = time.monotonic() - started
    finally:
        engine.stop()
    gaps = gaps_ms(results)
    assert min(gaps) > -0.05, gaps  # the stamp never later than the client's receipt
    assert statistics.median(gaps) < 3.0, sorted(gaps)
    for r in results:  # ready, then sent, then received
        assert r["first_text_ns"] <= r["first_sent_ns"] <= r["client_first_content_s"] * 1e9
    # An answer sent whole stamps its head (and is not a stream: not in the histograms).
    detail = json.loads(whole.headers["x-ac-trace-detail"])
    assert int(whole.headers["x-ac-first-text-ns"]) < detail["first_sent_ns"]

    sent_sum = family_value(families, "ac_first_token_sent_seconds",
                            "ac_first_token_sent_seconds_sum", stream="throughput")
    lag_sum = family_value(families, "ac_delivery_lag_seconds", "ac_delivery_lag_seconds_sum",
                           stream="throughput")
    assert family_value(families, "ac_delivery_lag_seconds",
                        "ac_delivery_lag_seconds_count") == len(results)
    assert sent_sum == pytest.approx(sum(r["first_sent_ns"] for r in results) / 1e9, rel=1e-9)
    assert lag_sum == pytest.approx(sum(r["first_sent_ns"] - r["first_text_ns"]
                                        for r in results) / 1e9, rel=1e-6, abs=1e-9)
    lag_count = family_value(families, "ac_event_loop_lag_seconds",
                             "ac_event_loop_lag_seconds_count")
    assert lag_count >= elapsed / 0.1 * 0.5, (lag_count, elapsed)  # sampled every 100 ms
    lag_sum_s = family_value(families, "ac_event_loop_lag_seconds",
                             "ac_event_loop_lag_seconds_sum")
    assert 0 <= lag_sum_s / lag_count < 0.05  # a loop that keeps up: ms, not tens of them
