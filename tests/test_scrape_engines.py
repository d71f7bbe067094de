"""vLLM and SGLang servers read into the contract: captured /metrics replayed over real
HTTP with scripted counts, so every figure the daemon answers is known exactly, and the
plausible wrong formulas give other answers."""
from __future__ import annotations

import json
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ac_observe import metrics as m
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from support.engine_replay import EngineReplay
from support.servers import run_cli, wait_for

TTFT = "vllm:time_to_first_token_seconds"


@pytest.fixture
def replays():
    made: list[EngineReplay] = []

    def make(capture: str) -> EngineReplay:
        made.append(EngineReplay(capture))
        return made[-1]

    yield make
    for replay in made:
        replay.close()


def _daemon(tmp_path, endpoints, collectors=(), timeout=1.0) -> Daemon:
    config = DaemonConfig(telemetry_root=tmp_path / "telemetry", collectors=collectors,
                          history=False, engine_endpoints=tuple(endpoints),
                          collector_timeout_seconds=timeout)
    return Daemon(config)


def _one(answer: dict, **labels) -> dict:
    found = [s for s in answer["series"]
             if all(s["labels"].get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, answer["series"])
    return found[0]


def test_a_vllm_v1_replay_answers_ttft_hit_rate_and_running_exactly(tmp_path, replays):
    vllm = replays("vllm_v1_0.10.prom")
    daemon = _daemon(tmp_path, [("vllm-a", vllm.url)])
    try:
        daemon.run_cycle()  # the capture's counts: a base, not an increase
        # Interval 1: 90 first tokens at 50 ms, 1000 prompt tokens looked up, 900 hits.
        vllm.observe(TTFT, 0.05, 90)
        vllm.inc("vllm:prefix_cache_queries", 1000)
        vllm.inc("vllm:prefix_cache_hits", 900)
        vllm.set("vllm:num_requests_running", 3)
        daemon.run_cycle()
        # Interval 2: 10 at 600 ms; 9000 looked up, 900 hits.
        vllm.observe(TTFT, 0.6, 10)
        vllm.inc("vllm:prefix_cache_queries", 9000)
        vllm.inc("vllm:prefix_cache_hits", 900)
        vllm.set("vllm:num_requests_running", 7)
        daemon.run_cycle()

        ttft = _one(daemon.query("inference_latency_ns", 3600, {}), engine="vllm-a")
        # p95: rank 95 of 100 falls in vLLM's own (0.5, 0.75] bucket, 5 of its 10 in:
        # 0.5 + 0.25 * 5/10 = 0.625 s. (The mean of each interval's p95, 0.398 s, and the
        # contract's own edges, (0.504, 0.635], give other figures.)
        assert math.isclose(ttft["p95"], 0.625e9, rel_tol=0.01), ttft
        assert ttft["labels"] == {"engine": "vllm-a", "model": "llama-vllm-single",
                                  "kind": "vllm"}
        assert ttft["samples"] == 100

        hit = _one(daemon.query("kv_cache_hit_rate", 3600, {}), engine="vllm-a")
        # Σ hits / Σ lookups = 1800 / 10000; the mean of the two intervals' ratios is 50 %.
        assert math.isclose(hit["mean"], 18.0, rel_tol=0.01), hit
        assert hit["basis"] == "tokens"

        running = _one(daemon.query("requests_running", 3600, {}), engine="vllm-a")
        assert (running["last"], running["max"]) == (7.0, 7.0)

        assert _one(daemon.query("inference_latency_ns", 3600, {"kind": "vllm"}),
                    engine="vllm-a")["p95"] == ttft["p95"]
        assert daemon.query("inference_latency_ns", 3600, {"kind": "sglang"})["series"] == []

        # The engine restarts: its counters go back. A reset, as Prometheus reads it:
        # the new counts (100 looked up, 50 hits) add to the window's, no negative step.
        vllm.restart()
        vllm.inc("vllm:prefix_cache_queries", 100)
        vllm.inc("vllm:prefix_cache_hits", 50)
        daemon.run_cycle()
        hit = _one(daemon.query("kv_cache_hit_rate", 3600, {}), engine="vllm-a")
        assert math.isclose(hit["mean"], 100 * 1850 / 10100, rel_tol=0.01), hit

        # /metrics: vLLM's own bucket edges under the contract's name, with kind.
        text = daemon.render_metrics().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        edges = {s.labels["le"] for s in families["ac_inference_latency_seconds"].samples
                 if s.name.endswith("_bucket")}
        assert {"0.06", "2560.0", "+Inf"} <= edges and "0.16127" not in edges
        up = [s for s in families["ac_engine_up"].samples]
        assert [(s.labels, s.value) for s in up] == [
            ({"engine": "vllm-a", "model": "llama-vllm-single", "kind": "vllm"}, 1.0)]
    finally:
        daemon.close()


def test_vllm_v0_and_sglang_captures_map_with_their_own_names(tmp_path, replays):
    v0, sglang = replays("vllm_v0_0.6.prom"), replays("sglang_0.4.prom")
    daemon = _daemon(tmp_path, [("v0", v0.url), ("sg", sglang.url)])
    try:
        daemon.run_cycle()
        v0.set("vllm:gpu_cache_usage_perc", 0.25)  # V0's name for KV usage
        sglang.set("sglang:cache_hit_rate", 0.4)
        sglang.observe("sglang:time_to_first_token_seconds", 0.07, 10)  # (0.06, 0.08]
        daemon.run_cycle()
        usage = daemon.query("kv_cache_usage", 3600, {})
        assert math.isclose(_one(usage, engine="v0")["last"], 25.0)
        assert math.isclose(_one(usage, engine="sg")["last"], 28.0)  # token_usage, captured
        # SGLang has no lookup counts: its own gauge answers, and says so.
        hit = _one(daemon.query("kv_cache_hit_rate", 3600, {}), engine="sg")
        assert math.isclose(hit["last"], 40.0) and hit["basis"] == "gauge"
        ttft = _one(daemon.query("inference_latency_ns", 3600, {}), engine="sg")
        assert math.isclose(ttft["p50"], 0.07e9, rel_tol=0.01)  # 0.06 + 0.02 * 5/10
        # V0's hit-rate gauge is -1 with prefix caching off: not a figure, not exported.
        reported = daemon.query("kv_cache_reported_hit_rate", 3600, {})["series"]
        assert [s["labels"]["engine"] for s in reported] == ["sg"]
    finally:
        daemon.close()


def test_an_ac_observe_engine_and_a_vllm_replay_each_answer_on_their_own_edges(
        tmp_path, replays):
    from ac_observe.engine.telemetry import TelemetryWriter
    vllm = replays("vllm_v1_0.10.prom")
    root = tmp_path / "telemetry"
    root.mkdir(mode=0o700)
    writer = TelemetryWriter(root / "bundled", {}, engine="bundled", model="tiny")
    daemon = _daemon(tmp_path, [("vllm-a", vllm.url)], collectors=("engine",))
    try:
        daemon.run_cycle()
        writer.observe_many(m.INFERENCE_LATENCY, [0.3] * 100, stream="throughput")
        vllm.observe(TTFT, 0.3, 100)
        daemon.run_cycle()
        answer = daemon.query("inference_latency_ns", 3600, {})
        ours = _one(answer, engine="bundled")
        theirs = _one(answer, engine="vllm-a")
        # The same 300 ms, each read on its own layout: vLLM's (0.25, 0.5] gives
        # 0.25 + 0.25 * 50/100; ours, three buckets a doubling, lands within its bucket.
        assert math.isclose(theirs["p50"], 0.375e9, rel_tol=0.01), theirs
        low = max(b for b in m.LATENCY_BUCKETS_SECONDS if b < 0.3)
        high = min(b for b in m.LATENCY_BUCKETS_SECONDS if b >= 0.3)
        assert low * 1e9 < ours["p50"] <= high * 1e9, ours
        assert (theirs["min_bucket_le"], theirs["max_bucket_le"]) == (0.5e9, 0.5e9)
        # One family, one HELP and TYPE, both engines' samples under it.
        text = daemon.render_metrics().decode()
        assert text.count("# TYPE ac_inference_latency_seconds histogram") == 1
        families = {f.name: f for f in text_string_to_metric_families(text)}
        engines = {s.labels["engine"] for s in families["ac_inference_latency_seconds"].samples}
        assert engines == {"bundled", "vllm-a"}
    finally:
        daemon.close()
        writer.close()


HOSTILE = [
    ("slow", "timed out after 0.8s"),
    ("html", "not Prometheus text"),
    ("huge", "body over 4194304 bytes"),
    ("wrong_type", "vllm:num_requests_running is a counter, not a gauge"),
    ("http_500", "HTTP 500"),
    ("nan", "is nan"),
]


@pytest.mark.parametrize(("mode", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_endpoint_is_down_with_its_reason_and_harms_no_other(
        tmp_path, replays, mode, reason):
    bad, good = replays("vllm_v1_0.10.prom"), replays("sglang_0.4.prom")
    daemon = _daemon(tmp_path, [("bad", bad.url), ("good", good.url)])
    try:
        daemon.run_cycle()
        if mode == "nan":
            bad.set("vllm:kv_cache_usage_perc", float("nan"))
        else:
            bad.mode = mode
        good.set("sglang:num_running_reqs", 5)
        daemon.run_cycle()
        status = {e["engine"]: e for e in daemon.status()["engines"]}
        assert status["bad"]["alive"] is False and reason in status["bad"]["error"], status
        assert status["good"]["alive"] is True and status["good"]["kind"] == "sglang"
        running = daemon.query("requests_running", 3600, {})
        assert _one(running, engine="good")["last"] == 5.0
        collectors = {c["name"]: c for c in daemon.status()["collectors"]}
        assert collectors["scrape"]["up"] is True  # one bad engine is not a bad collector
        text = daemon.render_metrics().decode()
        assert 'ac_engine_up{engine="bad",model="llama-vllm-single",kind="vllm"} 0.0' in text
        assert 'engine="bad"' not in text.replace('ac_engine_up{engine="bad"', "")
    finally:
        daemon.close()


def test_the_daemon_cli_reads_an_engine_endpoint_and_status_says_why_one_is_down(
        start_daemon, replays):
    vllm = replays("vllm_v1_0.10.prom")
    vllm.set("vllm:num_requests_running", 4)
    daemon = start_daemon(None, "--engine-endpoint", f"vllm-a={vllm.url}",
                          "--engine-endpoint", "http://127.0.0.1:9/metrics",
                          "--collectors", "")

    def answered():
        out = run_cli("--daemon", daemon.url, "--metric", "requests_running", "--labels",
                      "kind=vllm", "--json")
        series = json.loads(out.stdout)["series"] if out.returncode == 0 else []
        return series and series[0]

    series = wait_for(answered, 30, "the vLLM replay's requests_running")
    assert series["last"] == 4.0 and series["labels"]["engine"] == "vllm-a"
    status = run_cli("--daemon", daemon.url, "status")
    assert "vllm-a (vllm)" in status.stdout and "cannot connect" in status.stdout, \
        status.stdout


def test_an_endpoint_outage_is_one_log_line_gone_and_one_back(tmp_path, replays, caplog):
    replay = replays("vllm_v1_0.10.prom")
    daemon = _daemon(tmp_path, [("vllm-a", replay.url)])
    try:
        daemon.run_cycle()
        replay.mode = "http_500"
        with caplog.at_level("INFO", logger="ac_observe.collectors.scrape"):
            for _ in range(4):
                daemon.run_cycle()
            replay.mode = "normal"
            daemon.run_cycle()
            daemon.run_cycle()
        lines = [r.getMessage() for r in caplog.records
                 if r.name.startswith("ac_observe.collectors.scrape")]
        assert len(lines) == 2, lines
        assert "engine endpoint vllm-a is unavailable" in lines[0] and "500" in lines[0]
        assert "engine endpoint vllm-a is back after" in lines[1]
        assert not any(r.exc_info for r in caplog.records)
    finally:
        daemon.close()
