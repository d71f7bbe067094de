"""Many nodes kept apart, for real: 20 daemons on loopback, each with its own node name
and a stand-in engine of the same name (`engine-8000` everywhere, written by the engine's
telemetry writer as bench/daemon_cost.py does), one real Prometheus scraping them all with
the shipped rules, and a second federating its recording rules with the shipped
global.yml. Every Fleet panel query, on both, answers per node; every Overview query on
the first keeps the nodes apart; the figures are each daemon's own answers."""
from __future__ import annotations

import math
import threading
import time

import httpx
import pytest

from ac_observe import metrics as m
from ac_observe.dashboards import boards, fleet, generate, grafana
from ac_observe.engine.telemetry import TelemetryWriter
from support.servers import DaemonProcess, wait_for
from support.stack import GlobalPrometheus, Prometheus

NODES = 20
TOKEN = "fleet-test-token"
ENGINE = "engine-8000"  # the default name, on every node: only `node` tells them apart


def node_name(i: int) -> str:
    return f"gpu-{i:02d}"


# The contract's TTFT bucket edges from 8 ms: node i's slow requests fall in the i-th
# bucket after it, so every node's p95 (read from its buckets) differs from the others'.
SLOW_EDGES = [edge for edge in m.INFERENCE_LATENCY.buckets if edge >= 0.008][:NODES + 1]


def slow_seconds(i: int) -> float:
    """Node i's slow requests take this long (inside its own bucket, at no edge): the
    higher i, the worse its TTFT p95."""
    return math.sqrt(SLOW_EDGES[i] * SLOW_EDGES[i + 1])


def hit_blocks(i: int) -> int:
    """Of 100 looked-up blocks, node i finds this many: the lower i, the worse."""
    return 4 * (i + 1)


def tick(writer: TelemetryWriter, i: int) -> None:
    """One tick of node i's engine, the same shares every tick (so any whole number of
    ticks, whatever window holds them, gives one p95 and one hit rate), flushed at once."""
    lane = m.LANES[0]
    writer.observe_many(m.INFERENCE_LATENCY, [0.004] * 10 + [slow_seconds(i)] * 10,
                        stream=lane)
    writer.inc(m.REQUESTS, 20, stream=lane, status="ok")
    writer.inc(m.KV_QUERY_BLOCKS, 100, skeleton="other")
    writer.inc(m.KV_HIT_BLOCKS, hit_blocks(i), skeleton="other")
    writer.flush()


