"""Dashboards, Prometheus rules and Alertmanager from the shipped files under dashboards/:
generated from the contract and current; every panel query answered with data by a real
Prometheus scraping a live daemon and engine under load from the `anthropic` SDK; the
drift rules checked and unit-tested by promtool; a real Alertmanager with the shipped
configuration delivering an alert the real Prometheus fired to a loopback receiver."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import httpx
import pytest
import yaml

from ac_observe import metrics as m
from ac_observe.daemon.alerting.rules import default_rules
from ac_observe.dashboards import generate, grafana, promql
from support.engine_replay import EngineReplay
from support.grafana import Grafana
from support.receivers import SECRET, WebhookReceiver
from support.servers import DaemonProcess, EngineServer, GatewayServer, run_cli, wait_for
from support.stack import REPO, SHIPPED, Alertmanager, Prometheus, delivery_of, finite

BOARDS = sorted((SHIPPED / "grafana" / "dashboards").glob("*.json"))


def _models() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in BOARDS}


def all_selected(expr: str, rate_interval: str = "1m") -> str:
    """A panel's query as Grafana sends it with every node and engine selected."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$engine", ".*")
            .replace("$node", ".*"))


# ----- generated, current, wired to the contract ------------------------------------------

def test_the_committed_files_are_what_generation_gives():
    """`ac-observe dashboards generate` run on the contract as it is changes nothing."""
    assert generate.stale(REPO) == [], "run `ac-observe dashboards generate`"
    out = run_cli("dashboards", "generate", "--root", str(REPO), "--check")
    assert out.returncode == 0, out.stderr


def test_a_stale_or_hand_edited_file_is_caught(tmp_path):
    for path, text in generate.files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert run_cli("dashboards", "generate", "--root", str(tmp_path), "--check").returncode == 0
    board = tmp_path / "dashboards" / "grafana" / "dashboards" / "ac-overview.json"
    board.write_text(board.read_text().replace("ac_requests_total", "ac_requests_finished"))
    out = run_cli("dashboards", "generate", "--root", str(tmp_path), "--check")
    assert out.returncode == 1 and "ac-overview.json" in out.stderr


def test_dashboards_path_names_the_installed_dashboard_and_stack_files():
    """`ac-observe dashboards path`: the installed package's folder of the files a user
    mounts into Grafana and Prometheus."""
    import ac_observe.dashboards
    out = run_cli("dashboards", "path")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path == Path(ac_observe.dashboards.__file__).parent
    assert path.is_dir() and (path / "grafana").is_dir(), sorted(p.name for p in path.iterdir())


