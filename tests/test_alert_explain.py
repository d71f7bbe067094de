"""An alert's explanation (daemon/alerting/explain.py), on the daemon's real windows and
query engine with a clock the test drives, fed by a collector whose requests the test
writes: every part and cause by value, missing ones said missing, the verdict's text, the
notification's annotation, the API and the CLI.

The drift is made so that the plausible wrong formulas answer otherwise: the queue's mean
moves by 100 ms while its p95 moves by 500 ms (a split of quantiles), its share of the
mean's change is 89 % but of the new mean 65 % (a share of the new total), and the
front-end has more observations than TTFT (its sum over TTFT's count is 6 ms, not 5).
"""
from __future__ import annotations

import bisect
import json
import re

import httpx
import pytest

from ac_observe import metrics as m
from ac_observe.collectors.base import Collector, new_family
from ac_observe.daemon.alerting.explain import MISSING
from ac_observe.daemon.alerting.state import FIRING
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.daemon.store import deliveries

LANE = "low_latency"
T0 = 1_000_000.0
DRIFT_AT = 30  # the first cycle of the drift


class _Histogram:
    """One series' cumulative buckets and sum, as an engine would export them."""

    def __init__(self, spec: m.MetricSpec):
        self.spec = spec
        self.counts = [0] * (len(spec.buckets) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.spec.buckets, value)] += times
        self.total += value * times

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(repr, self.spec.buckets), "+Inf"], self.counts,
                                strict=True):
            running += count
            out.append((bound, running))
        return out


HISTOGRAMS = (m.INFERENCE_LATENCY, m.FRONTEND, m.QUEUE_TIME, m.REQUEST_PREFILL,
              m.REQUEST_DECODE, m.INTER_TOKEN_LATENCY, m.E2E_LATENCY)


class _Requests(Collector):
    """Each cycle, 10 requests per engine. Calm: front-end 5 ms, queue 10 ms, prefill
    40 ms, TTFT their sum + 2 ms (what the parts leave out); 2 more requests reach the
    front-end only (rejected). Drift: 2 of the 10 wait 510 ms in the queue (8 still
    10 ms), prefill 50 ms, the rest 4 ms; finished requests/s 10 -> 20, waiting 0 -> 14,
    running 4 -> 1 (moved most, but the way that speeds requests up). Each request has 4
    output tokens, 3 gaps of 20 ms (drift: 30 ms) after the first: its decode phase.
    100 prompt tokens a request admitted (as its queue time is observed). e1's steps a
    cycle: 10 decodes of 4 sequences and 5 prefills of 2; drift: 6 decodes of 4 and 4 of 9
    (mean 6; without the phase filter, prefill and decode together: 3.3 -> 3.5), 10
    prefills of 1 (down: the way that speeds requests up). Engine e2 exports no front-end
    time and no batch sizes."""
    name = "requests"

    def __init__(self):
        self.drift = False
        self.requests_ok = {"e1": 0.0, "e2": 0.0}
        self.prompt_tokens = {"e1": 0.0, "e2": 0.0}
        self.series = {(engine, spec.name): _Histogram(spec) for engine in ("e1", "e2")
                       for spec in HISTOGRAMS}
        self.batches = {phase: _Histogram(m.BATCH_SEQUENCES) for phase in m.PHASES}

    def collect(self):
        for engine in ("e1", "e2"):
            def add(spec, value, times, e=engine):
                self.series[e, spec.name].observe(value, times)
            prefill, rest = (0.050, 0.004) if self.drift else (0.040, 0.002)
            queues = ((0.010, 8), (0.510, 2)) if self.drift else ((0.010, 10),)
            gap = 0.030 if self.drift else 0.020
            for queue, times in queues:
                add(m.QUEUE_TIME, queue, times)
                add(m.INFERENCE_LATENCY, 0.005 + queue + prefill + rest, times)
                add(m.E2E_LATENCY, 0.005 + queue + prefill + rest + 3 * gap, times)
            add(m.INTER_TOKEN_LATENCY, gap, 30)
            add(m.REQUEST_DECODE, 3 * gap, 10)
            add(m.FRONTEND, 0.005, 12)
            add(m.REQUEST_PREFILL, prefill, 10)
            self.requests_ok[engine] += 20 if self.drift else 10
            self.prompt_tokens[engine] += 100 * 10
        steps = {m.PHASE_DECODE: ((4, 6), (9, 4)) if self.drift else ((4, 10),),
                 m.PHASE_PREFILL: ((1, 10),) if self.drift else ((2, 5),)}
        batches = new_family(m.BATCH_SEQUENCES)
        for phase, sizes in steps.items():
            for size, times in sizes:
                self.batches[phase].observe(size, times)
            batches.add_metric(["e1", "m", LANE, phase], self.batches[phase].buckets(),
                               self.batches[phase].total)
        out = []
        for spec in HISTOGRAMS:
            family = new_family(spec)
            for engine in ("e1", "e2") if spec is not m.FRONTEND else ("e1",):
                series = self.series[engine, spec.name]
                family.add_metric([engine, "m", LANE], series.buckets(), series.total)
            out.append(family)
        requests, waiting, running = (new_family(m.REQUESTS), new_family(m.REQUESTS_WAITING),
                                      new_family(m.REQUESTS_RUNNING))
        prompt_tokens = new_family(m.PROMPT_TOKENS)
        for engine in ("e1", "e2"):
            requests.add_metric([engine, "m", LANE, "ok"], self.requests_ok[engine])
            prompt_tokens.add_metric([engine, "m"], self.prompt_tokens[engine])
            waiting.add_metric([engine, "m", LANE], 14.0 if self.drift else 0.0)
            running.add_metric([engine, "m", LANE], 1.0 if self.drift else 4.0)
        return out + [requests, waiting, running, prompt_tokens, batches]