def as_sent(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$engine", ".*") \
        .replace("$node", ".*")


@pytest.fixture(scope="module")
def fleet_stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet")
    writers, daemons, parts = [], [], []
    stop = threading.Event()
    alerting = base / "alerting.yaml"
    alerting.write_text("rules: defaults\n")

    def drive() -> None:
        while not stop.wait(0.5):
            for i, writer in enumerate(writers):
                tick(writer, i)
    driver = threading.Thread(target=drive, daemon=True)
    try:
        for i in range(NODES):
            root = base / node_name(i) / "telemetry"
            writers.append(TelemetryWriter(root / ENGINE, {"api_address": "",
                                                           "started_at": time.time()},
                                           engine=ENGINE,
                                           model="tiny", heartbeat_seconds=0.5))
        driver.start()
        for i in range(NODES):  # all started, then each waited on: they start together
            daemons.append(DaemonProcess(
                base / node_name(i) / "telemetry", "--collectors", "engine",
                "--node-name", node_name(i), "--no-history", "--token", TOKEN,
                "--alerting", str(alerting), "--state-dir", str(base / node_name(i) / "s")))
        for daemon in daemons:
            daemon.wait_ready(timeout=150)
        first = Prometheus(base / "prometheus", [f"127.0.0.1:{d.port}" for d in daemons],
                           None, TOKEN)
        parts.append(first)
        second = GlobalPrometheus(base / "global", [f"127.0.0.1:{first.port}"])
        parts.append(second)
        yield {"first": first, "second": second, "daemons": daemons}
    finally:
        stop.set()
        for part in reversed(parts):
            part.stop()
        for daemon in daemons:
            daemon.stop()
        for writer in writers:
            writer.close()


def _nodes(rows: list[dict]) -> list[str]:
    return sorted(r["metric"].get("node", "") for r in rows)


def _daemon_figure(daemon: DaemonProcess, metric: str, statistic: str) -> float:
    answer = httpx.get(daemon.url + "/api/v1/query", timeout=10,
                       headers={"Authorization": f"Bearer {TOKEN}"},
                       params={"metric": metric, "window": "60s"}).json()
    values = [s[statistic] for s in answer["series"] if s[statistic] is not None]
    assert values, (metric, answer)
    return max(values) if statistic == "p95" else min(values)


@pytest.mark.stack
def test_twenty_nodes_stay_apart_on_the_scraping_and_the_federating_prometheus(fleet_stack):
    first, second = fleet_stack["first"], fleet_stack["second"]
    daemons = fleet_stack["daemons"]
    names = sorted(node_name(i) for i in range(NODES))
    records = (fleet.TTFT_P95_RECORD, fleet.HIT_RATE_RECORD)
    for prometheus, what in ((first, "the first"), (second, "the federating")):
        for record in records:
            wait_for(lambda p=prometheus, r=record: set(_nodes(p.query(r))) == set(names), 120,
                     f"{record} of every node on {what} Prometheus", interval=1)
        # An engine's hit rate on one basis at a time: the first minute's (its own gauge,
        # before two scrapes of the block counters) gone stale, as federated too.
        wait_for(lambda p=prometheus: _nodes(p.query(fleet.HIT_RATE_RECORD)) == names, 120,
                 f"one hit rate a node on {what} Prometheus", interval=1)
    board = grafana.build(fleet.fleet())
    for prometheus in (first, second):
        for title, expr in grafana.queries(board):
            if grafana.needs_hardware(expr):
                continue  # the GPU panel: scripts/gpu_check.py
            rows = prometheus.query(as_sent(expr))
            if title.startswith("Worst"):  # the ten worst, each a node of its own
                assert len(_nodes(rows)) == 10 == len(set(_nodes(rows))), (title, rows)
            elif "per node" in title:
                per_node = {n: _nodes(rows).count(n) for n in names}
                assert set(_nodes(rows)) == set(names), (title, _nodes(rows))
                assert len(set(per_node.values())) == 1, (title, per_node)
            else:  # a headline figure across the nodes
                assert len(rows) == 1, (title, rows)
        assert float(prometheus.query(as_sent(
            fleet.fleet().rows[0][1][0].targets[0][0]))[0]["value"][1]) == NODES
    # The rankings name the nodes built to be worst; each node's figure is its daemon's.
    ttft = {r["metric"]["node"]: float(r["value"][1])
            for r in second.query(as_sent(fleet.ttft_p95_per_node()))}
    hit = {r["metric"]["node"]: float(r["value"][1])
           for r in second.query(as_sent(fleet.hit_rate_per_node()))}
    worst_ttft = second.query(as_sent(f"topk(10, {fleet.ttft_p95_per_node()})"))
    assert set(_nodes(worst_ttft)) == {node_name(i) for i in range(10, NODES)}
    worst_hit = second.query(as_sent(f"bottomk(10, {fleet.hit_rate_per_node()})"))
    assert set(_nodes(worst_hit)) == {node_name(i) for i in range(10)}
    for i, daemon in enumerate(daemons):
        name = node_name(i)
        own_ttft = _daemon_figure(daemon, "inference_latency_ns", "p95")
        own_hit = _daemon_figure(daemon, "kv_cache_hit_rate", "mean")
        assert math.isclose(ttft[name], own_ttft, rel_tol=0.01), (name, ttft[name], own_ttft)
        assert math.isclose(hit[name], own_hit, rel_tol=0.01), (name, hit[name], own_hit)
        assert math.isclose(own_hit, hit_blocks(i), rel_tol=0.01), (name, own_hit)
    # The Overview on the first: any query answered for one node is answered for every
    # node alike, save those whose title says they go across nodes.
    for title, expr in grafana.queries(grafana.build(boards.overview())):
        rows = first.query(as_sent(expr))
        if not rows or "across nodes" in title:
            continue
        counts = {n: _nodes(rows).count(n) for n in names}
        assert set(_nodes(rows)) == set(names) and len(set(counts.values())) == 1, \
            (title, counts)
    # The generated recording rules are all federated (global.yml's match[]).
    federated = {r["metric"]["__name__"] for r in second.query('{__name__=~"node_.+"}')}
    recorded = {r["record"] for g in generate.recording_rules()["groups"]
                for r in g["rules"]}
    assert set(records) <= federated <= recorded
