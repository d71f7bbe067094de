"""vLLM and SGLang servers read into the contract: captured /metrics replayed over real
HTTP with scripted counts, so every figure the daemon answers is known exactly, and the
plausible wrong formulas give other answers."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ac_observe import metrics as m
from ac_observe.daemon.alerting.state import FIRING
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.friendly import FRIENDLY
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


NODE = "gpu-node-1"


def _daemon(tmp_path, endpoints, collectors=(), timeout=1.0) -> Daemon:
    config = DaemonConfig(telemetry_root=tmp_path / "telemetry", collectors=collectors,
                          history=False, engine_endpoints=tuple(endpoints),
                          collector_timeout_seconds=timeout, node_name=NODE)
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
        assert ttft["labels"] == {"node": NODE, "engine": "vllm-a",
                                  "model": "llama-vllm-single", "kind": "vllm"}
        assert ttft["samples"] == 100

        hit = _one(daemon.query("kv_cache_hit_rate", 3600, {}), engine="vllm-a")
        # Σ hits / Σ lookups = 1800 / 10000; the mean of the two intervals' ratios is 50 %.
        assert math.isclose(hit["mean"], 18.0, rel_tol=0.01), hit
        assert hit["basis"] == "tokens"

        running = _one(daemon.query("requests_running", 3600, {}), engine="vllm-a")
        assert (running["last"], running["max"]) == (7.0, 7.0)

        # The table says what the hit rate is counted in; a figure vLLM never exports is
        # said to be so, not an empty table or a zero.
        from ac_observe.daemon.cli.render import metric_table
        table = metric_table(daemon.query("kv_cache_hit_rate", 3600, {}), 160).plain
        header = next(line for line in table.splitlines() if "mean" in line)
        assert header.split()[-2:] == ["basis", "trend"] and " tokens " in table, table
        assert "not_exported" not in daemon.query("kv_cache_hit_rate", 3600, {})
        for name in ("cuda_stream_utilization", "skeleton_complexity", "kv_cache_miss_reasons",
                     "batch_sequences"):
            answer = daemon.query(name, 3600, {})
            assert answer["series"] == [] and answer["not_exported"] == [
                {"engine": "vllm-a", "kind": "vllm", "reason": "not exported by vLLM"}], name
            table = metric_table(answer, 160).plain
            assert "vllm-a (vllm): not exported by vLLM" in table, table
            assert "no data" not in table

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
            ({"node": NODE, "engine": "vllm-a", "model": "llama-vllm-single", "kind": "vllm"},
             1.0)]
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
        # Every engine series of every kind carries kind: the bundled engine's too.
        assert ours["labels"] == {"node": NODE, "engine": "bundled", "model": "tiny",
                                  "stream": "throughput", "kind": "ac-observe"}
        kinds = {(f.name, s.labels["engine"], s.labels.get("kind")) for f in families.values()
                 for s in f.samples if "engine" in s.labels}
        assert {kind for _, _, kind in kinds} == {"ac-observe", "vllm"}, kinds
        assert ("ac_engine_up", "bundled", "ac-observe") in kinds
    finally:
        daemon.close()
        writer.close()


HOSTILE = [
    ("slow", "timed out after 0.8s"),
    ("drip_head", "timed out after 0.8s"),
    ("html", "not Prometheus text"),
    ("huge", "body over 4194304 bytes"),
    ("wrong_type", "vllm:num_requests_running is a counter, not a gauge"),
    ("http_500", "HTTP 500"),
    ("nan", "is nan"),
]


def _documented_reasons() -> list[re.Pattern]:
    """The reasons docs/daemon.md's table says `status` shows, as patterns: `…` for any
    text, a number for any number."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "daemon.md").read_text()
    table = text.split("| `status` says | what the endpoint did |", 1)[1].split("\n\n", 1)[0]
    patterns = []
    for row in table.splitlines()[2:]:
        for span in re.findall(r"`([^`]+)`", row.split("|")[1]):
            pattern = re.escape(span).replace("…", ".*")
            patterns.append(re.compile(re.sub(r"\d+(?:\\\.\d+)?", r"[\\d.]+", pattern)))
    return patterns


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
        # The words status shows are the ones the docs list.
        assert any(p.fullmatch(status["bad"]["error"]) for p in _documented_reasons()), \
            status["bad"]["error"]
        assert status["good"]["alive"] is True and status["good"]["kind"] == "sglang"
        running = daemon.query("requests_running", 3600, {})
        assert _one(running, engine="good")["last"] == 5.0
        collectors = {c["name"]: c for c in daemon.status()["collectors"]}
        assert collectors["scrape"]["up"] is True  # one bad engine is not a bad collector
        text = daemon.render_metrics().decode()
        assert (f'ac_engine_up{{node="{NODE}",engine="bad",model="llama-vllm-single",'
                'kind="vllm"} 0.0') in text
        assert 'engine="bad"' not in text.replace(f'ac_engine_up{{node="{NODE}",engine="bad"',
                                                  "")
    finally:
        daemon.close()


