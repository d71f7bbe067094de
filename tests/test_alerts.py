"""Drift alert rules: the file's checks, the state machine on the daemon's real windows and
query engine (a collector the test feeds), persistence across a restart, and the whole
chain against a live engine whose steps are slowed through its fault-injection route."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from ac_observe import metrics as m
from ac_observe.collectors.base import Collector, new_family
from ac_observe.daemon.alerting.file import load_alerting_config
from ac_observe.daemon.alerting.spec import AlertConfigError
from ac_observe.daemon.alerting.state import FIRING, PENDING
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.daemon.store import deliveries
from support.receivers import SECRET, WebhookReceiver
from support.servers import AC_OBSERVE, EngineServer, wait_for

USAGE = m.KV_USAGE  # a gauge: kv_cache_usage, in % (scale 100)
FAULT_TOKEN = "fault-token-for-tests"
FAULT_ENV = {"AC_OBSERVE_FAULT_TOKEN": FAULT_TOKEN}
FAULT_AUTH = {"authorization": f"Bearer {FAULT_TOKEN}"}


class _Gauges(Collector):
    """Publishes the KV usage gauge of two engines at whatever the test sets."""
    name = "test"

    def __init__(self):
        self.values = {"e1": 0.5, "e2": 0.5}

    def collect(self):
        family = new_family(USAGE)
        for engine, value in self.values.items():
            family.add_metric([engine, "m"], value)
        return [family]


def _write(tmp_path, rules: str, receivers: bool = True, url: str = "http://127.0.0.1:9/x"):
    path = tmp_path / "alerts.yaml"
    text = ""
    if receivers:
        text += f"receivers:\n  - {{name: ops, url: '{url}', secret: '{SECRET}'}}\n"
    path.write_text(text + "rules:\n" + rules)
    return path


RULES = """\
  - name: KvUsageHigh
    metric: kv_cache_usage
    statistic: last
    window: 3s
    comparison: above
    threshold: 80
    for: 4s
    severity: critical
    match: {engine: e1}
    labels: {team: infra}
    annotations: {summary: "KV {{ value }} % on {{ labels }}"}
  - name: KvUsageDrift
    metric: kv_cache_usage
    statistic: mean
    window: 2s
    baseline: trailing:4s
    comparison: relative_increase
    threshold: 0.5
    match: {engine: e2}