def test_every_query_names_families_of_the_contract_through_the_pinned_datasource():
    models = _models()
    assert set(models) == {"ac-overview", "ac-kv-cache", "ac-gpu-cuda", "ac-drift",
                           "ac-fleet"}
    provisioned = yaml.safe_load((SHIPPED / "grafana" / "provisioning" / "datasources" /
                                  "prometheus.yml").read_text())
    assert provisioned["datasources"][0]["uid"] == grafana.DATASOURCE_UID
    named = set()
    records = {rule["record"] for group in generate.recording_rules()["groups"]
               for rule in group["rules"]}
    for uid, model in models.items():
        text = json.dumps(model)
        assert "${DS_" not in text and "__inputs" not in text, uid  # no import placeholders
        ids = [panel["id"] for panel in model["panels"]]
        assert len(ids) == len(set(ids)), uid
        for panel in model["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": grafana.DATASOURCE_UID}
            assert panel["targets"], (uid, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == grafana.DATASOURCE_UID
                families = grafana.families_named(target["expr"])
                # A recording rule a query reads is one the shipped rules record.
                recorded = set(_RECORD.findall(target["expr"]))
                assert recorded <= records, (uid, panel["title"], recorded - records)
                # (or Prometheus' own ALERTS series, for the exported rules)
                assert families or recorded or "ALERTS{" in target["expr"], \
                    (uid, panel["title"])
                unknown = families - set(m.BY_NAME)
                assert not unknown, (uid, panel["title"], unknown)
                named |= families
    # The headline metrics and each source's families have a home on some dashboard.
    for spec in (m.INFERENCE_LATENCY, m.KV_HIT_BLOCKS, m.SKELETON_COMPLEXITY,
                 m.STREAM_UTILIZATION, m.GPU_UTILIZATION, m.CUDA_KERNEL_LAUNCHES,
                 m.CUDA_SYNC_WAIT, m.ALERTS_FIRING, m.WEBHOOK_DELIVERIES):
        assert spec.name in named, spec.name


# An aggregation or a join and the labels it keeps: `sum by (node, gpu) (`, `on (node, pid)`
_GROUPING = re.compile(r"\b(by|on)\s*\(([^()]*)\)")
# An aggregation that keeps no label: `sum(`, `topk(10, ` (by-less)
_BY_LESS = re.compile(r"\b(sum|min|max|avg|count|group|topk|bottomk|quantile|stddev)\s*\((?!\))")
# A series selector: a contract family or Prometheus' ALERTS, with its matchers if any
_SELECTOR = re.compile(r"\b(ac_[a-z0-9_]+|ALERTS|node_[a-z_]+:[a-z0-9_]+:[a-z0-9_]+)(\{[^}]*\})?")
# A recording rule's name (dashboards/prometheus/rules/recording.rules.yml)
_RECORD = re.compile(r"\b(node_[a-z_]+:[a-z0-9_]+:[a-z0-9_]+)")


def node_dropped(expr: str) -> list[str]:
    """What of a query merges nodes: a grouping without `node`, an aggregation keeping no
    label, a selector not filtered by the node variable."""
    out = [f"{word} ({labels})" for word, labels in _GROUPING.findall(expr)
           if "node" not in (label.strip() for label in labels.split(","))]
    out += [f"{name}(" for name in _BY_LESS.findall(expr)]
    out += [name + braces for name, braces in _SELECTOR.findall(expr)
            if 'node=~"$node"' not in braces]
    return out


def test_every_panel_query_keeps_nodes_apart_unless_its_title_says_so():
    """GPU 0 of two nodes is two lines: every query filters on the node variable and keeps
    `node` in each aggregation and join, save a panel whose title says it goes across
    nodes (a headline sum, a ranking of nodes)."""
    merged, said = [], 0
    for uid, model in _models().items():
        variables = [v["name"] for v in model["templating"]["list"]]
        assert variables[:2] == ["node", "engine"], (uid, variables)
        node = model["templating"]["list"][0]
        assert node["multi"] and node["includeAll"], uid
        for title, expr in grafana.queries(model):
            if re.search(r"\bnodes\b", title, re.IGNORECASE):
                said += 1
                assert 'node=~"$node"' in expr, (uid, title, expr)  # still filtered
                continue
            dropped = node_dropped(expr)
            if dropped:
                merged.append((uid, title, dropped))
    assert not merged, "queries that merge nodes:\n" + "\n".join(map(str, merged))
    assert said >= 4  # the headline figures and the Fleet board's rankings
    # ... and each line's legend names its node (two nodes' "gpu 0" are told apart).
    unnamed = [(uid, panel["title"], target["legendFormat"])
               for uid, model in _models().items() for panel in model["panels"]
               for target in panel.get("targets") or []
               if target.get("legendFormat") and "{{node}}" not in target["legendFormat"]
               and not re.search(r"\bnodes\b", panel["title"], re.IGNORECASE)]
    assert not unnamed, unnamed


def test_the_node_check_catches_a_query_that_merges_nodes():
    assert node_dropped('sum by (node, gpu) (ac_gpu_utilization_ratio{node=~"$node"})') == []
    assert node_dropped('max by (gpu) (ac_gpu_utilization_ratio{node=~"$node"})') == \
        ["by (gpu)"]
    assert node_dropped('sum by (node) (ac_gpu_utilization_ratio)') == \
        ["ac_gpu_utilization_ratio"]
    assert node_dropped('rate(x{node=~"$node"}[1m]) * on (pid) group_left (engine) '
                        'ac_engine_process{node=~"$node"}') == ["on (pid)"]
    assert node_dropped('topk(10, sum by (node) (ac_build_info{node=~"$node"}))') == \
        ["topk("]


def test_the_drift_board_has_a_panel_per_shipped_rule_with_its_baseline():
    model = _models()["ac-drift"]
    titles = {panel["title"].split(":")[0]: panel for panel in model["panels"]}
    for rule in default_rules():
        panel = titles[rule.name]
        exprs = [t["expr"] for t in panel["targets"]]
        assert len(exprs) == 2, rule.name
        if rule.comparison not in ("above", "below"):
            assert "offset" in exprs[1], (rule.name, exprs[1])  # the baseline, back in time


def test_heatmaps_read_prometheus_buckets_with_their_unit_on_the_y_axis():
    units = {"Skeleton complexity, across nodes ($engine)": "short",
             "Synchronisation waits, across nodes": "s"}
    heatmaps = {p["title"]: p for model in _models().values() for p in model["panels"]
                if p.get("type") == "heatmap"}
    assert set(heatmaps) == set(units)
    for title, panel in heatmaps.items():
        assert panel["options"]["calculate"] is False  # buckets as Prometheus gives them
        assert panel["options"]["yAxis"]["unit"] == units[title], title
        assert all(t["format"] == "heatmap" for t in panel["targets"]), title
    # An engine family's buckets are summed within one engine and kind, a panel per
    # engine: never one heatmap over two engines' layouts (the selected nodes' engines of
    # that name together, as the title says).
    engine_map = heatmaps["Skeleton complexity, across nodes ($engine)"]
    assert engine_map["repeat"] == "engine"
    assert "sum by (engine, kind, le)" in engine_map["targets"][0]["expr"]


def test_panels_a_scraped_kind_cannot_fill_say_not_exported():
    """The mapping table decides: a panel every line of which reads families no vLLM row
    feeds says "not exported by vLLM" in place of "No data"; one vLLM fills is left be."""
    models = _models()
    panels = {(uid, p["title"]): p for uid, model in models.items()
              for p in model["panels"]}

    def no_value(uid, title):
        return panels[(uid, title)].get("fieldConfig", {}).get("defaults", {}).get("noValue")

    assert no_value("ac-overview", "Lane stream utilisation") == \
        "No data: not exported by vLLM or SGLang"
    assert no_value("ac-kv-cache", "Why looked-up blocks missed (share of lookups)") == \
        "No data: not exported by vLLM or SGLang"
    # SGLang has no preemption counter, vLLM has (evictions are the bundled engine's).
    assert no_value("ac-kv-cache", "Evictions and preemptions / s") == \
        "No data: not exported by SGLang"
    assert no_value("ac-overview", "Time to first token (p50 / p95 / p99)") is None
    for uid in ("ac-overview", "ac-kv-cache", "ac-gpu-cuda"):
        table = panels[(uid, "Figures these engines do not export")]
        assert table["type"] == "table"
        assert [t["expr"].count('kind="vllm"') + 2 * t["expr"].count('kind="sglang"')
                for t in table["targets"]] == [1, 2]


def test_durations_are_promql_ones_down_to_the_millisecond():
    assert [promql.duration(s) for s in (86400, 7200, 120, 90, 1.5, 0.25, 84750)] == \
        ["1d", "2h", "2m", "90s", "1500ms", "250ms", "84750s"]
    for bad in (0, -1, 0.0004):
        with pytest.raises(ValueError, match="not a whole number of milliseconds"):
            promql.duration(bad)


def test_every_board_shows_the_alert_annotations_the_daemon_writes():
    """Each board queries Grafana's annotation store for the tag every annotation of the
    daemon's grafana receiver carries (and keeps Grafana's built-in one)."""
    from ac_observe.daemon.alerting.alert import Alert
    from ac_observe.daemon.alerting.notify.grafana import grafana_annotation
    from ac_observe.metrics import GRAFANA_ANNOTATION_TAG as ANNOTATION_TAG
    written = grafana_annotation([Alert({"alertname": "X"}, {}, "firing", 1.0)])
    for uid, model in _models().items():
        queries = {q["name"]: q for q in model["annotations"]["list"]}
        assert queries["Annotations & Alerts"]["builtIn"] == 1, uid
        ours = queries["ac-observe alerts"]
        assert ours["enable"] and ours["datasource"] == grafana.GRAFANA_BUILTIN, uid
        assert ours["target"]["type"] == "tags" and not ours["target"]["matchAny"]
        assert set(ours["target"]["tags"]) <= set(written["tags"]), uid
        assert ANNOTATION_TAG in ours["target"]["tags"]


def test_the_daemon_refuses_a_bad_grafana_url_or_token_file(tmp_path):
    out = run_cli("daemon", "--grafana-url", "ftp://grafana:3000")
    assert out.returncode == 2 and "--grafana-url: ftp scheme: use http or https" in out.stderr
    out = run_cli("daemon", "--grafana-url", "http://grafana:3000", "--grafana-token-file",
                  str(tmp_path / "missing"))
    assert out.returncode == 2 and f"cannot read the token file {tmp_path}/missing" in out.stderr


# ----- promtool -------------------------------------------------------------------------------

@pytest.mark.stack
def test_promtool_checks_the_config_and_rules_and_unit_tests_every_alert_rule(tmp_path):
    prometheus = SHIPPED / "prometheus"
    # (promtool opens the token file: the compose secret's path, put somewhere that exists)
    shutil.copytree(prometheus, tmp_path / "prometheus")
    (tmp_path / "token").write_text("x\n")
    config = (prometheus / "prometheus.yml").read_text()
    assert "/run/secrets/ac_observe_token" in config
    (tmp_path / "prometheus" / "prometheus.yml").write_text(
        config.replace("/run/secrets/ac_observe_token", str(tmp_path / "token")))
    out = subprocess.run(["promtool", "check", "config",
                          str(tmp_path / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sorted((prometheus / "rules").glob("*.yml"))
    out = subprocess.run(["promtool", "check", "rules", *map(str, rules)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    tests = sorted((prometheus / "tests").glob("*.yml"))
    out = subprocess.run(["promtool", "test", "rules", *map(str, tests)], capture_output=True,
                         text=True, cwd=prometheus / "tests")
    assert out.returncode == 0, out.stdout + out.stderr
    # Every shipped rule has a firing case and a not-firing one: an empty expectation, or
    # a series of the case's input whose labels no expected alert carries.
    import re
    ignored = {"le", "job", "skeleton"}
    firing, quiet = set(), set()
    for path in tests:
        for group in yaml.safe_load(path.read_text())["tests"]:
            inputs = set()
            for series in group["input_series"]:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', series["series"]))
                inputs.add(frozenset((k, v) for k, v in labels.items() if k not in ignored))
            for case in group["alert_rule_test"]:
                name, expected = case["alertname"], case["exp_alerts"]
                if expected:
                    firing.add(name)
                shown = [{(k, str(v)) for k, v in a["exp_labels"].items()} for a in expected]
                if any(not any(labels <= alert for alert in shown) for labels in inputs):
                    quiet.add(name)  # (with no expectation, every input is left out)
    for rule in default_rules():
        assert rule.name in firing, f"{rule.name}: no firing case"
        assert rule.name in quiet, f"{rule.name}: no case where it stays quiet"


@pytest.mark.stack
def test_an_exported_threshold_rule_explains_against_the_hour_before_its_window(tmp_path):
    """A rule that reads no baseline (above) is explained as the daemon explains it: the
    window against the hour before it (explain.spans); e2e latency splits into front-end,
    queue, prefill and decode, each mean Σ sum over Σ count, in ms."""
    from ac_observe.daemon.alerting.rules import parse_rules
    (rule,) = parse_rules([{"name": "E2eSlow", "metric": "e2e_latency_ms", "statistic": "mean",
                            "window": "5m", "comparison": "above", "threshold": 100}], "test")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(promql.alert_groups([rule])))
    # At 80 min: the window [75, 80], the hour before it [15, 75] (per minute, 100
    # requests; each figure changes at minute 70). e2e 80 ms, then 200: now 100 / 500 =
    # 200 ms, before (55 * 8 + 5 * 20) / 6000 = 90 ms (the hour ending now would say 100,
    # the 5m before the window 200). front-end 1 ms; queue 4, then 24 ms: (55 * 0.4 + 5 *
    # 2.4) / 6000 = 5.667; prefill 30, then 40: 30.83; decode 40, then 130: 47.5.
    labels = 'engine="e1", model="tiny", stream="throughput", kind="ac-observe", instance="d"'
    sums = {"e2e_latency": "0+8x70 580+20x10", "frontend": "0+0.1x80",
            "queue_time": "0+0.4x70 30.4+2.4x10", "request_prefill": "0+3x70 214+4x10",
            "request_decode": "0+4x70 293+13x10"}
    series = [(f"ac_{name}_seconds_{suffix}{{{labels}}}", values if suffix == "sum" else
               "0+100x80") for name, values in sums.items() for suffix in ("sum", "count")]
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [{"eval_time": "80m", "alertname": "E2eSlow", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "engine": "e1", "model": "tiny",
                               "stream": "throughput", "kind": "ac-observe", "instance": "d"},
                "exp_annotations": {
                    "summary": "e2e_latency_ms mean over 5m: above 100 ms",
                    "description": "the value: 200 (in ms); series: map[engine:e1 "
                                   "instance:d kind:ac-observe model:tiny stream:throughput]",
                    "explanation": "mean e2e latency 200 ms (baseline 90 ms): front-end 1 -> "
                                   "1 ms, queue 5.667 -> 24 ms, prefill 30.83 -> 40 ms, decode "
                                   "47.5 -> 130 ms (means over the 5m window and the 1h before "
                                   "it, as the rule reads no baseline; the daemon ranks them: "
                                   "ac-observe alerts explain)"}}]}]}]}))
    out = subprocess.run(["promtool", "test", "rules", "rules.test.yml"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.stack
def test_rules_export_is_the_shipped_file_and_takes_an_alerting_file(tmp_path):
    out = run_cli("rules", "export", "--format", "prometheus")
    assert out.returncode == 0, out.stderr
    shipped = yaml.safe_load((SHIPPED / "prometheus" / "rules" / "drift.rules.yml").read_text())
    assert yaml.safe_load(out.stdout) == shipped
    (tmp_path / "alerts.yaml").write_text("""\
rules:
  - name: QueueSlow
    metric: queue_time_ns
    statistic: p99
    window: 2m
    baseline: trailing:30m
    comparison: relative_increase
    threshold: 0.5
    match: {engine: e1}
    labels: {team: infra}
    annotations:
      summary: "queue p99 {{ value }} {{ unit }} vs {{ baseline }} on {{ labels }} {{ $raw }}"
      runbook: "https://wiki.example/queue"
""")
    out = run_cli("rules", "export", "--alerting", str(tmp_path / "alerts.yaml"))
    assert out.returncode == 0, out.stderr
    (rule,) = yaml.safe_load(out.stdout)["groups"][0]["rules"]
    assert rule["labels"] == {"team": "infra", "severity": "warning"}
    # The file's annotations are kept (one source): fields become Prometheus queries of the
    # same figures (promtool renders them: dashboards/prometheus/tests), other braces are
    # printed, never run.
    summary = rule["annotations"]["summary"]
    assert summary.startswith('queue p99 {{ $acv := "n/a" }}{{ range query `') and \
        ' ns vs {{ $acv := "n/a" }}{{ range ' in summary
    assert summary.endswith('{{ "{{" }} $raw {{ "}}" }}') and "{{ value }}" not in summary
    assert rule["annotations"]["runbook"] == "https://wiki.example/queue"
    assert 'ac_queue_time_seconds_bucket{engine="e1"}[30m] offset 2m' in rule["expr"]
    (tmp_path / "rules.yml").write_text(out.stdout)
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    # Every field in every kind of rule (a static baseline, against a threshold, braces
    # of the text against a field's) makes a template Prometheus loads.
    (tmp_path / "alerts.yaml").write_text("""\
rules:
  - name: StaticDrop
    metric: kv_cache_hit_rate
    window: 5m
    baseline: static:90
    comparison: absolute_decrease
    threshold: 5
    annotations: {summary: "{{{ labels }}} {{ value }} vs {{ baseline }} ({{ baseline_source }}),
      {{ delta }} = {{ delta_percent }} % {{{ value }}}"}
  - name: Busy
    metric: cuda_stream_utilization
    window: 1m
    comparison: above
    threshold: 90
    annotations: {summary: "{{ rule }}: {{ value }} {{ unit }} ({{ delta_percent }}) }}{"}
""")
    out = run_cli("rules", "export", "--alerting", str(tmp_path / "alerts.yaml"))
    assert out.returncode == 0, out.stderr
    (tmp_path / "rules.yml").write_text(out.stdout)
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # A statistic Prometheus cannot compute the daemon's way is refused, naming it.
    (tmp_path / "alerts.yaml").write_text("""\
rules:
  - {name: LastTtft, metric: inference_latency_ns, statistic: last, window: 1m,
     comparison: above, threshold: 1}
""")
    out = run_cli("rules", "export", "--alerting", str(tmp_path / "alerts.yaml"))
    assert out.returncode == 2 and "no PromQL for a histogram's 'last'" in out.stderr
    # A match on a label the metric lacks matches nothing in the daemon: refused, not
    # widened to every series.
    (tmp_path / "alerts.yaml").write_text("""\
rules:
  - {name: Wide, metric: kv_cache_usage, statistic: mean, window: 1m, comparison: above,
     threshold: 0.9, match: {stream: throughput}}
""")
    out = run_cli("rules", "export", "--alerting", str(tmp_path / "alerts.yaml"))
    assert out.returncode == 2 and "no label 'stream'" in out.stderr


# ----- live: engine + daemon + Prometheus + Alertmanager -------------------------------------

def _load(url: str, stop: threading.Event, errors: list, seed: int) -> None:
    """Structured prompts sharing long system prompts (prefix-cache hits, skeletons), on
    both lanes, streamed and not, through the official SDK."""
    import random

    from ac_observe.daemon.demo_load import SYSTEMS, USER_TEMPLATES
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        n += 1
        kwargs = dict(model="tiny", max_tokens=rng.randint(4, 16),
                      system=SYSTEMS[n % 2],
                      messages=[{"role": "user",
                                 "content": USER_TEMPLATES[n % 4].format(n=n % 5)}],
                      extra_headers={m.LANE_HEADER: m.LANES[n % 2]})
        try:
            if n % 3 == 0:
                with client.messages.stream(**kwargs) as stream:
                    for _ in stream.text_stream:
                        pass
            else:
                client.messages.create(**kwargs)
        except anthropic.APIError as exc:
            errors.append(repr(exc))


def _backfill(daemon: DaemonProcess, data: Path, seconds: float = 12.0) -> None:
    """A day of history for the baselines (same hour yesterday, the trailing hour): the
    live daemon's own series, each counter rising at the pace it rose over `seconds` of
    scrapes and each gauge at its last value, every 5 min from 26 h to 10 min ago,
    written as a TSDB block by `promtool tsdb create-blocks-from openmetrics`."""
    from prometheus_client.parser import text_string_to_metric_families
    scrapes = []
    for _ in range(int(seconds)):
        text = httpx.get(daemon.url + "/metrics", headers=daemon.headers, timeout=10).text
        scrapes.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(text) for s in f.samples})
        time.sleep(1.0)
    first, last = scrapes[0], scrapes[-1]
    now = time.time()
    lines = []
    for (name, labels), value in sorted(last.items()):
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[:-len(suffix)] in m.BY_NAME:
                family = name[:-len(suffix)]
        spec = m.BY_NAME.get(family)
        if spec is None:
            continue
        counter = spec.type != m.GAUGE
        rise = max(0.0, value - first.get((name, labels), value)) if counter else 0.0
        # the job and instance a scrape of this daemon gives: one series across the
        # history and the live scrapes, as on a Prometheus that watched it for a day
        text_labels = ",".join(f'{k}="{v}"' for k, v in (
            *labels, ("job", "ac-observe"), ("instance", f"127.0.0.1:{daemon.port}")))
        for j, t in enumerate(range(int(now - 26 * 3600), int(now - 600), 300)):
            sample = j * rise if counter else value
            lines.append(f"{name}{{{text_labels}}} {sample} {t}")
    data.parent.mkdir(parents=True, exist_ok=True)
    (data.parent / "history.om").write_text("\n".join(lines) + "\n# EOF\n")
    out = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics",
                          str(data.parent / "history.om"), str(data)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