RULES = """\
receivers:
  - {name: ops, url: 'http://127.0.0.1:9/x', secret: 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw'}
rules:
  - name: TtftDrift
    metric: inference_latency_ns
    statistic: p95
    window: 10s
    baseline: trailing:20s
    comparison: relative_increase
    threshold: 0.5
  - name: E2eDrift
    metric: e2e_latency_ms
    statistic: mean
    window: 10s
    baseline: trailing:20s
    comparison: relative_increase
    threshold: 0.5
    match: {engine: e1}
  - name: TtftHigh
    metric: inference_latency_ns
    statistic: mean
    window: 10s
    comparison: above
    threshold: 100000000
    match: {engine: e1}
"""


def _drifted(tmp_path, until: int = 45):
    path = tmp_path / "alerts.yaml"
    path.write_text(RULES)
    collector = _Requests()
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=1.0, window_seconds=600, alerting_file=path,
                                 state_dir=tmp_path / "state", alert_interval_seconds=1.0),
                    collectors=[collector])
    for t in range(until + 1):
        collector.drift = t >= DRIFT_AT
        daemon.run_cycle(now=T0 + t)
    return daemon


def _by_name(entries):
    return {e["name"]: e for e in entries}


@pytest.fixture(scope="module")
def drifted(tmp_path_factory):
    daemon = _drifted(tmp_path_factory.mktemp("explain"))
    yield daemon
    daemon.close()


def _alerts(daemon, rule: str = "TtftDrift") -> dict:
    return {a["labels"]["engine"]: a for a in daemon.alerts.explained() if a["rule"] == rule}


def test_the_mean_splits_into_its_parts_by_value(drifted):
    alert = _alerts(drifted)["e1"]
    assert alert["state"] == FIRING
    found = alert["explanation"]
    # The baseline span is the 20 s before the window as the alert went pending: calm.
    assert found["baseline_span"]["end"] == alert["active_since"] - 10
    assert found["window"] == {"start": T0 + 35, "end": T0 + 45}
    mean = found["mean"]
    assert mean["baseline_ms"] == pytest.approx(57.0)
    assert mean["now_ms"] == pytest.approx(169.0)
    assert mean["change_ms"] == pytest.approx(112.0)
    assert mean["observations"] == 100
    parts = _by_name(found["parts"])
    assert list(parts) == ["front-end", "queue", "prefill", "unexplained"]
    expected = {"front-end": (5, 5), "queue": (10, 110), "prefill": (40, 50),
                "unexplained": (2, 4)}
    for name, (baseline, now) in expected.items():
        part = parts[name]
        assert part["baseline_ms"] == pytest.approx(baseline, abs=1e-6), name
        assert part["now_ms"] == pytest.approx(now, abs=1e-6), name
        assert part["change_ms"] == pytest.approx(now - baseline, abs=1e-6), name
        assert part["share"] == pytest.approx((now - baseline) / 112, abs=1e-6), name
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    # The rule's own statistic beside the split, never split itself.
    stat = found["statistic"]
    assert stat["name"] == "p95" and stat["unit"] == "ns"
    assert (stat["baseline"], stat["now"]) == (alert["baseline"], alert["value"])
    assert stat["change_percent"] == pytest.approx(
        100 * (alert["value"] - alert["baseline"]) / alert["baseline"])