"""


def _daemon(tmp_path, path, collector) -> Daemon:
    return Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                               interval_seconds=1.0, window_seconds=600, alerting_file=path,
                               state_dir=tmp_path / "state", alert_interval_seconds=1.0,
                               node_name="gpu-node-7"),
                  collectors=[collector])


def _outbox(daemon) -> list[dict]:
    import sqlalchemy as sa
    with daemon.store.engine.connect() as connection:
        return [dict(r) for r in connection.execute(
            sa.select(deliveries).order_by(deliveries.c.created_at)).mappings()]


def test_states_for_resolution_and_outbox_rows_written_with_the_transition(tmp_path):
    gauges = _Gauges()
    daemon = _daemon(tmp_path, _write(tmp_path, RULES), gauges)
    t0 = 1_000_000.0
    states = []

    def tick(t, e1=None, e2=None):
        if e1 is not None:
            gauges.values["e1"] = e1
        if e2 is not None:
            gauges.values["e2"] = e2
        daemon.run_cycle(now=t0 + t)
        states.append({(a["rule"], a["labels"]["engine"]): a["state"]
                       for a in daemon.alerts.active()})

    for t in range(0, 6):
        tick(t, e1=0.5, e2=0.5)
    assert states[-1] == {}
    # e1 crosses 80 % at t=6: pending, and firing once it has held for 4 s (t=10).
    for t in range(6, 10):
        tick(t, e1=0.95)
    assert [s.get(("KvUsageHigh", "e1")) for s in states[6:]] == [PENDING] * 4
    tick(10)
    assert states[-1][("KvUsageHigh", "e1")] == FIRING
    # One good sample does not resolve it; two evaluations in a row do.
    tick(11, e1=0.1)
    tick(12, e1=0.95)
    tick(13, e1=0.1)
    assert states[-1][("KvUsageHigh", "e1")] == FIRING
    tick(14)
    assert ("KvUsageHigh", "e1") not in states[-1]
    for t in range(15, 19):
        tick(t)
    # e2 doubles: its 2 s mean against the 4 s before: at t=19 (50, 50, 100: +33 %) not
    # yet, at t=20 (50, 100, 100: 83.3 against 50, +67 %) it fires at once (no `for`).
    tick(19, e2=1.0)
    assert ("KvUsageDrift", "e2") not in states[-1]
    tick(20)
    assert states[-1].get(("KvUsageDrift", "e2")) == FIRING
    assert ("KvUsageDrift", "e1") not in states[-1]
    outbox = _outbox(daemon)
    assert [(r["kind"], json.loads(r["body"])["alerts"][0]["labels"]["alertname"])
            for r in outbox] == [("firing", "KvUsageHigh"), ("resolved", "KvUsageHigh"),
                                 ("firing", "KvUsageDrift")]
    firing = json.loads(outbox[0]["body"])
    (alert,) = firing["alerts"]
    # The daemon's node on every alert it sends, as on every series it exports.
    assert alert["labels"] == {"alertname": "KvUsageHigh", "severity": "critical",
                               "team": "infra", "node": "gpu-node-7", "engine": "e1",
                               "model": "m"}
    assert alert["annotations"]["summary"] == "KV 95 % on engine=e1, model=m, node=gpu-node-7"
    assert alert["annotations"]["baseline_source"] == "static"
    resolved = json.loads(outbox[1]["body"])["alerts"][0]
    assert resolved["status"] == "resolved" and resolved["endsAt"] != "0001-01-01T00:00:00Z"
    drift = json.loads(outbox[2]["body"])["alerts"][0]["annotations"]
    assert float(drift["value"]) == pytest.approx(83.33, abs=0.01)
    assert float(drift["baseline"]) == 50.0
    assert drift["baseline_source"] == "trailing 4 s before the window"
    history = daemon.alerts.history()
    assert [(h["rule"], h["from_state"], h["to_state"]) for h in reversed(history)] == [
        ("KvUsageHigh", "inactive", "pending"), ("KvUsageHigh", "pending", "firing"),
        ("KvUsageHigh", "firing", "resolved"), ("KvUsageDrift", "inactive", "pending"),
        ("KvUsageDrift", "pending", "firing")]
    # What a transition's value and baseline measure (the CLI prints them in its unit).
    assert {h["rule"]: (h["metric"], h["statistic"]) for h in history} == {
        "KvUsageHigh": ("kv_cache_usage", "last"), "KvUsageDrift": ("kv_cache_usage", "mean")}
    metrics = daemon.render_metrics().decode()
    assert 'ac_alerts_firing{node="gpu-node-7",rule="KvUsageDrift",severity="warning"} 1.0' \
        in metrics
    assert 'ac_alerts_firing{node="gpu-node-7",rule="KvUsageHigh",severity="critical"} 0.0' \
        in metrics
    daemon.close()

    # A restart keeps the firing alert: no second firing delivery, and it resolves later.
    again = _daemon(tmp_path, _write(tmp_path, RULES), gauges)
    assert [(a["rule"], a["state"]) for a in again.alerts.active()] == \
        [("KvUsageDrift", FIRING)]
    # Its baseline stays frozen at 50 while it fires (its trailing window has long caught
    # up with 100 by t=40): the problem is still there, so it does not resolve.
    for t in range(21, 40):
        gauges.values["e2"] = 1.0
        again.run_cycle(now=t0 + t)
    assert [(a["rule"], a["state"], a["baseline"]) for a in again.alerts.active()] == \
        [("KvUsageDrift", FIRING, 50.0)]
    assert len(_outbox(again)) == 3
    again.close()


def test_with_a_grafana_url_alerts_are_marked_on_the_dashboards(tmp_path):
    """`--grafana-url`: every transition of a rule becomes an annotation in that Grafana,
    tagged for the dashboards' `ac-observe alerts` query, beside the file's receivers."""
    from support.grafana import Grafana
    grafana, gauges = Grafana("glsa_k"), _Gauges()
    try:
        daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                     interval_seconds=1.0, window_seconds=600,
                                     alerting_file=_write(tmp_path, RULES, receivers=False),
                                     state_dir=tmp_path / "state", alert_interval_seconds=1.0,
                                     grafana_url=grafana.url, grafana_token="glsa_k"),
                        collectors=[gauges])
        t0 = float(int(time.time()))  # (history is kept 8 days back from the clock)
        for t in range(0, 16):
            gauges.values["e1"] = 0.95 if 2 <= t < 10 else 0.5
            daemon.run_cycle(now=t0 + t)
        assert daemon.webhooks.run_once() == 2
        daemon.close()
        fired, resolved = grafana.annotations
        # Pending from t=2, firing (its start) at t=6 (`for: 4s`), resolved at the second
        # miss (t=11).
        assert (fired["time"], fired["timeEnd"]) == (int(t0 + 6) * 1000,) * 2
        assert (resolved["time"], resolved["timeEnd"]) == (int(t0 + 6) * 1000,
                                                          int(t0 + 11) * 1000)
        assert {"ac-observe", "firing", "alertname:KvUsageHigh", "engine:e1",
                "team:infra"} <= set(fired["tags"])
        assert fired["text"].startswith("FIRING: KV 95 % on engine=e1")
        assert "resolved" in resolved["tags"] and resolved["text"].startswith("RESOLVED: ")
        assert {h["authorization"] for _, _, h in grafana.requests} == {"Bearer glsa_k"}
    finally:
        grafana.close()
    # A file receiver already named `grafana` is a clash, named as such.
    path = tmp_path / "clash.yaml"
    path.write_text(f"receivers:\n  - {{name: grafana, url: 'http://h/', secret: '{SECRET}'}}"
                    "\nrules: defaults\n")
    with pytest.raises(ValueError, match="--grafana-url adds a receiver named 'grafana'"):
        Daemon(DaemonConfig(telemetry_root=tmp_path / "t", alerting_file=path,
                            state_dir=tmp_path / "state", grafana_url="http://g:3000"))


def test_no_data_changes_nothing(tmp_path):
    gauges = _Gauges()
    daemon = _daemon(tmp_path, _write(tmp_path, RULES, receivers=False), gauges)
    t0 = 2_000_000.0
    for t in range(0, 10):
        gauges.values["e1"] = 0.95
        daemon.run_cycle(now=t0 + t)
    assert [a["state"] for a in daemon.alerts.active()] == [FIRING]
    gauges.values = {"e2": 0.5}  # e1's series is gone
    for t in range(10, 40):
        daemon.run_cycle(now=t0 + t)
    (alert,) = daemon.alerts.active()
    assert alert["state"] == FIRING and alert["no_data"]
    daemon.close()


@pytest.mark.parametrize("rule, where", [
    ("  - {name: a, metric: nope, window: 1m, comparison: above, threshold: 1}\n",
     "rules[0] (a).metric: 'nope' is not a metric name"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, threshold: 1}\n",
     "rules[0] (a).baseline: required"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, baseline: 'yesterday', threshold: 1}\n",
     "rules[0] (a).baseline: 'yesterday': use trailing"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, baseline: 'trailing:x', threshold: 1}\n",
     "rules[0] (a).baseline: bad duration"),
    ("  - {name: a, metric: kv_cache_usage, window: soon, comparison: above, threshold: 1}\n",
     "rules[0] (a).window: bad duration"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: hi}\n",
     "rules[0] (a).threshold: a number is required"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above}\n",
     "rules[0] (a).threshold: required"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: sideways, threshold: 1}\n",
     "rules[0] (a).comparison: 'sideways' is not one of"),
    ("  - {name: a, metric: kv_cache_usage, statistic: p42, window: 1m, comparison: above, "
     "threshold: 1}\n", "rules[0] (a).statistic: 'p42' is not one of"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1, "
     "severity: page}\n", "rules[0] (a).severity: 'page' is not one of"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1, "
     "annotations: {summary: '{{ vlaue }}'}}\n",
     "rules[0] (a).annotations.summary: unknown field {{ vlaue }}"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1, "
     "labels: {alertname: b}}\n", "rules[0] (a).labels: 'alertname' is set by the rule"),
    ("  - {name: 'a b', metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1}\n",
     "rules[0].name: 'a b' is not a metric-style name"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1}\n"
     "  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 2}\n",
     "rules[1] (a).name: 'a' is used twice"),
    ("  - {name: a, metric: kv_cache_usage, window: 1m, comparison: above, threshold: 1, "
     "when: now}\n", "rules[0]: unknown field 'when'"),
    ("  - {name: a, metric: kv_cache_usage, statistic: 'share_below:5', window: 1m, "
     "comparison: above, threshold: 1}\n",
     "rules[0] (a).statistic: 'share_below' does not apply to kv_cache_usage (a gauge)"),
    ("  - {name: a, metric: inference_latency_ns, statistic: max, window: 1m, "
     "comparison: above, threshold: 1}\n",
     "rules[0] (a).statistic: 'max' does not apply to inference_latency_ns (a histogram)"),
    ("  - {name: a, metric: kv_cache_hit_rate, statistic: rate, window: 1m, "
     "comparison: above, threshold: 1}\n",
     "rules[0] (a).statistic: 'rate' does not apply to kv_cache_hit_rate (a ratio)"),
    ("  - {name: a, metric: skeleton_complexity, statistic: 'share_below:2ms', window: 1m, "
     "comparison: above, threshold: 1}\n",
     "rules[0] (a).statistic: skeleton_complexity is in 'levels', not a time"),
    ("  - {name: a, metric: inference_latency_ns, statistic: 'share_below:fast', window: 1m, "
     "comparison: above, threshold: 1}\n",
     "rules[0] (a).statistic: 'share_below:fast': use share_below:<v>"),
    ("  - {name: a, metric: kv_cache_hit_rate, statistic: 'share_below:200ms', window: 1m, "
     "comparison: above, threshold: 1}\n",  # not applicable before not a time
     "rules[0] (a).statistic: 'share_below' does not apply to kv_cache_hit_rate (a ratio)"),
    ("  - {name: a, metric: inference_latency_ns, window: 1m, comparison: above, threshold: 1,"
     " match: {strem: low_latency}}\n",
     "rules[0] (a).match: inference_latency_ns's series have no label 'strem' (labels: node, "
     "engine, model, stream, kind, pid, container_id, pod_uid, namespace, pod, container, "
     "upstream)"),
    ("  - {name: a, metric: inference_latency_ns, window: 1m, comparison: above, threshold: 1,"
     " match: {stream: ''}}\n", "rules[0] (a).match.stream: give a label value"),
])
def test_a_bad_rule_names_the_file_the_rule_and_the_field(tmp_path, rule, where):
    path = _write(tmp_path, rule)
    with pytest.raises(AlertConfigError) as error:
        load_alerting_config(path)
    assert str(error.value).startswith(f"{path}: ") and where in str(error.value), error.value


@pytest.mark.slow
def test_a_live_engine_slowed_down_fires_the_latency_drift_alert_and_then_resolves(
        tmp_path):
    """Engine (real server, --fault-injection) and daemon with short windows; a client
    keeps sending requests; an added step delay drives TTFT p95 up; the alert fires within
    window + for + two cycles and the receiver verifies the Alertmanager-v4 body's
    signature; the delay removed, a resolved delivery follows."""
    receiver = WebhookReceiver()
    (tmp_path / "telemetry").mkdir()
    engine = EngineServer(tmp_path / "telemetry" / "e1", "--fault-injection",
                          "--engine-name", "e1", env=FAULT_ENV).wait_ready()
    rules = """\
  - name: TtftDrift
    metric: inference_latency_ns
    statistic: p95
    window: 3s
    baseline: trailing:6s
    comparison: relative_increase
    threshold: 1.0
    for: 1s
    match: {stream: low_latency}
    annotations: {summary: "TTFT p95 {{ value }} ns, {{ delta_percent }} % over baseline"}