VLLM_HIT_SHARE, SGLANG_HIT_GAUGE = 0.4, 0.625


def _drive_replays(vllm: EngineReplay, sglang: EngineReplay, stop: threading.Event) -> None:
    """Traffic on the replays: vLLM looks up 1000 prompt tokens a half second and finds
    40 % of them; SGLang's own hit-rate gauge reads 62.5 %."""
    sglang.set("sglang:cache_hit_rate", SGLANG_HIT_GAUGE)
    while not stop.wait(0.5):
        vllm.inc("vllm:prefix_cache_queries", 1000)
        vllm.inc("vllm:prefix_cache_hits", 1000 * VLLM_HIT_SHARE)
        vllm.observe("vllm:time_to_first_token_seconds", 0.2, 3)
        sglang.observe("sglang:time_to_first_token_seconds", 0.3, 2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("stack")
    (base / "telemetry").mkdir()
    daemon_hook, am_hook = WebhookReceiver(), WebhookReceiver()
    (base / "alerting.yaml").write_text(
        f"receivers:\n  - {{name: ops, url: '{daemon_hook.url}', secret: '{SECRET}'}}\n"
        "rules: defaults\n")
    stop, errors, senders, parts = threading.Event(), [], [], []
    # A vLLM V1 and an SGLang beside the bundled engine (replays of their captures): the
    # panels they cannot fill say so, and the hit rate names its basis for each.
    vllm, sglang = EngineReplay("vllm_v1_0.10.prom"), EngineReplay("sglang_0.4.prom")
    threading.Thread(target=_drive_replays, args=(vllm, sglang, stop), daemon=True).start()
    try:
        # A small KV pool, so the load evicts (the eviction-age panel), and a kernel sample
        # every 10th step, with 5 % of wall time for them (a profiled step on CPU outlasts
        # the default 0.5 %'s refill), for the kernel-time panel.
        parts.append(EngineServer(base / "telemetry" / "e1", "--engine-name", "e1",
                                  "--kv-blocks", "96", "--kernel-sample-steps", "10",
                                  "--kernel-sample-budget", "0.05"))
        engine = parts[-1].wait_ready()
        # A gateway in front of it (the Overview's client-side TTFT): one sender goes
        # through it.
        parts.append(GatewayServer(engine.url, base / "telemetry" / "gw1", "--name", "gw1"))
        gateway = parts[-1].wait_ready()
        # nvml is down here (no GPU): CollectorDown is the alert both evaluators fire.
        token = secrets.token_hex(16)  # the daemon asks for it, as in the stack
        parts.append(DaemonProcess(base / "telemetry", "--collectors", "engine,nvml",
                                   "--alerting", str(base / "alerting.yaml"), "--state-dir",
                                   str(base / "state"), "--alert-interval", "1s", "--token",
                                   token, "--engine-endpoint", f"vllm-0={vllm.url}",
                                   "--engine-endpoint", f"sglang-0={sglang.url}"))
        daemon = parts[-1].wait_ready()
        daemon.headers = {"authorization": f"Bearer {token}"}
        senders = [threading.Thread(target=_load, args=(url, stop, errors, i), daemon=True)
                   for i, url in enumerate((engine.url, gateway.url))]
        for sender in senders:
            sender.start()
        wait_for(lambda: (m.INFERENCE_LATENCY.name + "_bucket") in
                 httpx.get(daemon.url + "/metrics", headers=daemon.headers, timeout=10).text,
                 60, "engine series")
        _backfill(daemon, base / "prometheus" / "data")
        alertmanager = Alertmanager(base / "alertmanager", am_hook.url)
        parts.append(alertmanager)
        # Beside the shipped rules, one exported from an alerting file that fires at once
        # (any TTFT is above 0), so Alertmanager delivers a latency alert's explanation.
        (base / "explained.yaml").write_text(
            f"rules:\n  - {{name: {EXPLAINED_RULE}, metric: inference_latency_ns, "
            "statistic: p95, window: 1m, comparison: above, threshold: 0}\n")
        exported = run_cli("rules", "export", "--alerting", str(base / "explained.yaml"))
        assert exported.returncode == 0, exported.stderr
        prometheus = Prometheus(base / "prometheus", f"127.0.0.1:{daemon.port}",
                                f"127.0.0.1:{alertmanager.port}", token,
                                extra_rules=exported.stdout)
        parts.append(prometheus)
        wait_for(prometheus.targets_up, 30, "Prometheus to scrape the daemon")
        yield {"prometheus": prometheus, "daemon_hook": daemon_hook, "am_hook": am_hook,
               "errors": errors, "daemon": daemon}
    finally:  # whatever started is stopped, newest first, even when a later part failed
        stop.set()
        vllm.close()
        sglang.close()
        for sender in senders:
            sender.join(timeout=60)
        for part in reversed(parts):
            part.stop()
        daemon_hook.down()
        am_hook.down()


@pytest.mark.stack
@pytest.mark.slow
def test_alertmanager_with_the_shipped_config_delivers_what_prometheus_fired(stack):
    """CollectorDown (nvml has no GPU here) fires in the real Prometheus from the exported
    rules; the real Alertmanager, with the shipped configuration and the receiver's URL
    from the environment's variable, posts it to the loopback receiver."""
    hook = stack["am_hook"]
    body = wait_for(lambda: delivery_of(hook, "CollectorDown"), 180,
                    "Alertmanager's delivery of CollectorDown")
    assert body["version"] == "4" and body["status"] == "firing"
    assert body["receiver"] == "ac-observe-webhook"
    (alert,) = [a for a in body["alerts"] if a["labels"]["alertname"] == "CollectorDown"
                and a["labels"]["collector"] == "nvml"]
    assert alert["labels"]["collector"] == "nvml"
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["stack"] == "ac-observe"  # Prometheus' external label
    assert alert["annotations"]["summary"] == "collector_up max over 1m: below 1"


EXPLAINED_RULE = "TtftExplained"
_EXPLANATION = re.compile(
    r"mean TTFT (?P<now>\S+) ms \(baseline (?P<baseline>\S+) ms\): "
    r"front-end (?P<front_b>\S+) -> (?P<front>\S+) ms, queue (?P<queue_b>\S+) -> "
    r"(?P<queue>\S+) ms, prefill (?P<prefill_b>\S+) -> (?P<prefill>\S+) ms "
    r"\(means over the 1m window and the 1h before it")


def _delivered(hook, alertname: str) -> dict:
    """engine -> the alert named `alertname` as Alertmanager delivered it, by engine."""
    found = {}
    for _, raw in list(hook.requests):
        for alert in json.loads(raw)["alerts"]:
            if alert["labels"]["alertname"] == alertname:
                found[alert["labels"]["engine"]] = alert
    return found


@pytest.mark.stack
@pytest.mark.slow
def test_alertmanager_delivers_the_explanation_prometheus_computed(stack):
    """A latency rule exported from an alerting file fires in the real Prometheus; the
    real Alertmanager delivers its `explanation`: the bundled engine's mean TTFT and its
    additive parts (front-end + queue + prefill make the mean), each over the window and
    the hour before it (the backfilled history); a gateway, which has none of the parts,
    says n/a for each, never 0."""
    hook = stack["am_hook"]
    delivered = wait_for(lambda: (lambda d: d if {"e1", "gw1"} <= d.keys() else None)(
        _delivered(hook, EXPLAINED_RULE)), 150, f"Alertmanager's delivery of {EXPLAINED_RULE}")
    said = delivered["e1"]["annotations"]["explanation"]
    engine = _EXPLANATION.match(said)
    assert engine and "n/a" not in said, said
    figures = {k: float(v) for k, v in engine.groupdict().items()}
    assert figures["now"] > 0 and figures["baseline"] > 0
    parts_now = figures["front"] + figures["queue"] + figures["prefill"]
    assert abs(parts_now - figures["now"]) <= 0.1 * figures["now"], figures
    parts_before = figures["front_b"] + figures["queue_b"] + figures["prefill_b"]
    assert abs(parts_before - figures["baseline"]) <= 0.1 * figures["baseline"], figures
    gateway = _EXPLANATION.match(delivered["gw1"]["annotations"]["explanation"])
    assert gateway, delivered["gw1"]["annotations"]
    assert float(gateway["now"]) > 0
    assert {gateway[k] for k in ("front_b", "front", "queue_b", "queue", "prefill_b",
                                 "prefill")} == {"n/a"}


@pytest.mark.stack
@pytest.mark.slow
def test_every_panel_query_returns_data(stack):
    """Every target of every dashboard, as Grafana sends it ($__rate_interval at 4 scrape
    intervals, every engine selected), answered with data by the real Prometheus; only the
    panels that need a GPU or the eBPF probes are left to scripts/gpu_check.py."""
    prometheus = stack["prometheus"]
    # The daemon's own CollectorDown has fired and been delivered by now (the alert test
    # waited): the delivery counters exist.
    wait_for(lambda: stack["daemon_hook"].requests, 120, "the daemon's own delivery")
    wait_for(lambda: prometheus.query('ALERTS{alertstate="firing"}'), 150,
             "an exported rule firing in Prometheus")
    prometheus.wait_scrape_and_rules("ac-observe", time.time())  # a scrape after both
    empty, hardware = [], []
    for uid, model in _models().items():
        for title, expr in grafana.queries(model):
            need = grafana.needs_hardware(expr)
            if need:
                hardware.append((uid, title, need))
                continue
            query = all_selected(expr)
            if not finite(prometheus.query(query)):  # no series, or only NaN (0 / 0)
                empty.append((uid, title, query))
    assert not empty, "panels without data:\n" + "\n".join(map(str, empty))
    assert not stack["errors"], stack["errors"][:3]
    # The vLLM and SGLang replays: each says what it does not export, and the hit rate
    # answers each engine on its own basis (blocks, tokens, the engine's gauge).
    models = _models()
    tables = {uid: [expr for title, expr in grafana.queries(model)
                    if title == "Figures these engines do not export"]
              for uid, model in models.items()}
    rows = [r["metric"] for expr in tables["ac-overview"]
            for r in prometheus.query(all_selected(expr))]
    assert {(r["engine"], r["kind"], r["status"]) for r in rows} == {
        ("vllm-0", "vllm", "not exported by vLLM"),
        ("sglang-0", "sglang", "not exported by SGLang")}
    assert all("Lane stream utilisation" in r["figures"] for r in rows)
    (hit_rate, _) = [expr for title, expr in grafana.queries(models["ac-kv-cache"])
                     if title.startswith("Prefix-cache hit rate")]
    answers = {r["metric"]["engine"]: (r["metric"]["basis"], float(r["value"][1]))
               for r in prometheus.query(all_selected(hit_rate))}
    assert answers["e1"][0] == "blocks"
    assert answers["vllm-0"][0] == "tokens"
    assert abs(answers["vllm-0"][1] - 100 * VLLM_HIT_SHARE) < 0.5, answers
    assert answers["sglang-0"] == ("gauge", pytest.approx(100 * SGLANG_HIT_GAUGE)), answers
    # What is left to the GPU check is exactly the NVML and eBPF panels.
    assert {uid for uid, _, _ in hardware} == {"ac-gpu-cuda", "ac-fleet"}
    assert {need for _, _, need in hardware} == {"gpu (NVML)", "eBPF (CUDA driver probes)",
                                                 grafana.ON_SCRAPED}


# ----- dashboards push ---------------------------------------------------------------------

@pytest.mark.slow
def test_dashboards_push_uploads_every_board_into_its_folder_pointed_at_a_datasource():
    grafana_api = Grafana("glsa_test")
    try:
        env = {**os.environ, "GRAFANA_TOKEN": "glsa_test"}
        out = run_cli("dashboards", "push", "--grafana-url", grafana_api.url,
                      "--datasource-uid", "cloud-prom", env=env)
        assert out.returncode == 0, out.stderr
        assert list(grafana_api.folders.values()) == ["ac-observe"]
        assert {d["dashboard"]["uid"] for d in grafana_api.dashboards} == set(_models())
        for body in grafana_api.dashboards:
            assert body["overwrite"] is True
            assert body["folderUid"] in grafana_api.folders
            text = json.dumps(body["dashboard"])
            assert grafana.DATASOURCE_UID not in text and '"uid": "cloud-prom"' in text
        # Again: the folder is found, the boards overwritten (no second folder).
        assert run_cli("dashboards", "push", "--grafana-url", grafana_api.url,
                       env=env).returncode == 0
        assert len(grafana_api.folders) == 1 and len(grafana_api.dashboards) == 2 * len(BOARDS)
        # A wrong token and an unreachable Grafana: a clear error, exit 1.
        out = run_cli("dashboards", "push", "--grafana-url", grafana_api.url,
                      env={**os.environ, "GRAFANA_TOKEN": "wrong"})
        assert out.returncode == 1 and "refused" in out.stderr and "wrong" not in out.stderr
    finally:
        grafana_api.close()
    out = run_cli("dashboards", "push", "--grafana-url", grafana_api.url, env=env)
    assert out.returncode == 1 and "cannot reach Grafana" in out.stderr



def test_whole_number_histograms_read_the_same_in_promql_as_in_the_daemon():
    """skeleton_complexity's p50 and shares are observed depths in the daemon (the bucket
    edge a rank falls on; a bound floored to a whole depth): so in PromQL too."""
    from ac_observe.dashboards.promql import statistic_expr
    from ac_observe.friendly import FRIENDLY
    depth = FRIENDLY["skeleton_complexity"]
    assert statistic_expr(depth, "p50", "5m").startswith("ceil(histogram_quantile(0.5, ")
    share = statistic_expr(depth, "share_below", "5m", share_threshold=2.5)
    assert 'le="2.0"' in share and 'le="3.0"' not in share, share
    latency = statistic_expr(FRIENDLY["inference_latency_ns"], "p50", "5m")
    assert latency.startswith("histogram_quantile(0.5, ")  # interpolated, as Prometheus


def test_the_le_pattern_matches_every_spelling_at_or_below_its_bound_and_no_other():
    """The share-below rules' pattern of the edges at or below a bound, on any layout:
    every edge prometheus_client or a Go client writes, checked by number."""
    import random
    import re as regex

    from prometheus_client.utils import floatToGoString

    from ac_observe.dashboards.edges import le_at_or_below
    rng = random.Random(7)
    values = {float(f"{10 ** rng.uniform(-6, 7):.{rng.randint(1, 6)}g}") for _ in range(5000)}
    values |= {0.1, 0.2, 0.25, 0.16127, 0.203187, 1.0, 2.5, 10.0, 2560.0, 1e-05, 0.0}
    for bound in (0.2, 0.203187, 0.0001, 0.05, 1.0, 2.5, 7.0, 20.0, 123.456, 999999.0):
        pattern = regex.compile(le_at_or_below(bound))
        for value in values:
            spellings = {floatToGoString(value)}
            if value == int(value) and value < 1e6:
                spellings.add(str(int(value)))  # a Go client's "1"
            for text in spellings:
                assert (pattern.fullmatch(text) is not None) == (value <= bound), (bound, text)
        assert not pattern.fullmatch("+Inf") and not pattern.fullmatch("NaN")
    with pytest.raises(ValueError):
        le_at_or_below(1e-5)


def test_ebpf_series_join_a_discovered_engine_through_its_processes(tmp_path):
    """The GPU & CUDA board's vLLM / SGLang panels, evaluated by promtool's PromQL engine
    on series as the daemon exports them: the launches and sync waits of a server's child
    (vLLM V1's EngineCore, where the model runs) count for its engine; a process of no
    engine counts for none, and a pid on another node is another process."""
    exprs = {title: all_selected(expr)
             for title, expr in grafana.queries(_models()["ac-gpu-cuda"])
             if title.startswith("vLLM / SGLang")}
    core = 'node="a",pid="101",comm="VLLM::EngineCor"'
    series = [
        # 60 launches every 15 s: 4 / s on stream 7; another process 40 / s, and one of
        # node b's that has the engine's pid.
        (f'ac_cuda_kernel_launches_total{{{core},stream="7"}}', "0+60x12"),
        ('ac_cuda_kernel_launches_total{node="a",pid="555",comm="other",stream="7"}',
         "0+600x12"),
        ('ac_cuda_kernel_launches_total{node="b",pid="101",comm="other",stream="7"}',
         "0+600x12"),
        # Every wait in (0.5, 1] s: the p95 is 0.5 + 0.5 * 0.95.
        (f'ac_cuda_sync_wait_seconds_bucket{{{core},api="stream",le="0.5"}}', "0x12"),
        (f'ac_cuda_sync_wait_seconds_bucket{{{core},api="stream",le="1.0"}}', "0+20x12"),
        (f'ac_cuda_sync_wait_seconds_bucket{{{core},api="stream",le="+Inf"}}', "0+20x12"),
        ('ac_engine_process{node="a",engine="vllm-100",kind="vllm",pid="100",role="server"}',
         "1x12"),
        ('ac_engine_process{node="a",engine="vllm-100",kind="vllm",pid="101",role="child"}',
         "1x12"),
    ]
    tests = {"rule_files": [], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "promql_expr_test": [
            {"expr": exprs["vLLM / SGLang processes: kernel launches / s per stream"],
             "eval_time": "2m",
             "exp_samples": [{"labels": '{engine="vllm-100",kind="vllm",node="a",stream="7"}',
                              "value": 4}]},
            {"expr": exprs["vLLM / SGLang processes: sync wait p95"] + " == bool 975000000",
             "eval_time": "2m",
             "exp_samples": [{"labels": '{api="stream",engine="vllm-100",kind="vllm",node="a"}',
                              "value": 1}]},
        ]}]}
    (tmp_path / "join.test.yml").write_text(yaml.safe_dump(tests))
    out = subprocess.run(["promtool", "test", "rules", str(tmp_path / "join.test.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