def test_causes_by_value_and_missing_ones_said_missing(drifted):
    found = _alerts(drifted)["e1"]["explanation"]
    causes = {c["name"]: c for c in found["causes"]}
    assert (causes["requests/s"]["baseline"], causes["requests/s"]["now"]) == \
        (pytest.approx(10.0), pytest.approx(20.0))
    assert (causes["waiting"]["baseline"], causes["waiting"]["now"]) == (0.0, 14.0)
    assert (causes["running"]["baseline"], causes["running"]["now"]) == (4.0, 1.0)
    # Sequences per step, each phase's own: the mean by steps of the span.
    assert (causes["decode batch"]["baseline"], causes["decode batch"]["now"]) == \
        (pytest.approx(4.0), pytest.approx(6.0))
    assert (causes["prefill batch"]["baseline"], causes["prefill batch"]["now"]) == \
        (pytest.approx(2.0), pytest.approx(1.0))
    assert (causes["decode batch"]["group"], causes["decode batch"]["unit"]) == ("load", "seqs")
    # 12 reach the front-end a cycle in both spans (2 of them rejected later)
    assert (causes["arrivals/s"]["baseline"], causes["arrivals/s"]["now"]) == \
        (pytest.approx(12.0, rel=0.05), pytest.approx(12.0, rel=0.05))
    # Per request admitted (10 a second), not finished (10, then 20): 100, not 50.
    assert (causes["prompt tokens/s"]["baseline"], causes["prompt tokens/s"]["now"]) == \
        (pytest.approx(1000.0), pytest.approx(1000.0))
    assert (causes["prompt tokens/request"]["baseline"],
            causes["prompt tokens/request"]["now"]) == (pytest.approx(100.0),
                                                         pytest.approx(100.0))
    # No KV, kernel or device series here: missing, never 0.
    for name in ("hit rate", "misses evicted", "evictions/s", "cached tokens/request",
                 "skeleton depth", "prefill kernels ms/step",
                 "sync wait", "GPU util", "SM clock", "power", "XID errors/s",
                 "restarts/s"):
        assert (causes[name]["baseline"], causes[name]["now"]) == (None, None), name
    # e2 exports no batch sizes (as a vLLM or SGLang): missing, never 0.
    causes = {c["name"]: c for c in _alerts(drifted)["e2"]["explanation"]["causes"]}
    for name in ("prefill batch", "decode batch"):
        assert (causes[name]["baseline"], causes[name]["now"]) == (None, None), name


def test_the_verdict_names_the_part_with_the_largest_share_and_its_causes(drifted):
    """The causes that moved most the way that slows requests (not running 4 -> 1)."""
    alert = _alerts(drifted)["e1"]
    percent = round(alert["explanation"]["statistic"]["change_percent"])
    assert alert["explanation"]["verdict"] == (
        f"TTFT p95 +{percent} %: queue time +100 ms is 89 % of the mean's change "
        "(waiting 0 -> 14, requests/s 2.0x baseline)")


def test_an_end_to_end_mean_adds_the_decode_phase_per_token_times_tokens(drifted):
    found = _alerts(drifted, "E2eDrift")["e1"]["explanation"]
    assert (found["mean"]["baseline_ms"], found["mean"]["now_ms"]) == (pytest.approx(117.0),
                                                                       pytest.approx(259.0))
    parts = _by_name(found["parts"])
    expected = {"front-end": (5, 5), "queue": (10, 110), "prefill": (40, 50),
                "decode": (60, 90), "unexplained": (2, 4)}
    assert list(parts) == list(expected)
    for name, (baseline, now) in expected.items():
        assert (parts[name]["baseline_ms"], parts[name]["now_ms"]) == (
            pytest.approx(baseline, abs=1e-6), pytest.approx(now, abs=1e-6)), name
        assert parts[name]["share"] == pytest.approx((now - baseline) / 142, abs=1e-6), name
    decode = parts["decode"]
    assert (decode["baseline_per_token_ms"], decode["now_per_token_ms"]) == (
        pytest.approx(20.0), pytest.approx(30.0))
    assert decode["baseline_tokens_per_request"] == decode["now_tokens_per_request"] == 4
    assert found["verdict"].startswith("e2e latency mean +121 %: queue time +100 ms is 70 % ")


def test_a_threshold_rule_is_explained_against_the_hour_before_its_window(drifted):
    """A rule that reads no baseline: its statistic against its threshold, the split
    against the span before the window (calm here)."""
    alert = _alerts(drifted, "TtftHigh")["e1"]
    found = alert["explanation"]
    assert found["statistic"]["baseline"] is None
    assert found["baseline_span"]["end"] == alert["active_since"] - 10
    # the hour before it, or what the daemon's windows (600 s here) hold of it
    assert found["baseline_span"]["start"] == alert["active_since"] - 600
    assert (found["mean"]["baseline_ms"], found["mean"]["now_ms"]) == (pytest.approx(57.0),
                                                                       pytest.approx(169.0))
    assert found["verdict"] == ("TTFT mean 169 ms (above 100 ms): queue time +100 ms is 89 % "
                                "of the mean's change (waiting 0 -> 14, requests/s 2.0x "
                                "baseline)")


def test_a_part_without_data_is_missing_and_left_to_the_residual(drifted):
    parts = _by_name(_alerts(drifted)["e2"]["explanation"]["parts"])
    assert (parts["front-end"]["baseline_ms"], parts["front-end"]["now_ms"],
            parts["front-end"]["share"]) == (None, None, None)
    residual = parts["unexplained"]
    assert residual["includes_missing"] == ["front-end"]
    assert (residual["baseline_ms"], residual["now_ms"]) == (pytest.approx(7.0),
                                                             pytest.approx(9.0))
    assert parts["queue"]["share"] == pytest.approx(100 / 112)