"""
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "telemetry", collectors=("engine",),
                                 interval_seconds=0.25, window_seconds=120,
                                 alerting_file=_write(tmp_path, rules, url=receiver.url),
                                 state_dir=tmp_path / "state", alert_interval_seconds=0.5))
    stop = threading.Event()
    errors: list[str] = []

    def traffic():
        with httpx.Client(timeout=30) as client:
            i = 0
            while not stop.is_set():
                try:
                    client.post(engine.url + "/v1/messages",
                                headers={"x-ac-stream": "low_latency"},
                                json={"model": "tiny", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": f"q{i}"}]})
                except httpx.HTTPError as exc:  # keep the load going; the test says why
                    errors.append(repr(exc))
                i += 1

    sender = threading.Thread(target=traffic, daemon=True)
    daemon.start()
    sender.start()
    try:
        # A baseline: enough of the 6 s before the 3 s window watched.
        wait_for(lambda: any(i.rule == "TtftDrift" and i.baseline is not None
                             for i in list(daemon.alerts.instances.values())), 60,
                 "the low_latency series' trailing baseline")
        # (a loaded machine's own hiccup may make it pending for a moment: quiet first)
        wait_for(lambda: daemon.alerts.active() == [], 30, "no alert before the fault")
        httpx.post(engine.url + "/admin/faults", json={"step_delay_ms": 300},
                   headers=FAULT_AUTH).raise_for_status()
        injected = time.time()
        fired = None
        while fired is None and time.time() - injected < 30:
            for a in daemon.alerts.active():
                if a["state"] == FIRING:  # at the evaluation's own time, not this poll's
                    fired = a["firing_since"] - injected
            time.sleep(0.05)
        instances = [(i.rule, i.labels, i.state, i.value, i.baseline)
                     for i in daemon.alerts.instances.values()]
        assert fired is not None, \
            f"the drift alert never fired (client errors: {errors[:3]}; {instances})"
        assert time.time() - injected < 15  # the evaluator's state followed soon after
        assert fired <= 3 + 1 + 2 * 0.5 + 1.0, fired  # window + for + two cycles (+ slack)
        deadline = time.time() + 20
        while not receiver.requests and time.time() < deadline:
            time.sleep(0.05)
        assert receiver.requests, "no firing delivery"
        first, body = receiver.requests[0]  # (a slow receiver may see a retry of it too)
        payload = Webhook(SECRET).verify(body, first)
        assert payload["version"] == "4" and payload["status"] == "firing"
        (alert,) = payload["alerts"]
        assert alert["labels"]["alertname"] == "TtftDrift"
        assert alert["labels"]["stream"] == "low_latency" and alert["labels"]["engine"] == "e1"
        assert alert["annotations"]["summary"].startswith("TTFT p95 ")
        httpx.post(engine.url + "/admin/faults", json={"step_delay_ms": 0},
                   headers=FAULT_AUTH).raise_for_status()
        seen = len(receiver.requests)

        def last_status():
            headers, body = receiver.requests[-1]
            return (len(receiver.requests) > seen
                    and Webhook(SECRET).verify(body, headers)["status"] == "resolved"
                    and headers)

        headers = wait_for(last_status, 40, "a resolved delivery once the fault is gone")
        assert headers["webhook-id"] != first["webhook-id"]
    finally:
        stop.set()
        sender.join(timeout=30)
        daemon.close()
        engine.stop()
        receiver.down()


@pytest.mark.slow
def test_fault_injection_is_off_unless_asked_for(engine_server):
    answer = httpx.post(engine_server.url + "/admin/faults", json={"step_delay_ms": 5})
    assert answer.status_code == 404 and "--fault-injection" in answer.text


def test_the_shipped_rules_load_and_print_as_a_file_that_loads(tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "alerts.yaml"
    path.write_text("rules: defaults\n")
    _, rules = load_alerting_config(path)
    by_name = {r.name: r for r in rules}
    assert by_name["InferenceLatencyDrift"].threshold == 0.15
    assert by_name["KvCacheHitRateDrop"].comparison == "absolute_decrease"
    assert by_name["KvCacheHitRateLow"].threshold == 85
    assert by_name["CudaStreamSaturated"].for_seconds == 10
    assert by_name["CollectorDown"].metric == "collector_up"
    fast = by_name["FastRequestsShareDrop"]  # 200 ms in the metric's unit (ns)
    assert (fast.statistic, fast.share_threshold) == ("share_below:200ms", 2e8)
    assert (by_name["EngineGone"].metric, by_name["EngineGone"].for_seconds) == ("engine_up", 60)
    printed = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ac-observe"),
                              "alerts", "defaults"], capture_output=True, text=True, check=True)
    copy = tmp_path / "copy.yaml"
    copy.write_text(printed.stdout)
    assert load_alerting_config(copy)[1] == rules


def test_collector_down_rule_fires_on_the_daemons_own_health(tmp_path):
    class Broken(Collector):
        name = "broken"

        def collect(self):
            raise RuntimeError("no source")

    path = tmp_path / "alerts.yaml"
    path.write_text("rules: defaults\n")
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=1.0, window_seconds=600, alerting_file=path,
                                 state_dir=tmp_path / "state", alert_interval_seconds=1.0),
                    collectors=[Broken(), _Gauges()])
    t0 = 3_000_000.0
    for t in range(0, 125):
        daemon.run_cycle(now=t0 + t)
    firing = {(a["rule"], a["labels"].get("collector")) for a in daemon.alerts.active()
              if a["state"] == FIRING}
    assert ("CollectorDown", "broken") in firing and ("CollectorDown", "test") not in firing
    daemon.close()


@pytest.mark.slow
def test_fault_injection_takes_json_from_this_host_only_with_its_token(tmp_path):
    (tmp_path / "t").mkdir()
    refused = subprocess.run([AC_OBSERVE, "engine", "--fault-injection", "--telemetry-dir",
                              str(tmp_path / "t" / "e0")], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items()
                                              if k != "AC_OBSERVE_FAULT_TOKEN"})
    assert refused.returncode == 2 and "needs a token" in refused.stderr, refused.stderr
    token_file = tmp_path / "fault-token"
    token_file.write_text(FAULT_TOKEN + "\n")
    engine = EngineServer(tmp_path / "t" / "e1", "--fault-injection", "--fault-token-file",
                          str(token_file)).wait_ready()
    try:
        url = engine.url + "/admin/faults"
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": FAULT_TOKEN},
                        {"authorization": "Basic " + FAULT_TOKEN}):
            answer = httpx.post(url, json={"step_delay_ms": 5}, headers=headers)
            assert answer.status_code == 401 and "fault token" in answer.text, headers
            assert httpx.get(url, headers=headers).status_code == 401
        assert httpx.get(url, headers=FAULT_AUTH).json()["step_delay_ms"] == 0  # unchanged
        assert httpx.post(url, content=b'{"step_delay_ms": 5}', headers={
            **FAULT_AUTH, "content-type": "text/plain"}).status_code == 415
        assert httpx.post(url, json={"step_delay_ms": 20000}, headers=FAULT_AUTH
                          ).status_code == 400
        assert httpx.post(url, json={"prefix_miss_ratio": 2}, headers=FAULT_AUTH
                          ).status_code == 400
        assert httpx.post(url, json={"prefix_flush_ms": 60001}, headers=FAULT_AUTH
                          ).status_code == 400
        assert httpx.post(url, json={"delay": 5}, headers=FAULT_AUTH).status_code == 400
        assert httpx.get(url, headers=FAULT_AUTH).json()["prefix_flush_ms"] == 0  # unchanged
        assert httpx.post(url, json={"step_delay_ms": 5, "prefix_miss_ratio": 0.5},
                          headers=FAULT_AUTH).json() == \
            {"step_delay_ms": 5.0, "prefix_miss_ratio": 0.5, "prefix_flush_ms": 0.0}
        assert httpx.post(url, json={"prefix_flush_ms": 50}, headers=FAULT_AUTH).json() == \
            {"step_delay_ms": 5.0, "prefix_miss_ratio": 0.5, "prefix_flush_ms": 50.0}
        assert httpx.get(url, headers=FAULT_AUTH).json() == \
            {"step_delay_ms": 5.0, "prefix_miss_ratio": 0.5, "prefix_flush_ms": 50.0}
    finally:
        engine.stop()
    from ac_observe.engine.server import _loopback
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("::ffff:127.0.0.1")
    assert not _loopback("10.0.0.7") and not _loopback("::ffff:10.0.0.7")
    assert not _loopback("") and not _loopback("testclient")


@pytest.mark.slow
def test_an_engine_whose_heartbeat_stopped_is_down_and_fires_until_it_returns(tmp_path):
    """ac_engine_up from the heartbeat: 1, then 0 once stale, still 0 after the engine's
    series are gone (grace over), and an EngineGone-style rule fires on it."""
    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter

    root = tmp_path / "telemetry"
    writer = TelemetryWriter(root / "e1", {"started_at": time.time()}, engine="e1", model="m",
                             heartbeat_seconds=0.2)
    path = _write(tmp_path, """\
  - {name: EngineGone, metric: engine_up, statistic: last, window: 2s, comparison: below,
     threshold: 1, for: 1s, severity: critical}