def test_a_body_that_drips_in_is_cut_off_at_the_deadline(replays):
    from ac_observe.collectors.scrape.fetch import ScrapeFailed, fetch_text
    replay = replays("vllm_v1_0.10.prom")
    replay.mode = "drip_body"  # a byte every 0.1 s: no single read ever times out
    started = time.monotonic()
    with pytest.raises(ScrapeFailed, match="timed out after 0.5s"):
        fetch_text(replay.url, 0.5)
    assert time.monotonic() - started < 3.0  # the drip lasts 10 s


def test_an_endpoint_that_redirects_is_down_not_followed(replays):
    """A process on the node that says it is a vLLM must not steer the daemon to another
    address (a cloud metadata service), whose text a parse error would then show."""
    from ac_observe.collectors.scrape.fetch import ScrapeFailed, fetch_text
    steering, elsewhere = replays("vllm_v1_0.10.prom"), replays("sglang_0.4.prom")
    steering.mode, steering.redirect_to = "redirect", elsewhere.url
    with pytest.raises(ScrapeFailed, match="HTTP 302"):
        fetch_text(steering.url, 2.0)
    assert elsewhere.scrapes == 0


def test_an_endpoint_url_with_a_password_is_refused_without_echoing_it():
    out = run_cli("daemon", "--port", "0", "--collectors", "", "--engine-endpoint",
                  "http://admin:s3cret@127.0.0.1:9/metrics", timeout=20)
    assert out.returncode != 0
    assert "user:password@" in out.stderr and "s3cret" not in out.stderr, out.stderr


@pytest.mark.slow
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
    out = run_cli("--daemon", daemon.url, "--metric", "skeleton_complexity")
    assert "vllm-a (vllm): not exported by vLLM" in out.stdout, out.stdout
    status = run_cli("--daemon", daemon.url, "status")
    assert "vllm-a (vllm)" in status.stdout and "down: cannot connect" in status.stdout, \
        status.stdout
    # The URL once, under the name; no pid where none is known.
    assert status.stdout.count("127.0.0.1:9/metrics") == 1, status.stdout
    assert "None" not in status.stdout, status.stdout


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