def test_the_firing_notification_carries_the_verdict(drifted):
    import sqlalchemy as sa
    with drifted.store.engine.connect() as connection:
        bodies = [json.loads(r.body) for r in connection.execute(sa.select(deliveries))]
    firing = {b["alerts"][0]["labels"]["engine"]: b["alerts"][0]["annotations"]
              for b in bodies if b["status"] == "firing"
              and b["alerts"][0]["labels"]["alertname"] == "TtftDrift"}
    # Fired while the window held its first drifting cycles: the queue's share of the
    # mean's change is 89 % from the first one on.
    assert re.fullmatch(r"TTFT p95 \+\d+ %: queue time \+[\d.]+ ms is 89 % of the mean's "
                        r"change \(.*\)", firing["e1"]["explanation"]), firing["e1"]


def test_the_api_and_the_cli_at_80_columns_and_as_json(drifted):
    from typer.testing import CliRunner

    from ac_observe.daemon.cli import app
    from ac_observe.daemon.http_api import Routes
    from ac_observe.daemon.http_server import HttpServer
    server = HttpServer(Routes(drifted, None), "127.0.0.1", 0)
    stop = server.start_in_thread()
    try:
        url = f"http://127.0.0.1:{server.port}"
        import httpx
        body = httpx.get(url + "/api/v1/alerts?explain=1").json()
        assert {a["labels"]["engine"]: a["explanation"]["verdict"] for a in body["alerts"]
                if a["rule"] == "TtftDrift"} \
            == {e: a["explanation"]["verdict"] for e, a in _alerts(drifted).items()}
        # A plain listing builds none: the same alerts, without explanations.
        plain = httpx.get(url + "/api/v1/alerts").json()
        assert [a["fingerprint"] for a in plain["alerts"]] == \
            [a["fingerprint"] for a in body["alerts"]]
        assert not any("explanation" in a for a in plain["alerts"])
        calls = []
        drifted.alerts.explained = lambda: calls.append(1)  # an instance attribute
        try:
            assert httpx.get(url + "/api/v1/alerts?explain=0").status_code == 200
            assert calls == []  # nothing worked out
        finally:
            del drifted.alerts.explained
        runner = CliRunner()
        fingerprint = _alerts(drifted)["e1"]["fingerprint"]
        out = runner.invoke(app, ["--daemon", url, "alerts", "explain", fingerprint],
                            env={"COLUMNS": "80"})
        assert out.exit_code == 0, out.output
        lines = out.output.splitlines()
        assert max(len(line) for line in lines) <= 80
        assert lines[1].startswith("TTFT p95 +")
        table = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
        assert table["queue"] == ["10", "ms", "110", "ms", "+100", "ms", "89", "%"]
        assert table["front-end"][-2:] == ["0", "%"]
        assert any(line.startswith("device: GPU util") and line.split()[-2:] ==
                   [MISSING, MISSING] for line in lines)
        both = runner.invoke(app, ["--daemon", url, "alerts", "explain", "TtftDrift", "--json"])
        assert both.exit_code == 0, both.output
        assert sorted(e["labels"]["engine"] for e in json.loads(both.output)) == ["e1", "e2"]
        unknown = runner.invoke(app, ["--daemon", url, "alerts", "explain", "NoSuchRule"])
        assert unknown.exit_code == 2
        assert len(unknown.output.strip().splitlines()) == 1
        assert "NoSuchRule" in unknown.output
    finally:
        stop()


class _Lookups(Collector):
    """Each cycle 100 prompt blocks looked up on engine e1, 60 of skeleton s1 and 40 of
    s2. Calm: 90 % hit in both; misses 6 cold, 4 diverged. Drift: s2 hits 6 of its 40
    (s1 unchanged), misses 8 cold, 4 diverged, 28 evicted; 5 evictions a second."""
    name = "lookups"

    def __init__(self):
        self.drift = False
        self.totals: dict = {}

    def _add(self, key, value):
        self.totals[key] = self.totals.get(key, 0.0) + value

    def collect(self):
        hits = {"s1": 54, "s2": 6 if self.drift else 36}
        for skeleton, lookups in (("s1", 60), ("s2", 40)):
            self._add(("query", skeleton), lookups)
            self._add(("hit", skeleton), hits[skeleton])
            self._add(("requests", skeleton), 1)
        misses = dict(zip(m.MISS_REASONS, (28, 8, 4) if self.drift else (0, 6, 4),
                          strict=True))
        for reason, count in misses.items():
            self._add(("miss", reason), count)
        self._add(("evictions",), 5 if self.drift else 0)
        query, hit, miss = (new_family(m.KV_QUERY_BLOCKS), new_family(m.KV_HIT_BLOCKS),
                            new_family(m.KV_MISS_BLOCKS))
        requests, evictions = new_family(m.SKELETON_REQUESTS), new_family(m.KV_EVICTIONS)
        for skeleton in ("s1", "s2"):
            query.add_metric(["e1", "m", skeleton], self.totals["query", skeleton])
            hit.add_metric(["e1", "m", skeleton], self.totals["hit", skeleton])
            requests.add_metric(["e1", "m", skeleton], self.totals["requests", skeleton])
        for reason in m.MISS_REASONS:
            miss.add_metric(["e1", "m", reason], self.totals["miss", reason])
        evictions.add_metric(["e1", "m"], self.totals["evictions",])
        return [query, hit, miss, requests, evictions]