""", receivers=False)
    config = DaemonConfig(telemetry_root=root, collectors=(), interval_seconds=0.25,
                          window_seconds=600, alerting_file=path, state_dir=tmp_path / "state",
                          alert_interval_seconds=0.25, engine_stale_seconds=0.6,
                          engine_grace_seconds=0.6)
    daemon = Daemon(config, collectors=[EngineCollector(config)])

    def up():
        [series] = daemon.query("engine_up", 5.0, {})["series"]
        return series["labels"]["engine"], series["last"]

    try:
        for _ in range(4):
            daemon.run_cycle()
            time.sleep(0.25)
        assert up() == ("e1", 1.0) and daemon.alerts.active() == []
        writer.close()  # no more heartbeats
        deadline = time.time() + 10
        while time.time() < deadline and not any(
                a["state"] == FIRING for a in daemon.alerts.active()):
            daemon.run_cycle()
            time.sleep(0.25)
        [alert] = daemon.alerts.active()
        assert alert["state"] == FIRING and alert["labels"] == {
            "node": daemon.config.node_name, "engine": "e1", "model": "m",
            "kind": "ac-observe"}
        assert up() == ("e1", 0.0)
        # The engine's own series are gone after the grace; it still reads as down.
        assert daemon.query("requests_running", 0.3, {})["series"] == []
    finally:
        writer.close()
        daemon.close()


def _fire_kv_usage_high(tmp_path, gauges, t0):
    """KvUsageHigh (e1 above 80 % for 4 s) firing; returns the closed daemon's outbox."""
    daemon = _daemon(tmp_path, _write(tmp_path, RULES), gauges)
    for t in range(0, 12):
        gauges.values["e1"] = 0.95 if t >= 6 else 0.5
        daemon.run_cycle(now=t0 + t)
    [alert] = [a for a in daemon.alerts.active() if a["rule"] == "KvUsageHigh"]
    assert alert["state"] == FIRING
    outbox = _outbox(daemon)
    body = json.loads(outbox[0]["body"])["alerts"][0]
    assert alert["fingerprint"] == body["fingerprint"]  # the API's is the webhook body's
    daemon.close()
    return body