@pytest.mark.stack
def test_prometheus_reads_each_engine_on_its_own_edges_as_the_daemon_does(
        tmp_path, replays, start_daemon):
    """A real Prometheus scraping a daemon that holds a bundled engine and a vLLM replay:
    the dashboards' and rules' quantiles (summed within one engine and kind) give each
    engine's figure on its own edges, the daemon's within 1 %; a quantile over the merged
    layouts would give neither."""
    import secrets

    from ac_observe.dashboards import promql
    from ac_observe.engine.telemetry import TelemetryWriter
    from support.stack import Prometheus

    vllm = replays("vllm_v1_0.10.prom")  # every TTFT bucket at 0: a base of zeros
    root = tmp_path / "telemetry"
    root.mkdir(mode=0o700)
    writer = TelemetryWriter(root / "bundled", {}, engine="bundled", model="tiny")
    token = secrets.token_hex(16)
    prometheus = None
    try:
        # A base in the bundled engine's buckets, in proportion to what follows, so
        # Prometheus' extrapolation scales every bucket alike (the daemon reads it as a base).
        writer.observe_many(m.INFERENCE_LATENCY, [0.05] * 5 + [0.3] * 5, stream="throughput")
        daemon = start_daemon(root, "--engine-endpoint", f"vllm-a={vllm.url}", "--collectors",
                              "engine", "--token", token)
        prometheus = Prometheus(tmp_path / "prometheus", f"127.0.0.1:{daemon.port}", None,
                                token)
        wait_for(prometheus.targets_up, 30, "Prometheus to scrape the daemon")
        prometheus.wait_scrape_and_rules("ac-observe", time.time())  # the base is in
        writer.observe_many(m.INFERENCE_LATENCY, [0.05] * 50 + [0.3] * 50, stream="throughput")
        vllm.observe(TTFT, 0.07, 60)   # vLLM's (0.06, 0.08]
        vllm.observe(TTFT, 0.6, 40)    # vLLM's (0.5, 0.75]
        vllm.inc("vllm:prefix_cache_queries", 1000)  # tokens: 40 % found
        vllm.inc("vllm:prefix_cache_hits", 400)
        vllm.set("vllm:num_requests_running", 7)
        daemon.wait_cycles(2)
        prometheus.wait_scrape_and_rules("ac-observe", time.time())
        friendly = FRIENDLY["inference_latency_ns"]
        env = {"AC_OBSERVE_TOKEN": token}
        for statistic in ("p50", "p95"):
            out = run_cli("--daemon", daemon.url, "--metric", "inference_latency_ns",
                          "--window", "5m", "--json", env={**os.environ, **env})
            ours = {s["labels"]["engine"]: s[statistic] for s in json.loads(out.stdout)["series"]}
            expr = promql.statistic_expr(friendly, statistic, "5m", by=("engine",))
            theirs = {r["metric"]["engine"]: float(r["value"][1])
                      for r in prometheus.query(expr)}
            assert set(ours) == set(theirs) == {"bundled", "vllm-a"}, (ours, theirs)
            for engine in ours:
                assert math.isclose(theirs[engine], ours[engine], rel_tol=0.01), \
                    (statistic, engine, ours, theirs)
            # The overview's one-figure stat: the worst engine's, not a merged layout's.
            (worst,) = prometheus.query(promql.statistic_expr(friendly, statistic, "5m", by=()))
            assert math.isclose(float(worst["value"][1]), max(theirs.values()), rel_tol=1e-9)
        # vLLM's p95: rank 95 of 100, the 35th of 40 in (0.5, 0.75]: 0.71875 s; p50 in
        # (0.06, 0.08]: 0.06 + 0.02 * 50/60. The daemon answered these above.
        assert math.isclose(theirs["vllm-a"], 0.71875e9, rel_tol=0.01), theirs
        merged = prometheus.query(
            "histogram_quantile(0.95, sum by (le) (rate(ac_inference_latency_seconds_bucket[5m])))"
            " * 1e9")
        assert not math.isclose(float(merged[0]["value"][1]), theirs["vllm-a"], rel_tol=0.05)
        # The hit rate (the KV dashboard's query, on each engine's basis) and the running
        # requests (the statistic the rules use) as the CLI answers them.
        from ac_observe.dashboards import grafana

        def cli(name: str, *extra: str) -> dict:
            out = run_cli("--daemon", daemon.url, "--metric", name, "--window", "5m",
                          "--json", *extra, env={**os.environ, **env})
            return _one(json.loads(out.stdout), engine="vllm-a")
        hit = cli("kv_cache_hit_rate", "--labels", "kind=vllm")
        assert hit["basis"] == "tokens" and math.isclose(hit["mean"], 40.0, rel_tol=0.01), hit
        rows = prometheus.query(grafana.hit_rate_by_basis(("engine", "kind"))
                                  .replace("$__rate_interval", "5m").replace("$engine", ".*")
                                  .replace("$node", ".*"))
        (row,) = [r for r in rows if r["metric"]["engine"] == "vllm-a"]
        assert row["metric"]["basis"] == "tokens", row
        assert math.isclose(float(row["value"][1]), hit["mean"], rel_tol=0.01), (row, hit)
        running = cli("requests_running")
        expr = promql.statistic_expr(FRIENDLY["requests_running"], "last", "5m",
                                     by=("engine",))
        (row,) = [r for r in prometheus.query(expr) if r["metric"]["engine"] == "vllm-a"]
        assert float(row["value"][1]) == running["last"] == 7.0, (row, running)
    finally:
        if prometheus is not None:
            prometheus.stop()
        writer.close()