HIT_RATE_RULE = """\
rules:
  - name: HitRateDrop
    metric: kv_cache_hit_rate
    statistic: mean
    window: 10s
    baseline: trailing:20s
    comparison: absolute_decrease
    threshold: 5
"""


def test_a_hit_rate_fall_splits_by_miss_reason_and_names_the_skeleton(tmp_path):
    path = tmp_path / "alerts.yaml"
    path.write_text(HIT_RATE_RULE)
    collector = _Lookups()
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=1.0, window_seconds=600, alerting_file=path,
                                 state_dir=tmp_path / "state", alert_interval_seconds=1.0),
                    collectors=[collector])
    try:
        for t in range(46):
            collector.drift = t >= DRIFT_AT
            daemon.run_cycle(now=T0 + t)
        (alert,) = daemon.alerts.explained()
        found = alert["explanation"]
        assert found["mean"] == {"baseline": pytest.approx(90.0), "now": pytest.approx(60.0),
                                 "change": pytest.approx(-30.0)}
        parts = _by_name(found["parts"])
        expected = {"evicted": (0, 28), "cold": (6, 8), "diverged": (4, 4),
                    "unexplained": (0, 0)}
        for name, (baseline, now) in expected.items():
            assert parts[name]["baseline"] == pytest.approx(baseline, abs=1e-9), name
            assert parts[name]["now"] == pytest.approx(now, abs=1e-9), name
            assert parts[name]["share"] == pytest.approx((now - baseline) / 30, abs=1e-9), name
        skeletons = {s["skeleton"]: (s["baseline"], s["now"]) for s in found["skeletons"]}
        assert skeletons == {"s1": (pytest.approx(90.0), pytest.approx(90.0)),
                             "s2": (pytest.approx(90.0), pytest.approx(15.0))}
        assert found["skeletons"][0]["skeleton"] == "s2"  # the one that lost most first
        assert found["verdict"] == ("KV hit rate mean 90 % -> 60 %: evicted misses +28 "
                                    "points is 93 % of the fall (evictions/s 0 -> 5)")
    finally:
        daemon.close()


def test_notifications_carry_the_verdict_where_a_person_reads_them():
    from ac_observe.daemon.alerting.alert import Alert
    from ac_observe.daemon.alerting.notify.grafana import grafana_annotation
    from ac_observe.daemon.alerting.notify.slack import slack_body
    alert = Alert(labels={"alertname": "TtftDrift"}, status="firing", starts_at=T0,
                  annotations={"summary": "TTFT p95 up", "explanation": "queue time it is"})
    assert grafana_annotation([alert])["text"] == "FIRING: TTFT p95 up\nwhy: queue time it is"
    assert slack_body([alert])["text"].endswith("TTFT p95 up\nwhy: queue time it is")


def test_a_mean_over_several_series_weighs_each_by_its_observations():
    """An alert's series may span several (its labels pin fewer than a name's series
    carry): their means join by observations, not one vote a series."""
    from ac_observe.daemon.alerting.explain import Reader, Span

    class Series:
        def query(self, metric, window_seconds, labels, now=None):
            return {"series": [{"mean": 10e6, "samples": 3}, {"mean": 40e6, "samples": 1},
                               {"mean": float("nan"), "samples": 0}]}
    reader = Reader(Series(), {"engine": "e1"})
    span = Span(T0, T0 + 10)
    assert reader.value("queue_time_ns", span, "mean") == pytest.approx(17.5e6)
    assert reader.histogram("queue_time_ns", span) == (pytest.approx(0.0175), 4)


def _prefill_out(prompt: tuple, hit_rate: tuple, prefill_ms: tuple, diverged: tuple) -> dict:
    """An explanation whose prefill part rose: prompt tokens/request, token hit rate (%),
    prefill ms and diverged misses (%), each (baseline, now)."""
    from ac_observe.daemon.alerting.explain import verdict

    def cause(group, name, pair, worse=1, metric="x"):
        return {"group": group, "name": name, "metric": metric, "worse": worse,
                "baseline": pair[0], "now": pair[1]}
    change = prefill_ms[1] - prefill_ms[0]
    out = {"metric": "inference_latency_ns", "split": "mean", "mean": {"change_ms": change},
           "statistic": {"name": "p95", "unit": "ns", "comparison": "relative_increase",
                         "change_percent": 100.0, "baseline": 1.0, "now": 2.0},
           "parts": [{"name": "prefill", "metric": "request_prefill_ms",
                      "baseline_ms": prefill_ms[0], "now_ms": prefill_ms[1],
                      "change_ms": change, "share": 1.0}],
           "causes": [cause("kv", "misses diverged", diverged, metric="kv_cache_miss_reasons"),
                      cause("kv", "token hit rate", hit_rate, -1),
                      cause("prompts", "prompt tokens/request", prompt, metric=""),
                      cause("kv", "cached tokens/request",
                            tuple(p * h / 100 for p, h in zip(prompt, hit_rate, strict=True)),
                            -1, metric="")]}
    return verdict(out)