@pytest.mark.parametrize("edit", ["removed", "severity changed"])
def test_a_removed_or_changed_rule_resolves_what_it_left_firing(tmp_path, edit):
    gauges, t0 = _Gauges(), 5_000_000.0
    firing = _fire_kv_usage_high(tmp_path, gauges, t0)
    if edit == "removed":
        rules = RULES[RULES.index("  - name: KvUsageDrift"):]
    else:
        rules = RULES.replace("severity: critical", "severity: warning")
    daemon = _daemon(tmp_path, _write(tmp_path, rules), gauges)
    try:
        daemon.run_cycle(now=t0 + 20)
        resolved = [json.loads(r["body"])["alerts"][0] for r in _outbox(daemon)
                    if r["kind"] == "resolved"]
        assert len(resolved) == 1
        [gone] = resolved
        # The same alert as the receivers know it: labels, fingerprint; now resolved.
        assert (gone["labels"], gone["fingerprint"]) == (firing["labels"],
                                                          firing["fingerprint"])
        assert gone["status"] == "resolved"
        assert gone["annotations"]["resolved_because"] == "its rule was removed or changed"
        assert gone["annotations"]["summary"] == firing["annotations"]["summary"]
        assert all(a["fingerprint"] != firing["fingerprint"] for a in daemon.alerts.active())
        for t in range(21, 27):  # the edited rule fires again under its new labels
            daemon.run_cycle(now=t0 + t)
        states = [(a["rule"], a["state"], a["labels"]["engine"]) for a in daemon.alerts.active()
                  if a["rule"] == "KvUsageHigh"]
        assert states == ([] if edit == "removed" else [("KvUsageHigh", FIRING, "e1")])
    finally:
        daemon.close()
    # Retired once: a further restart sends nothing more.
    again = _daemon(tmp_path, _write(tmp_path, rules), gauges)
    again.run_cycle(now=t0 + 30)
    assert len([r for r in _outbox(again) if r["kind"] == "resolved"]) == 1
    again.close()