def _vllm_hits(replay: EngineReplay, shifted: bool) -> None:
    """vLLM V1 counts prefix hits in tokens: 90 % found, 50 % while shifted."""
    replay.inc("vllm:prefix_cache_queries", 1000)
    replay.inc("vllm:prefix_cache_hits", 500 if shifted else 900)


def _sglang_hits(replay: EngineReplay, shifted: bool) -> None:
    """SGLang reports its own hit-rate gauge: 0.9, 0.5 while shifted."""
    replay.set("sglang:cache_hit_rate", 0.5 if shifted else 0.9)


DRIFT_REPLAYS = {"vllm": ("vllm_v1_0.10.prom", TTFT, _vllm_hits),
                 "sglang": ("sglang_0.4.prom", "sglang:time_to_first_token_seconds",
                            _sglang_hits)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DRIFT_REPLAYS))
def test_the_shipped_drift_rules_fire_on_a_replay_whose_ttft_shifts_and_resolve(
        tmp_path, replays, kind):
    """The shipped rules (`rules: defaults`) on a vLLM and on an SGLang replay, the clock
    driven by the test (a cycle and an evaluation every 10 s of its time, no waiting): 40
    min steady, so the trailing hour is a baseline; 12 min with the slow tail moved from
    the (0.1, 0.25] bucket both engines have to their (0.5, 0.75] and prefix hits (vLLM's
    token counters, SGLang's gauge) dropped from 90 % to 50 %; then steady again until
    resolved."""
    capture, ttft, hits = DRIFT_REPLAYS[kind]
    replay = replays(capture)
    alerting = tmp_path / "alerts.yaml"
    alerting.write_text("rules: defaults\n")
    engine = f"{kind}-a"
    daemon = Daemon(DaemonConfig(
        telemetry_root=tmp_path / "telemetry", collectors=(), history=False,
        engine_endpoints=((engine, replay.url),), interval_seconds=10.0,
        window_seconds=4200.0, alerting_file=alerting, state_dir=tmp_path / "state",
        alert_interval_seconds=10.0))
    t0 = time.time() // 60 * 60 - 7200  # in the past: a day back holds nothing
    firing: dict[str, float] = {}
    resolved: dict[str, float] = {}
    drifts = {"InferenceLatencyDrift", "FastRequestsShareDrop", "KvCacheHitRateDrop"}
    try:
        for step in range(62 * 6):
            minute = step / 6
            shifted = 40 <= minute < 52
            replay.observe(ttft, 0.07, 18)                 # (0.06, 0.08]
            replay.observe(ttft, 0.6 if shifted else 0.2, 2)
            hits(replay, shifted)
            daemon.run_cycle(now=t0 + 10 * step)
            active = {(a["rule"], a["state"]): a for a in daemon.alerts.active()
                      if a["labels"].get("engine") == engine}
            for rule in drifts:
                if (rule, FIRING) in active:
                    assert active[(rule, FIRING)]["labels"]["kind"] == kind
                    firing.setdefault(rule, minute)
                elif rule in firing:
                    resolved.setdefault(rule, minute)
            if minute == 39:
                # The steady hour: p95 0.1 + 0.15 * (19 - 18) / 2 = 0.175 s, nothing drifts.
                p95 = _one(daemon.query("inference_latency_ns", 300, {}, now=t0 + 10 * step),
                           engine=engine)["p95"]
                assert math.isclose(p95, 0.175e9, rel_tol=0.01), p95
                assert not firing, firing
        # Firing once the slow tail is over 5 % of the window (~2.5 min) and `for: 5m`
        # has run; resolved a few minutes after the tail went back.
        assert set(firing) == drifts, (firing, resolved)
        for rule in drifts:
            assert 45 <= firing[rule] < 52, (rule, firing)
            assert 52 <= resolved.get(rule, math.inf) < 62, (rule, resolved)
    finally:
        daemon.close()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux: /proc/PID/task/*/children)."""
    return sorted(int(c) for task in os.listdir(f"/proc/{pid}/task")
                  for c in open(f"/proc/{pid}/task/{task}/children").read().split())


def _netns(name: str, subnet: str):
    """A network namespace with a veth to the host: (the host's, the namespace's) address."""
    import subprocess

    def ip(*args, ns=None):
        command = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(command, check=True, capture_output=True)
    host_if, ns_if = f"{name[:10]}h", f"{name[:10]}n"
    ip("netns", "add", name)
    ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
    ip("link", "set", ns_if, "netns", name)
    ip("addr", "add", f"{subnet}.1/30", "dev", host_if)
    ip("link", "set", host_if, "up")
    ip("addr", "add", f"{subnet}.2/30", "dev", ns_if, ns=name)
    ip("link", "set", ns_if, "up", ns=name)
    ip("link", "set", "lo", "up", ns=name)
    return f"{subnet}.2"


@pytest.mark.stack
def test_discovery_finds_vllm_and_sglang_processes_and_drops_one_that_exits(tmp_path):
    """Stand-ins started with the servers' own command lines, one in a network namespace
    of its own (as a pod's is, made here with `ip netns`): each found by its command line
    and listening socket, reached on loopback or on its namespace's address, read into
    the contract with its pid in status; dropped, series and all, once it exits."""
    import random
    import shutil
    import subprocess
    import sys

    from support.processes import start_process, stop_process
    from support.servers import free_port
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's ip for a network namespace")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(tests, "support", "standin_engines"), tests])}
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n" + (
        open(os.path.join(tests, "support", "standin_engines", "vllm_cli.py")).read()))
    script.chmod(0o755)
    suffix = random.randrange(1 << 16)
    name, subnet = f"acob{suffix:04x}", f"10.{200 + suffix % 50}.{suffix % 250}"
    ports = [free_port() for _ in range(3)]
    procs = []
    daemon = None
    try:
        pod_address = _netns(name, subnet)
        procs.append(start_process([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                    "--port", str(ports[0])], env=env))
        procs.append(start_process([str(script), "serve", "tiny", "--port", str(ports[1])],
                                   env=env))
        procs.append(start_process(["ip", "netns", "exec", name, sys.executable, "-m",
                                    "sglang.launch_server", "--port", str(ports[2])], env=env))
        # An impostor: a vLLM's command line naming a port another process listens on
        # (this test's socket). Its command line alone must not aim the daemon there.
        held = socket.create_server(("127.0.0.1", 0))
        impostor = start_process([sys.executable, "-c", "import time; time.sleep(120)", "-m",
                                  "vllm.entrypoints.openai.api_server", "--port",
                                  str(held.getsockname()[1])], env=env)
        daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "telemetry", collectors=(),
                                     history=False, engine_discovery=True))
        pids = [p.pid for p in procs]

        def engines():
            daemon.run_cycle()
            return {e["pid"]: e for e in daemon.status()["engines"] if e["alive"]}
        found = wait_for(lambda: set(pids) <= set(engines()) and engines(), 30,
                         "the three stand-ins found and read")
        assert impostor.pid not in {e["pid"] for e in daemon.status()["engines"]}
        stop_process(impostor)
        held.close()
        assert {pid: (e["engine"], e["kind"], e["endpoint"]) for pid, e in found.items()
                if pid in pids} == {
            pids[0]: (f"vllm-{pids[0]}", "vllm", f"http://127.0.0.1:{ports[0]}/metrics"),
            pids[1]: (f"vllm-{pids[1]}", "vllm", f"http://127.0.0.1:{ports[1]}/metrics"),
            pids[2]: (f"sglang-{pids[2]}", "sglang",
                      f"http://{pod_address}:{ports[2]}/metrics")}
        running = daemon.query("requests_running", 3600, {})
        assert {s["labels"]["engine"]: s["last"] for s in running["series"]}.items() >= {
            f"vllm-{pids[0]}": 3.0, f"vllm-{pids[1]}": 3.0, f"sglang-{pids[2]}": 3.0}.items()
        # Each discovered server's series carry its pid (NVML's and eBPF's per-process
        # series join on it), a query may pick one by it, and so does ac_engine_up.
        assert {s["labels"]["engine"]: s["labels"].get("pid") for s in running["series"]
                if s["labels"]["engine"].endswith(tuple(map(str, pids)))} == {
            f"vllm-{pids[0]}": str(pids[0]), f"vllm-{pids[1]}": str(pids[1]),
            f"sglang-{pids[2]}": str(pids[2])}
        (picked,) = daemon.query("requests_running", 3600, {"pid": str(pids[2])})["series"]
        assert picked["labels"]["engine"] == f"sglang-{pids[2]}"
        text = daemon.render_metrics().decode()
        assert (f'ac_engine_up{{node="{daemon.config.node_name}",'
                f'engine="sglang-{pids[2]}",model=') in text
        assert f'kind="sglang",pid="{pids[2]}"}} 1.0' in text
        assert f'pid="{pids[0]}"' in text.split("ac_inference_latency_seconds_bucket", 1)[1]
        # The join table: each server's pid and its child's (where vLLM V1 and SGLang run
        # the model), so NVML's and eBPF's per-process series find the engine.
        processes = {(s.labels["engine"], s.labels["role"]): (s.labels["pid"], s.value)
                     for f in text_string_to_metric_families(text)
                     if f.name == m.ENGINE_PROCESS.name for s in f.samples}
        for pid, kind in zip(pids, ("vllm", "vllm", "sglang"), strict=True):
            (child,) = _children(pid)
            assert processes[(f"{kind}-{pid}", "server")] == (str(pid), 1.0), processes
            assert processes[(f"{kind}-{pid}", "child")] == (str(child), 1.0), processes
        stop_process(procs[1])
        gone = f"vllm-{pids[1]}"
        wait_for(lambda: gone not in {e["engine"] for e in engines().values()}
                 and f'engine="{gone}"' not in daemon.render_metrics().decode(), 30,
                 "the exited stand-in dropped")
        assert {e["engine"] for e in daemon.status()["engines"]} >= {
            f"vllm-{pids[0]}", f"sglang-{pids[2]}"}
    finally:
        if daemon is not None:
            daemon.close()
        for proc in procs:
            stop_process(proc)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_servers_descendants_are_every_process_below_it_and_nothing_else(tmp_path):
    """The join table's children: grandchildren too, a sibling's tree not, and a parent
    map that loops (pids reused while /proc was read) ends; /proc/PID/stat read after the
    last ')', whatever the name holds."""
    from ac_observe.collectors.scrape.discovery import _parent, descendants
    parents = {11: 10, 12: 11, 13: 10, 20: 1, 21: 20, 10: 12}
    assert descendants(10, parents) == (11, 12, 13)
    assert descendants(20, parents) == (21,)
    assert descendants(21, parents) == ()
    entry = tmp_path / "77"
    entry.mkdir()
    (entry / "stat").write_text("77 (python3 ) 5 S (x) S 4242 77 77 0 -1 4194560 1234\n")
    assert _parent(entry) == 4242
    (entry / "stat").write_text("garbage")
    assert _parent(entry) is None