def test_prefill_work_leads_the_causes_when_it_grew_as_much_as_the_time():
    """Computed tokens = prompt - cached. Long prompts (176 -> 740 tokens, the cache still
    serving ~155) add the work, though the diverged misses' share moved more (7.5 -> 66 %);
    a flushed cache (90 % -> 0) removes the served tokens; a slower engine computes the
    same tokens (1.25x: under the square root of its prefill's 4x) in more time: no lead,
    the ranking by how far each moved stands. Long prompts whose prefill grew faster than
    their work (29x against 20x: attention) still lead."""
    assert _prefill_out((176, 740), (88, 22), (250, 1250), (7.5, 66)).endswith(
        "(prompt tokens/request 4.2x baseline, misses diverged 8.8x baseline)")
    assert _prefill_out((440, 460), (90, 0), (200, 650), (10, 10)).endswith(
        "(cached tokens/request 396 -> 0, token hit rate 90 -> 0)")
    assert _prefill_out((176, 740), (88, 22), (250, 7250), (7.5, 66)).endswith(
        "(prompt tokens/request 4.2x baseline, misses diverged 8.8x baseline)")
    slower = _prefill_out((440, 460), (90, 88), (200, 800), (7.5, 9.5))
    assert slower.endswith("(misses diverged 7.5 -> 9.5)"), slower