def test_a_firing_alert_whose_series_is_gone_resolves_after_an_hour_without_data(tmp_path):
    from ac_observe.daemon.alerting.state import NO_DATA_RESOLVE_SECONDS
    gauges, t0 = _Gauges(), 6_000_000.0
    firing = _fire_kv_usage_high(tmp_path, gauges, t0)
    daemon = _daemon(tmp_path, _write(tmp_path, RULES), gauges)
    try:
        del gauges.values["e1"]  # engine e1 is gone for good
        t = 12
        while t < 12 + NO_DATA_RESOLVE_SECONDS - 30:
            daemon.run_cycle(now=t0 + t)
            t += 30
        [alert] = [a for a in daemon.alerts.active() if a["rule"] == "KvUsageHigh"]
        assert alert["state"] == FIRING and alert["no_data"]  # no data changes nothing...
        for later in range(t, t + 90, 30):
            daemon.run_cycle(now=t0 + later)
        assert [a for a in daemon.alerts.active() if a["rule"] == "KvUsageHigh"] == []
        [gone] = [json.loads(r["body"])["alerts"][0] for r in _outbox(daemon)
                  if r["kind"] == "resolved"]
        assert gone["fingerprint"] == firing["fingerprint"]  # ...for an hour
        assert gone["annotations"]["resolved_because"] == "no data for 3600 s: its series is gone"
    finally:
        daemon.close()


@pytest.mark.slow
def test_a_slow_rule_never_delays_a_collection_cycle(tmp_path):
    """Started, the daemon evaluates rules on their own thread: while a rule's reads take
    long (days of history from a slow store), cycles go on at their interval and the scrape
    shows the states the last evaluation left; once it returns, the alert fires."""
    from support.servers import parse_metrics, sample_value
    gauges = _Gauges()
    gauges.values["e1"] = 0.95  # KvUsageHigh breaches from the start
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=0.2, window_seconds=600,
                                 alerting_file=_write(tmp_path, RULES),
                                 state_dir=tmp_path / "state", alert_interval_seconds=0.2),
                    collectors=[gauges])
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    inputs = daemon.alerts.read_inputs

    def slow(rule, now):
        entered.set()
        release.wait(30)
        returned.set()
        return inputs(rule, now)

    daemon.alerts.read_inputs = slow
    daemon.start()
    try:
        assert entered.wait(10), "no evaluation began"
        generation = daemon._generation
        # Cycles go on at their interval (0.2 s) while the evaluation is still held: a
        # cycle that waited on it, even for a while, leaves a gap between cycle times.
        wait_for(lambda: daemon._generation - generation >= 5, 10,
                 "cycles while the evaluation is held")
        assert not returned.is_set()
        with daemon._lock:
            windows = daemon.windows
            times = [windows.times[(windows.cycle - k) % windows.capacity]
                     for k in range(5, 0, -1)]
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 1.0, times
        metrics = parse_metrics(daemon.render_metrics().decode())
        assert sample_value(metrics, "ac_alerts_firing", rule="KvUsageHigh") == 0
        release.set()
        wait_for(lambda: sample_value(parse_metrics(daemon.render_metrics().decode()),
                                      "ac_alerts_firing", rule="KvUsageHigh") == 1,
                 20, "KvUsageHigh to fire once evaluations run")
        assert [a["state"] for a in daemon.alerts.active()
                if a["rule"] == "KvUsageHigh"] == [FIRING]
    finally:
        release.set()
        daemon.close()


def test_same_hour_yesterday_reads_history_once_a_minute(tmp_path):
    """The same hour yesterday moves a minute at a time: evaluations within one minute
    read the store's history once, and the next minute reads it again."""
    gauges = _Gauges()
    path = _write(tmp_path, """\
  - name: UsageVsYesterday
    metric: kv_cache_usage
    statistic: mean
    window: 2s
    baseline: same_hour_yesterday:4s
    comparison: relative_increase
    threshold: 0.5
""", receivers=False)
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=1.0, window_seconds=600, alerting_file=path,
                                 state_dir=tmp_path / "state", alert_interval_seconds=1.0),
                    collectors=[gauges])
    t0 = time.time() // 60 * 60 + 1  # the span (to 30 min after the window's middle,
    # a day back) ends in one minute for the cycles at t0 + 0 ... 58
    yesterday = []
    read_minutes = daemon.store.read_minutes

    def counted(names, first, last, *args):
        if last < (t0 - 3600) // 60:
            yesterday.append((first, last))
        return read_minutes(names, first, last, *args)

    daemon.store.read_minutes = counted
    try:
        for t in range(0, 50, 1):
            daemon.run_cycle(now=t0 + t)
        assert len(yesterday) == 1, yesterday
        for t in range(60, 70):
            daemon.run_cycle(now=t0 + t)
        assert len(yesterday) == 2, yesterday
        assert yesterday[1][0] == yesterday[0][0] + 1  # the span moved a minute on
    finally:
        daemon.close()


class _Latency(Collector):
    """TTFT of engine e1 as a histogram: every cycle adds `per_cycle` slow (0.5 s)
    observations."""
    name = "latency"

    def __init__(self, per_cycle: int = 10):
        self.count, self.per_cycle = 0, per_cycle

    def collect(self):
        self.count += self.per_cycle
        family = new_family(m.INFERENCE_LATENCY)
        buckets = [(repr(b), self.count if b >= 0.5 else 0) for b in m.INFERENCE_LATENCY.buckets]
        family.add_metric(["e1", "m", "throughput"], buckets + [("+Inf", self.count)],
                          0.5 * self.count)
        return [family]


def test_an_alerts_unit_is_its_statistics_unit(tmp_path):
    """A share is a percentage and a histogram's rate observations per second, not the
    metric's ns: in the default summary and in {{ unit }} alike."""
    rules = """\
  - name: FastShareLow
    metric: inference_latency_ns
    statistic: 'share_below:200ms'
    window: 3s
    comparison: below
    threshold: 50
  - name: TtftRateHigh
    metric: inference_latency_ns
    statistic: rate
    window: 3s
    comparison: above
    threshold: 5
    annotations: {summary: "{{ value }} {{ unit }}"}
  - name: TtftP95High
    metric: inference_latency_ns
    statistic: p95
    window: 3s
    comparison: above
    threshold: 100000000
"""
    daemon = _daemon(tmp_path, _write(tmp_path, rules), _Latency())
    t0 = 1_000_000.0
    for t in range(8):
        daemon.run_cycle(now=t0 + t)
    summaries = {json.loads(r["body"])["alerts"][0]["labels"]["alertname"]:
                 json.loads(r["body"])["alerts"][0]["annotations"]["summary"]
                 for r in _outbox(daemon)}
    assert summaries["FastShareLow"] == \
        "inference_latency_ns share_below:200ms 0 % below 50"
    assert summaries["TtftRateHigh"] == "10 1/s"
    assert summaries["TtftP95High"].startswith("inference_latency_ns p95 ")
    assert summaries["TtftP95High"].endswith(" ns above 1e+08")


def _one_rule(window: str, baseline: str, extra: str = "", engine: str = "e1",
              name: str = "UsageDrift") -> str:
    return f"""\
  - name: {name}
    metric: kv_cache_usage
    statistic: mean
    window: {window}
    baseline: {baseline}
    comparison: relative_increase
    threshold: 0.5
    match: {{engine: {engine}}}
{extra}"""


def test_a_trailing_baseline_waits_until_half_its_span_was_watched(tmp_path):
    """A young series' first seconds are no baseline: e1 at 30 % for 8 s, then 90 % for
    5 s. Taken from those seconds, the trailing 20 s would fire (+60 % at t=10); with 30 %
    of its span watched (6 s: 0..5 and the interval before) the series has no baseline
    yet, which its source and the waiting list say, and nothing goes pending; nor does
    the history fill it in (a daemon started with it). Once watched, a later jump fires.
    Recent times off the minute: the history is read where a wrong rule would read it."""
    gauges = _Gauges()
    gauges.values = {"e1": 0.3}
    daemon = _daemon(tmp_path, _write(tmp_path, _one_rule("10s", "trailing:20s"),
                                      receivers=False), gauges)
    t0 = time.time() // 60 * 60 - 600 + 45
    try:
        for t in range(0, 16):
            gauges.values["e1"] = 0.9 if 8 <= t < 13 else 0.3
            daemon.run_cycle(now=t0 + t)
            assert daemon.alerts.active() == [], t
        (instance,) = daemon.alerts.instances.values()
        assert instance.no_data and instance.baseline is None
        assert instance.baseline_source == ("trailing 20 s before the window: still building "
                                            "(30 % of it watched, 50 % needed)")
        (waiting,) = daemon.alerts.waiting()  # what `ac-observe alerts` says of it
        assert waiting["rule"] == "UsageDrift" and waiting["labels"]["engine"] == "e1"
        assert waiting["waiting_for"] == "no baseline: " + instance.baseline_source
        assert waiting["value"] == pytest.approx(100 * 6.3 / 11)  # points 5..15 of the window
        fired = None
        for t in range(16, 60):
            gauges.values["e1"] = 0.3 if t < 50 else 0.9
            daemon.run_cycle(now=t0 + t)
            if fired is None and [a["state"] for a in daemon.alerts.active()] == [FIRING]:
                fired = t
        assert fired is not None and 50 <= fired <= 55, fired
        (alert,) = daemon.alerts.active()
        assert alert["baseline"] == pytest.approx(30.0)
        assert alert["baseline_source"] == "trailing 20 s before the window"
        assert daemon.alerts.waiting() == []
    finally:
        daemon.close()


def test_a_restarted_daemon_takes_the_trailing_baseline_from_its_history(tmp_path):
    """A daemon restarted 40 s ago has watched a third of e1's trailing 2 min; the span's
    whole minute before its windows begin is in the store, from the first daemon (30 %):
    half the span, so a jump to 90 % fires at once instead of going unseen for 20 s more,
    and the source says where the baseline came from. A rule asking for the whole span
    still has none; nor has e2, which the store holds too but which came back 6 s after
    the restart (born since the windows began: its minutes before are not its present),
    nor e3, which the first daemon saw for the last 3 s of that minute only (5 % of it)."""
    rules = (_one_rule("10s", "trailing:2m")
             + _one_rule("10s", "trailing:2m", "    baseline_min_coverage: 1\n",
                         name="UsageDriftWhole")
             + _one_rule("10s", "trailing:2m", engine="e2", name="UsageDriftBack")
             + _one_rule("10s", "trailing:2m", engine="e3", name="UsageDriftBrief"))
    path = _write(tmp_path, rules, receivers=False)
    t0 = time.time() // 60 * 60 - 600  # on a minute, in the past: history keeps it
    gauges = _Gauges()
    gauges.values = {"e1": 0.3, "e2": 0.3}
    first = _daemon(tmp_path, path, gauges)
    try:
        for t in range(100, 200):
            if t >= 177:
                gauges.values["e3"] = 0.3
            first.run_cycle(now=t0 + t)
    finally:
        first.close()
    gauges.values = {"e1": 0.3, "e3": 0.3}
    second = _daemon(tmp_path, path, gauges)
    try:
        for t in range(200, 251):
            for engine in ("e1", "e3") + (("e2",) if t >= 206 else ()):
                gauges.values[engine] = 0.3 if t < 240 else 0.9
            second.run_cycle(now=t0 + t)
        states = {a["rule"]: a for a in second.alerts.active()}
        assert set(states) == {"UsageDrift"} and states["UsageDrift"]["state"] == FIRING
        assert states["UsageDrift"]["baseline"] == pytest.approx(30.0)
        assert states["UsageDrift"]["baseline_source"] == (
            "trailing 120 s before the window (its minutes before the daemon's windows "
            "begin, from the history)")
        waiting = {w["rule"]: w["waiting_for"] for w in second.alerts.waiting()}
        assert waiting == {
            "UsageDriftWhole": "no baseline: trailing 120 s before the window: still building "
                               "(84 % of it watched, 100 % needed)",
            "UsageDriftBack": "no baseline: trailing 120 s before the window: still building "
                              "(29 % of it watched, 50 % needed)",
            "UsageDriftBrief": "no baseline: trailing 120 s before the window: still building "
                               "(37 % of it watched, 50 % needed)"}
    finally:
        second.close()