def test_up_takes_one_of_the_demo_drivers_causes_and_nothing_else():
    from typer.testing import CliRunner

    from ac_observe.daemon.cli import app
    from ac_observe.daemon.cli.up import DriftCause
    from ac_observe.daemon.demo_drift import CAUSES, DriftDriver
    assert tuple(cause.value for cause in DriftCause) == CAUSES
    runner = CliRunner()
    bad = runner.invoke(app, ["up", "--demo-drift", "--demo-drift-cause", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
    alone = runner.invoke(app, ["up", "--demo-drift-cause", "load"])
    assert alone.exit_code == 2 and "add --demo-drift" in alone.output
    with pytest.raises(ValueError, match="steps, load, cache, prompts"):
        DriftDriver("http://127.0.0.1:9", "http://127.0.0.1:9", 1, 1, cause="nope")
    # A burst's engine takes 4 a lane into a batch (as the cause's live test runs it),
    # unless the user said otherwise; the other causes leave the batch alone.
    from ac_observe.daemon.demo_drift import demo_engine_args
    assert demo_engine_args("load", []) == ["--fault-injection", "--throughput-seqs", "4"]
    assert demo_engine_args("load", ["--throughput-seqs", "8"]) == ["--fault-injection"]
    assert demo_engine_args("steps", []) == ["--fault-injection"]


def _queue_out(arrivals: tuple, inter_token: tuple, waiting: tuple,
               batch: tuple = (None, None)) -> str:
    """The verdict of an explanation whose queue part rose, with these causes."""
    from ac_observe.daemon.alerting.explain import verdict

    def cause(group, name, pair, metric="x"):
        return {"group": group, "name": name, "metric": metric, "worse": 1,
                "baseline": pair[0], "now": pair[1]}
    return verdict({
        "metric": "inference_latency_ns", "split": "mean", "mean": {"change_ms": 100.0},
        "statistic": {"name": "p95", "unit": "ns", "comparison": "relative_increase",
                      "change_percent": 100.0, "baseline": 1.0, "now": 2.0},
        "parts": [{"name": "queue", "metric": "queue_time_ns", "baseline_ms": 10.0,
                   "now_ms": 110.0, "change_ms": 100.0, "share": 1.0}],
        "causes": [cause("engine", "inter-token", inter_token, "inter_token_latency_ms"),
                   cause("load", "waiting", waiting, "requests_waiting"),
                   cause("load", "arrivals/s", arrivals, ""),
                   cause("load", "decode batch", batch, "batch_sequences")]})


def test_a_queue_that_grew_with_its_arrivals_names_them_first():
    """A burst: more arrivals lead, though its bigger batches slowed each step more; a
    slower engine (arrivals down: its closed-loop clients send fewer) does not."""
    assert _queue_out((4.0, 6.0), (20.0, 400.0), (0.1, 2.0)).endswith(
        "(arrivals/s 4 -> 6, inter-token 20.0x baseline)")
    assert _queue_out((4.0, 3.0), (20.0, 400.0), (0.1, 2.0)).endswith(
        "(inter-token 20.0x baseline, waiting 20.0x baseline)")
    # The batch grew with the load (2 -> 4 a step): the arrivals still lead. The steps
    # 20x slower with the batch no bigger: the engine slowed by itself, and a few more
    # arrivals (1.5x) do not lead; they would had the steps slowed less than they rose.
    assert _queue_out((4.0, 6.0), (20.0, 400.0), (0.1, 2.0), (2.0, 4.0)).endswith(
        "(arrivals/s 4 -> 6, inter-token 20.0x baseline)")
    assert _queue_out((4.0, 6.0), (20.0, 400.0), (0.1, 2.0), (4.0, 4.0)).endswith(
        "(inter-token 20.0x baseline, waiting 20.0x baseline)")
    assert _queue_out((4.0, 6.0), (20.0, 26.0), (0.1, 2.0), (4.0, 4.0)).endswith(
        "(arrivals/s 4 -> 6, waiting 20.0x baseline)")


def test_demo_traffic_says_once_a_status_the_engine_refuses_it_with(caplog):
    """A long-prompt drift past a small model's context is refused (400): the demo says so,
    once a status, rather than reading the refusals' figures as the drift's."""
    import random

    from ac_observe.daemon import demo_load
    transport = httpx.MockTransport(lambda request: httpx.Response(400, json={"error": "x"}))
    demo_load._REFUSALS_SAID.clear()
    with httpx.Client(transport=transport, base_url="http://engine") as client:
        for n in range(6):
            demo_load._one_request(client, random.Random(n), n, repeat=24)
    said = [r.getMessage() for r in caplog.records if "answers 400" in r.getMessage()]
    assert len(said) == 1, said


def test_vllm_and_sglang_are_explained_with_the_parts_they_export(tmp_path):
    """Captures of a real vLLM V1 and SGLang 0.4 (tests/data/engines), replayed and read by
    the scrape collector. vLLM exports queue and prefill-phase time: they split its TTFT's
    mean, and its front-end (arrival to queued: only in its TTFT) is missing, said so,
    left in the residual. SGLang 0.4 exports no part: each is missing, the whole change
    is the residual's, and the verdict does not pretend otherwise."""
    from support.engine_replay import EngineReplay
    vllm, sglang = EngineReplay("vllm_v1_0.10.prom"), EngineReplay("sglang_0.4.prom")
    path = tmp_path / "alerts.yaml"
    path.write_text("rules:\n  - {name: TtftDrift, metric: inference_latency_ns, "
                    "statistic: p95, window: 10s, baseline: 'trailing:20s', "
                    "comparison: relative_increase, threshold: 0.5}\n")
    daemon = Daemon(DaemonConfig(
        telemetry_root=tmp_path / "t", collectors=(), history=False,
        engine_endpoints=(("vllm-a", vllm.url), ("sglang-a", sglang.url)),
        interval_seconds=1.0, window_seconds=600, alerting_file=path,
        state_dir=tmp_path / "state", alert_interval_seconds=1.0))
    try:
        for t in range(DRIFT_AT + 16):
            drift = t >= DRIFT_AT
            # vLLM, 10 requests a cycle: 5 ms before the queue, queue 10 ms then 8 of 10
            # at 10 ms and 2 at 510 ms (mean 110), prefill phase 40 then 50 ms.
            queues = ((0.010, 8), (0.510, 2)) if drift else ((0.010, 10),)
            prefill = 0.050 if drift else 0.040
            for queue, times in queues:
                vllm.observe("vllm:request_queue_time_seconds", queue, times)
                vllm.observe("vllm:time_to_first_token_seconds", 0.005 + queue + prefill,
                             times)
            vllm.observe("vllm:request_prefill_time_seconds", prefill, 10)
            sglang.observe("sglang:time_to_first_token_seconds", 0.3 if drift else 0.1, 10)
            daemon.run_cycle(now=T0 + t)
        alerts = _alerts(daemon)
        assert {a["state"] for a in alerts.values()} == {FIRING}, alerts
        found = alerts["vllm-a"]["explanation"]
        assert (found["mean"]["baseline_ms"], found["mean"]["now_ms"]) == (
            pytest.approx(55.0), pytest.approx(165.0))
        parts = _by_name(found["parts"])
        assert list(parts) == ["front-end", "queue", "prefill", "unexplained"]
        assert (parts["front-end"]["baseline_ms"], parts["front-end"]["now_ms"],
                parts["front-end"]["share"]) == (None, None, None)
        for name, (baseline, now) in {"queue": (10, 110), "prefill": (40, 50)}.items():
            assert (parts[name]["baseline_ms"], parts[name]["now_ms"]) == (
                pytest.approx(baseline, abs=1e-6), pytest.approx(now, abs=1e-6)), name
            assert parts[name]["share"] == pytest.approx((now - baseline) / 110), name
        residual = parts["unexplained"]
        assert residual["includes_missing"] == ["front-end"]
        assert (residual["baseline_ms"], residual["now_ms"]) == (pytest.approx(5.0),
                                                                 pytest.approx(5.0))
        assert found["verdict"].split(" (")[0].endswith(
            ": queue time +100 ms is 91 % of the mean's change")
        # vLLM counts tokens a step, not sequences: its batch is missing, never 0.
        causes = _by_name(found["causes"])
        for name in ("prefill batch", "decode batch"):
            assert (causes[name]["baseline"], causes[name]["now"]) == (None, None), name

        found = alerts["sglang-a"]["explanation"]
        assert (found["mean"]["baseline_ms"], found["mean"]["now_ms"]) == (
            pytest.approx(100.0), pytest.approx(300.0))
        parts = _by_name(found["parts"])
        for name in ("front-end", "queue", "prefill"):
            assert (parts[name]["baseline_ms"], parts[name]["now_ms"]) == (None, None), name
        assert parts["unexplained"]["includes_missing"] == ["front-end", "queue", "prefill"]
        assert parts["unexplained"]["share"] == pytest.approx(1.0)
        assert "queue time" not in found["verdict"] and "prefill time" not in found["verdict"]
    finally:
        daemon.close()
        vllm.close()
        sglang.close()


def test_a_gateways_ttft_is_split_into_its_upstreams_parts(tmp_path):
    """A gateway has no queue or KV of its own: its TTFT (the client's side) is split into
    the parts of the upstream engine its `upstream` label names, in its lane, read from
    both writers' telemetry files by the daemon's engine collector. The residual is the
    gateway's hop (3 ms here, in both spans); the verdict names whose the part is, and a
    gateway that slowed itself is not said to be its upstream. An upstream known by its
    address only has no parts: missing."""
    import time

    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter

    root = tmp_path / "telemetry"
    started = {"started_at": time.time()}
    engine = TelemetryWriter(root / "e1", started, engine="e1", model="m")
    gateways = {name: TelemetryWriter(
        root / name, {**started, "kind": m.KIND_GATEWAY, "upstream": upstream},
        engine=name, model="m", specs=m.GATEWAY_METRICS)
        for name, upstream in (("gw1", "e1"), ("gw2", "10.0.0.7:8000"), ("gw3", "e1"))}
    path = tmp_path / "alerts.yaml"
    path.write_text("rules:\n  - {name: GatewayTtft, metric: inference_latency_ns, "
                    "statistic: p95, window: 10s, baseline: 'trailing:20s', "
                    "comparison: relative_increase, threshold: 0.5, "
                    "match: {kind: gateway}}\n")
    config = DaemonConfig(telemetry_root=root, collectors=(), interval_seconds=1.0,
                          window_seconds=600, alerting_file=path, state_dir=tmp_path / "state",
                          alert_interval_seconds=1.0)
    daemon = Daemon(config, collectors=[EngineCollector(config)])
    t0 = time.time() - 60
    try:
        for t in range(DRIFT_AT + 16):
            # e1, 10 requests a cycle: front-end 5 ms, queue 10 ms then 8 at 10 ms and 2
            # at 510 ms (mean 110), prefill phase 40 ms; the gateway adds 3 ms to each.
            queues = ((0.010, 8), (0.510, 2)) if t >= DRIFT_AT else ((0.010, 10),)
            for queue, times in queues:
                for _ in range(times):
                    ttft = 0.005 + queue + 0.040
                    engine.observe(m.FRONTEND, 0.005, stream=LANE)
                    engine.observe(m.QUEUE_TIME, queue, stream=LANE)
                    engine.observe(m.REQUEST_PREFILL, 0.040, stream=LANE)
                    engine.observe(m.INFERENCE_LATENCY, ttft, stream=LANE)
                    for name, gateway in gateways.items():
                        # gw3 itself slows by 200 ms as e1's queue grows
                        hop = 0.203 if name == "gw3" and t >= DRIFT_AT else 0.003
                        gateway.observe(m.INFERENCE_LATENCY, ttft + hop, stream=LANE)
            daemon.run_cycle(now=t0 + t)
        alerts = {a["labels"]["engine"]: a for a in daemon.alerts.explained()
                  if a["rule"] == "GatewayTtft"}
        assert {name: a["state"] for name, a in alerts.items()} == {
            "gw1": FIRING, "gw2": FIRING, "gw3": FIRING}
        found = alerts["gw1"]["explanation"]
        assert found["parts_from"] == "e1"
        assert (found["mean"]["baseline_ms"], found["mean"]["now_ms"]) == (
            pytest.approx(58.0), pytest.approx(158.0))
        parts = _by_name(found["parts"])
        expected = {"front-end": (5, 5), "queue": (10, 110), "prefill": (40, 40),
                    "unexplained": (3, 3)}
        assert list(parts) == list(expected)
        for name, (baseline, now) in expected.items():
            assert (parts[name]["baseline_ms"], parts[name]["now_ms"]) == (
                pytest.approx(baseline, abs=1e-6), pytest.approx(now, abs=1e-6)), name
        assert found["verdict"].split(" (")[0].endswith(
            ": e1's queue time +100 ms is 100 % of the mean's change")
        # gw3's own 200 ms is its residual's, never said to be e1's.
        assert alerts["gw3"]["explanation"]["verdict"].split(" (")[0].endswith(
            ": the gateway's own time and the rest +200 ms is 67 % of the mean's change")
        other = alerts["gw2"]["explanation"]
        assert "parts_from" not in other
        assert all(p["now_ms"] is None for p in other["parts"] if p["name"] != "unexplained")
    finally:
        engine.close()
        for gateway in gateways.values():
            gateway.close()
        daemon.close()