def test_a_trailing_baseline_longer_than_the_windows_is_read_from_history(tmp_path):
    """trailing:1h beside 10 minutes of windows: the hour's whole minutes come from the
    store; e1, watched all of it at 30 %, fires when it jumps to 90 %; e2, there for its
    last 5 minutes, covers 8 % of it and waits."""
    rules = (_one_rule("5m", "trailing:1h")
             + _one_rule("5m", "trailing:1h", engine="e2", name="UsageDriftYoung"))
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=10.0, window_seconds=600,
                                 alerting_file=_write(tmp_path, rules, receivers=False),
                                 state_dir=tmp_path / "state", alert_interval_seconds=10.0),
                    collectors=[gauges := _Gauges()])
    t0 = time.time() // 60 * 60 - 6000
    gauges.values = {"e1": 0.3}
    try:
        for t in range(0, 5410, 10):
            if t >= 4800:
                gauges.values["e2"] = 0.3 if t < 5100 else 0.9
            gauges.values["e1"] = 0.3 if t < 5100 else 0.9
            daemon.run_cycle(now=t0 + t)
        (alert,) = daemon.alerts.active()
        assert (alert["rule"], alert["state"]) == ("UsageDrift", FIRING)
        assert alert["baseline"] == pytest.approx(30.0)
        assert alert["baseline_source"] == ("trailing 3600 s before the window (from the "
                                            "history's minutes)")
        assert [w["waiting_for"] for w in daemon.alerts.waiting()] == [
            "no baseline: trailing 3600 s before the window: still building (8 % of it "
            "watched, 50 % needed)"]
    finally:
        daemon.close()


def test_baseline_min_coverage_is_a_share_for_a_trailing_baseline_only(tmp_path):
    for extra, said in [("    baseline_min_coverage: 1.5\n", "a share from 0 to 1"),
                        ("    baseline_min_coverage: '50%'\n", "a number is required")]:
        with pytest.raises(AlertConfigError, match=said):
            load_alerting_config(_write(tmp_path, _one_rule("1m", "trailing:1h", extra)))
    static = _one_rule("1m", "static:10", "    baseline_min_coverage: 0.5\n")
    with pytest.raises(AlertConfigError, match="trailing or same_hour_yesterday baseline only"):
        load_alerting_config(_write(tmp_path, static))


def test_the_printed_schema_holds_the_shipped_alerting_files_and_refuses_bad_ones(tmp_path):
    """`ac-observe alerts schema` is what an editor checks a file against: the compose
    stack's alerting file and the shipped rules written out pass it, and the mistakes the
    daemon refuses that a schema can see (an unknown field, a comparison or metric that
    does not exist, a threshold that is no number) fail it."""
    import jsonschema
    import yaml

    from support.stack import REPO

    printed = subprocess.run([AC_OBSERVE, "alerts", "schema"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    schema = json.loads(printed)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = yaml.safe_load((REPO / "dashboards/ac-observe/alerting.yaml").read_text())
    assert list(validator.iter_errors(shipped)) == []
    defaults = subprocess.run([AC_OBSERVE, "alerts", "defaults"], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    written = yaml.safe_load(defaults)
    assert len(written["rules"]) == 9 and list(validator.iter_errors(written)) == []
    path = tmp_path / "alerts.yaml"
    path.write_text(f"receivers:\n  - {{name: ops, url: 'http://h/x', secret: '{SECRET}'}}\n"
                    "rules:\n" + RULES)
    good = yaml.safe_load(path.read_text())
    assert list(validator.iter_errors(good)) == []
    load_alerting_config(path)  # and the daemon takes it
    rule = good["rules"][0]
    for bad in ({**rule, "when": "now"}, {**rule, "comparison": "sideways"},
                {**rule, "metric": "nope"}, {**rule, "threshold": "hi"},
                {key: value for key, value in rule.items() if key != "window"}):
        assert list(validator.iter_errors({"rules": [bad]})), bad
    assert list(validator.iter_errors({"receivers": [{"name": "a", "url": "http://h/",
                                                      "format": "teams"}]}))


def test_a_reload_during_an_evaluation_still_resolves_what_it_fired(tmp_path):
    """A reload that removes a rule while an evaluation moves its instance to firing: the
    instance is retired as it then stands, so the receiver gets the resolved notification
    for the firing one it got (a snapshot read before the evaluation ended saw it pending
    and retired it silently)."""
    gauges, t0 = _Gauges(), 7_000_000.0
    daemon = _daemon(tmp_path, _write(tmp_path, RULES), gauges)
    try:
        for t in range(0, 9):  # e1 above 80 % from t=6: pending, firing at t=10
            gauges.values["e1"] = 0.95 if t >= 6 else 0.5
            daemon.run_cycle(now=t0 + t)
        assert [a["state"] for a in daemon.alerts.active()
                if a["rule"] == "KvUsageHigh"] == [PENDING]
        _, rules = load_alerting_config(_write(
            tmp_path, RULES[RULES.index("  - name: KvUsageDrift"):]))
        evaluation = threading.Thread(target=daemon.alerts.evaluate, args=(t0 + 11,))
        read_saved = daemon.store.saved_alerts

        def saved_then_an_evaluation():  # the reload's read, then the cycle's evaluation
            saved = read_saved()
            evaluation.start()
            if not daemon.alerts._evaluating.locked():  # nothing holds it off: it ends
                evaluation.join(30)
            return saved

        daemon.store.saved_alerts = saved_then_an_evaluation
        daemon.alerts.replace_rules(rules)
        evaluation.join(30)
        daemon.store.saved_alerts = read_saved
        daemon.alerts.evaluate(t0 + 12)  # retires what the reload left
        statuses = [json.loads(row["body"])["alerts"][0]["status"]
                    for row in _outbox(daemon)
                    if "KvUsageHigh" in row["body"]]
        assert statuses.count("firing") == statuses.count("resolved"), statuses
    finally:
        daemon.close()
