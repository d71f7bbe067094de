"""History: per-minute aggregates in the store answer windows longer than the in-memory
hour with the same statistics, and give same_hour_yesterday its hour.

Synthetic history is driven through the daemon's own aggregator (cycles every 20 s with
uneven traffic, a gauge that is sometimes absent, a counter reset) into the store; the
expected figures are computed from the raw events the test generated, never from the
store."""
from __future__ import annotations

import json
import math
import random
import subprocess
import time

import httpx
import pytest
import sqlalchemy as sa

from ac_observe import metrics as m
from ac_observe.collectors.base import Collector, new_family
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.history import HistoryWriter, MinuteAggregator
from ac_observe.daemon.query import bucket_quantile
from ac_observe.daemon.service import Daemon
from ac_observe.daemon.store import (
    Store,
    alert_transitions,
    deliveries,
    history_minutes,
    history_series,
)
from support.servers import AC_OBSERVE

LAT = m.INFERENCE_LATENCY
BOUNDS = list(LAT.buckets) + [math.inf]
LAT_LABELS = (("engine", "e1"), ("model", "m"), ("stream", "low_latency"))
KV_LABELS = (("engine", "e1"), ("model", "m"), ("skeleton", "s1"))
USAGE_LABELS = (("engine", "e1"), ("model", "m"))
REQ_LABELS = (("engine", "e1"), ("model", "m"), ("stream", "low_latency"), ("status", "ok"))
ERR_LABELS = (("engine", "e1"), ("model", "m"), ("stream", "low_latency"), ("status", "error"))
# Today, 08:00 UTC: a whole minute and hour, never so far from the real clock that the
# daemon's retention (8 days, against the real clock) would refuse or prune the tests'
# history (a fixed date in the future would do so once it had passed by a week).
NOW = time.time() // 86400 * 86400 + 8 * 3600
ERRORS_FROM = NOW - 10 * 3600  # the error counter is born inside the window


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


class Synth:
    """Cumulative engine state as the daemon would read it, one cycle at a time; `events`
    keeps what each cycle added, for the expected figures."""

    def __init__(self):
        self.counts = [0] * len(BOUNDS)  # per bucket (not cumulative)
        self.total = 0.0
        self.hits = self.queries = self.requests = self.errors = 0
        self.usage: float | None = None
        self.events = []  # (t, latencies, hits, queries, usage or None, requests)

    def step(self, t, latencies=(), hits=0, queries=0, usage=None, requests=0,
             reset_requests=False):
        for value in latencies:
            self.counts[next(i for i, b in enumerate(BOUNDS) if value <= b)] += 1
            self.total += value
        self.hits += hits
        self.queries += queries
        if reset_requests:
            self.requests = 0  # the engine restarted: its counter starts again
        self.requests += requests
        errors = 1 if t >= ERRORS_FROM and len(latencies) % 2 else 0
        self.errors += errors
        self.usage = usage
        self.events.append((t, list(latencies), hits, queries, usage, requests, errors))

    def samples(self) -> dict:
        out, running = {}, 0
        for bound, count in zip(BOUNDS, self.counts, strict=False):
            running += count
            out["ac_inference_latency_seconds_bucket", LAT_LABELS + (("le", _le(bound)),)] = \
                float(running)
        out["ac_inference_latency_seconds_sum", LAT_LABELS] = self.total
        out["ac_inference_latency_seconds_count", LAT_LABELS] = float(running)
        out["ac_kv_cache_hit_blocks_total", KV_LABELS] = float(self.hits)
        out["ac_kv_cache_query_blocks_total", KV_LABELS] = float(self.queries)
        out["ac_requests_total", REQ_LABELS] = float(self.requests)
        if self.errors:  # a series appears once it has counted something
            out["ac_requests_total", ERR_LABELS] = float(self.errors)
        if self.usage is not None:
            out["ac_kv_cache_usage_ratio", USAGE_LABELS] = self.usage
        return out


class SynthCollector(Collector):
    """The same state as families, for the daemon's live cycles."""
    name = "synth"

    def __init__(self, synth: Synth, labels=LAT_LABELS):
        self.synth, self.labels = synth, labels
        if labels != LAT_LABELS:
            self.name = "synth-" + dict(labels)["engine"]

    def collect(self):
        s = self.synth
        latency = new_family(LAT)
        running, buckets = 0, []
        for bound, count in zip(BOUNDS, s.counts, strict=False):
            running += count
            buckets.append((_le(bound), float(running)))
        latency.add_metric([v for _, v in self.labels], buckets, s.total)
        return [latency]


def load_history(store: Store, start: float, end: float, step: float, traffic) -> Synth:
    """Cycles every `step` seconds over [start, end), through the daemon's aggregator,
    written to the store as the daemon's writer writes them. `traffic(t, rng)` gives the
    cycle's keyword arguments for Synth.step."""
    rng = random.Random(7)
    synth, aggregator, writer = Synth(), MinuteAggregator(), HistoryWriter(store)
    t = start
    while t < end:
        synth.step(t, **traffic(t, rng))
        writer.submit(aggregator.add(t, synth.samples()))
        if len(writer.unwritten()) >= 1000:  # below MAX_UNWRITTEN_MINUTES, which drops
            writer.write_pending()
        t += step
    writer.submit(aggregator.flush())
    writer.write_pending()
    assert not writer.unwritten() and not writer.failing
    return synth


def _uneven(t, rng):
    """Traffic whose per-minute shares differ a lot, so a mean of per-minute ratios, a
    mean of minute means or a quantile of minute points all differ from the truth."""
    busy = int(t // 3600) % 3 == 0
    n = rng.randint(20, 40) if busy else rng.randint(0, 3)
    latencies = [rng.choice((0.02, 0.022, 0.03, 0.3)) if busy else rng.choice((0.005, 1.5))
                 for _ in range(n)]
    queries = rng.randint(50, 90) if busy else rng.randint(1, 4)
    hits = int(queries * (0.9 if busy else 0.1))
    usage = None if rng.random() < 0.3 else (0.8 if busy else 0.2) + rng.random() / 10
    return {"latencies": latencies, "hits": hits, "queries": queries, "usage": usage,
            "requests": n, "reset_requests": abs(t % 7200 - 1000) < 10}


def _expected(synth: Synth, since: float, until: float) -> dict:
    """The statistics straight from the generated events in [since, until)."""
    inside = [e for e in synth.events if since <= e[0] < until]
    counts = [0] * len(BOUNDS)
    latencies = [v for e in inside for v in e[1]]
    for value in latencies:
        counts[next(i for i, b in enumerate(BOUNDS) if value <= b)] += 1
    cumulative, running = [], 0
    for bound, count in zip(BOUNDS, counts, strict=False):
        running += count
        cumulative.append((bound, running))
    usages = [e[4] for e in inside if e[4] is not None]
    # 25 ms lies inside the bucket (20.1587, 25.3984] ms: linear within it.
    low, high = 0.0201587, 0.0253984
    below = sum(1 for v in latencies if v <= low)
    within = sum(1 for v in latencies if low < v <= high)
    return {"p95": 1e9 * bucket_quantile(0.95, cumulative),
            "p50": 1e9 * bucket_quantile(0.5, cumulative),
            "mean": 1e9 * sum(latencies) / len(latencies), "count": len(latencies),
            "under_100ms": 100.0 * sum(1 for v in latencies if v <= 0.101594) / len(latencies),
            "hit_rate": 100.0 * sum(e[2] for e in inside) / sum(e[3] for e in inside),
            "usage_mean": 100.0 * sum(usages) / len(usages), "usage_n": len(usages),
            "usage_min": 100.0 * min(usages), "usage_max": 100.0 * max(usages),
            "usage_last": 100.0 * usages[-1],
            "under_25ms": 100.0 * (below + within * (0.025 - low) / (high - low))
            / len(latencies),
            "requests": sum(e[5] for e in inside), "errors": sum(e[6] for e in inside)}




def _history_daemon(store, tmp_path, *collectors, window: float = 600) -> Daemon:
    """A daemon on `store` (None: SQLite in the test's state directory), 1 s cycles."""
    return Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                               interval_seconds=1.0, window_seconds=window,
                               store_url=None if store is None or store.is_sqlite
                               else store.url, state_dir=tmp_path / "state"),
                  collectors=list(collectors))


def _sums_match(daemon: Daemon, span: float, want: dict) -> dict:
    """Every statistic made of sums, over the span to NOW from history, equals the one
    computed from the generated events; the latency answer, for more."""
    latency = daemon.query("inference_latency_ns", span, {}, now=NOW,
                           shares={"share_below:100ms": 101.594e6, "share_below:25ms": 25e6})
    assert latency["history"] is True and latency["coverage"] == 1.0
    [series] = latency["series"]
    assert series["samples"] == want["count"]
    assert series["p95"] == pytest.approx(want["p95"], rel=1e-12)
    assert series["p50"] == pytest.approx(want["p50"], rel=1e-12)
    assert series["mean"] == pytest.approx(want["mean"], rel=1e-9)
    assert series["share_below:100ms"] == pytest.approx(want["under_100ms"], rel=1e-12)
    assert series["share_below:25ms"] == pytest.approx(want["under_25ms"], rel=1e-12)
    assert series["rate"] == pytest.approx(want["count"] / span, rel=1e-12)
    [hits] = daemon.query("kv_cache_hit_rate", span, {}, now=NOW)["series"]
    assert hits["mean"] == pytest.approx(want["hit_rate"], rel=1e-12)
    [usage] = daemon.query("kv_cache_usage", span, {}, now=NOW)["series"]
    assert usage["samples"] == want["usage_n"]
    assert usage["mean"] == pytest.approx(want["usage_mean"], rel=1e-12)
    assert (usage["min"], usage["max"], usage["last"]) == pytest.approx(
        (want["usage_min"], want["usage_max"], want["usage_last"]), rel=1e-12)
    return latency


def test_a_24h_window_from_history_equals_the_statistics_of_the_history(store, tmp_path):
    # 26 hours of cycles, 5 s past each 20 s mark: the window cuts two hours off the start.
    synth = load_history(store, NOW - 26 * 3600 + 5, NOW, 20.0, _uneven)
    daemon = _history_daemon(store, tmp_path)
    try:
        since = NOW - 86400
        want = _expected(synth, since, NOW)
        assert _sums_match(daemon, 86400, want)["resolution_seconds"] == 60

        # A counter reset inside the window is an increase from zero, as in memory.
        # A series born inside the window counted from zero.
        errors, rate = daemon.query("requests_per_second", 86400, {}, now=NOW)["series"]
        assert rate["mean"] * (NOW - since) == pytest.approx(want["requests"], rel=1e-9)
        assert rate["rate"] == rate["mean"]
        assert errors["labels"]["status"] == "error" and want["errors"] > 100
        born = next(e[0] for e in synth.events if e[6]) // 60 * 60  # its first minute
        assert errors["mean"] * (NOW - born) == pytest.approx(want["errors"], rel=1e-9)

        # A window that ended in the past (two hours of yesterday) is cut exactly too.
        until = NOW - 86400 + 7200
        past = _expected(synth, until - 3600, until)
        [old] = daemon.query("kv_cache_hit_rate", 3600, {}, now=until)["series"]
        assert old["mean"] == pytest.approx(past["hit_rate"], rel=1e-12)
    finally:
        daemon.close()


@pytest.mark.slow
def test_a_7d_window_reads_groups_of_minutes_and_its_sums_stay_exact(store, tmp_path):
    """A week is read as 7-minute groups folded by the database (1,440 points a series,
    not 10,080): every statistic made of sums (a histogram's count, quantiles, mean and
    shares, a ratio, a rate, a gauge's mean, min, max and last) equals the history's."""
    from ac_observe.daemon.history import group_minute
    synth = load_history(store, NOW - 7 * 86400 - 3 * 3600 + 5, NOW, 60.0, _uneven)
    daemon = _history_daemon(store, tmp_path)
    try:
        span = 7 * 86400
        since = NOW - span
        want = _expected(synth, since, NOW)
        latency = _sums_match(daemon, span, want)
        assert latency["resolution_seconds"] == 7 * 60
        assert len(latency["series"][0]["trend"]) == 24
        assert None not in latency["series"][0]["trend"]
        errors, rate = daemon.query("requests_per_second", span, {}, now=NOW)["series"]
        assert rate["mean"] * span == pytest.approx(want["requests"], rel=1e-9)
        # Off a whole minute, a week touches 10,081 minutes: still 7 a point.
        assert daemon.query("kv_cache_usage", span, {}, now=NOW - 12.3)[
            "resolution_seconds"] == 7 * 60
        assert daemon.query("kv_cache_usage", 86400, {}, now=NOW - 12.3)[
            "resolution_seconds"] == 60
        born = next(e[0] for e in synth.events if e[6]) // 60  # its first minute, whose
        start = group_minute(born, int(since // 60), 7) * 60  # group the zero opens
        assert errors["mean"] * (NOW - start) == pytest.approx(want["errors"], rel=1e-9)
    finally:
        daemon.close()


@pytest.mark.slow
def test_the_cli_answers_window_24h_from_the_daemons_history(tmp_path, start_daemon):
    """`ac-observe --metric ... --window 24h --json` against a running daemon whose store
    holds 23 hours that ended ten minutes ago."""
    import time
    state = tmp_path / "state"
    end = (time.time() // 60 - 10) * 60
    store = Store(None, state)
    synth = load_history(store, end - 23 * 3600 + 5, end, 20.0, _uneven)
    store.close()
    daemon = start_daemon(None, "--state-dir", str(state), "--collectors", "engine")
    # The first cycle only tells where the counters stood: it adds nothing.
    want = _expected(synth, end - 23 * 3600 + 6, end)
    out = subprocess.run([AC_OBSERVE, "--daemon", daemon.url, "--metric", "kv_cache_hit_rate",
                          "--window", "24h", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["history"] is True
    [series] = answer["series"]
    assert series["mean"] == pytest.approx(want["hit_rate"], rel=1e-12)
    # Further back than the history is kept (8 days by default): refused, saying so.
    out = subprocess.run([AC_OBSERVE, "--daemon", daemon.url, "--metric", "kv_cache_hit_rate",
                          "--window", "9d"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "history is kept (8 days" in out.stderr, out
    assert httpx.get(daemon.url + "/api/v1/query", params={
        "metric": "kv_cache_hit_rate", "window": "9d"}, timeout=10).status_code == 400


def test_a_state_dir_it_cannot_write_leaves_history_off_not_the_daemon(tmp_path,
                                                                        start_daemon):
    """History is on by default; a state directory it cannot create (here a path under a
    regular file) turns history off with a warning, and the daemon serves on."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    daemon = start_daemon(None, "--state-dir", str(blocker / "state"), "--collectors",
                          "engine")
    status = httpx.get(daemon.url + "/api/v1/status", timeout=10).json()
    assert status["history"] is False
    assert "history is off: its store cannot be opened" in daemon.log_path.read_text()
    answer = httpx.get(daemon.url + "/api/v1/query", params={
        "metric": "kv_cache_hit_rate", "window": "60s"}, timeout=10)
    assert answer.status_code == 200


RULE = """\
rules:
  - name: LatencyDrift
    metric: inference_latency_ns
    statistic: p95
    window: 5m
    baseline: same_hour_yesterday:1h
    comparison: relative_increase
    threshold: 0.5
    annotations: {summary: "{{ baseline_source }}"}
"""


def _hourly(levels: dict[int, float]):
    """Ten requests a minute, all at the latency of the hour (by its start, UTC)."""
    def traffic(t, _rng):
        return {"latencies": [levels.get(int(t // 3600) * 3600, 0.004)] * 10}
    return traffic


# The same-hour tests' day: each hour at its own latency (by its start, UTC).
SAME_HOUR_LEVELS = {NOW - 86400: 0.1, NOW - 86400 - 3600: 0.4, NOW - 86400 + 3600: 0.6,
                    NOW - 2 * 86400: 0.8, NOW - 3600: 0.2}
DRIFT_AT = NOW + 32 * 60 + 30  # 08:32:30: the hour around the window's middle is 08:00-09:00


def _same_hour_daemon(tmp_path, state, *collectors) -> Daemon:
    (tmp_path / "alerts.yaml").write_text(RULE)
    return Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                               interval_seconds=1.0, window_seconds=3600,
                               alerting_file=tmp_path / "alerts.yaml", state_dir=state,
                               alert_interval_seconds=1.0), collectors=list(collectors))


def _drift(daemon: Daemon, synth: Synth) -> None:
    """65 minutes at 120 ms (within 50 % of any baseline here: nothing fires), then a last
    cycle of 40 requests at 300 ms."""
    for t in range(int(DRIFT_AT) - 3900, int(DRIFT_AT), 5):
        synth.step(t, latencies=[0.12] * 2)
        daemon.run_cycle(now=float(t))
    assert daemon.alerts.active() == []
    synth.step(DRIFT_AT, latencies=[0.12] * 2 + [0.3] * 40)
    daemon.run_cycle(now=DRIFT_AT)


@pytest.mark.parametrize("with_history", [True, False])
@pytest.mark.slow
def test_same_hour_yesterday_compares_against_that_hour(tmp_path, with_history):
    state = tmp_path / "state"
    store = Store(None, state)
    if with_history:  # two days, a cycle a minute, each hour at its own latency
        load_history(store, NOW - 2 * 86400 - 3600, NOW - 600, 60.0, _hourly(SAME_HOUR_LEVELS))
    store.close()
    synth = Synth()
    daemon = _same_hour_daemon(tmp_path, state, SynthCollector(synth))
    try:
        _drift(daemon, synth)
        [alert] = daemon.alerts.active()
        assert alert["state"] == "firing" and alert["firing_since"] == DRIFT_AT
        source = alert["baseline_source"]
        # The firing transition's summary annotation says the same ({{ baseline_source }}).
        assert daemon.alerts.history()[0]["summary"] == source
        if with_history:
            # Yesterday 08:00-09:00 ran at 100 ms; its neighbours (400, 600 ms), the day
            # before (800 ms) and the trailing hour (120 ms) would each give another
            # baseline.
            assert source == "same hour yesterday (08:00-09:00 UTC)"
            assert alert["baseline"] == pytest.approx(1e9 * bucket_quantile(
                0.95, [(b, 600 if b >= 0.101594 else 0) for b in BOUNDS]), rel=1e-12)
        else:
            assert source == ("trailing 3600 s before the window (no history for the same "
                              "hour yesterday yet)")
            assert alert["baseline"] < alert["value"] / 1.5
    finally:
        daemon.close()


@pytest.mark.slow
def test_same_hour_yesterday_is_taken_per_series(tmp_path):
    """e1 ran all of yesterday's hour; e2 only its last 15 minutes (25 % < 75 %): e1 is
    compared with that hour, e2 with its trailing hour, each alert saying which (the
    hour's coverage over all series, 100 %, gave e2 a quarter-hour baseline)."""
    yesterday = NOW - 86400
    state = tmp_path / "state"
    store = Store(None, state)
    load_history(store, NOW - 2 * 86400 - 3600, NOW - 600, 60.0, _hourly(SAME_HOUR_LEVELS))
    e2 = (("engine", "e2"),) + LAT_LABELS[1:]
    first, last = int(yesterday // 60) + 45, int(yesterday // 60) + 59
    names = {"ac_inference_latency_seconds" + s for s in ("_bucket", "_sum", "_count")}
    copied: dict = {}
    for (name, labels), rows in store.read_minutes(names, first, last).items():
        relabelled = (("engine", "e2"),) + labels[1:]
        for minute, *row in rows:
            copied.setdefault(minute, {})[name, relabelled] = list(row)
    store.write_minutes(sorted(copied.items()))
    store.close()
    synth = Synth()
    daemon = _same_hour_daemon(tmp_path, state, SynthCollector(synth),
                               SynthCollector(synth, e2))
    try:
        _drift(daemon, synth)
        alerts = {a["labels"]["engine"]: a for a in daemon.alerts.active()}
        assert alerts["e1"]["baseline_source"] == "same hour yesterday (08:00-09:00 UTC)"
        assert alerts["e2"]["baseline_source"] == (
            "trailing 3600 s before the window (no history for the same hour yesterday yet)")
        assert alerts["e2"]["baseline"] != alerts["e1"]["baseline"]
        answer = daemon.query("inference_latency_ns", 3600, {}, now=yesterday + 3600)
        coverage = {s["labels"]["engine"]: s["coverage"] for s in answer["series"]}
        assert coverage == {"e1": 1.0, "e2": 0.25} and answer["coverage"] == 1.0
    finally:
        daemon.close()


def test_minutes_the_store_cannot_take_are_kept_and_still_answered(tmp_path):
    state = tmp_path / "state"
    synth = Synth()
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=(),
                                 interval_seconds=1.0, window_seconds=60, state_dir=state),
                    collectors=[SynthCollector(synth)])
    real = daemon.store.write_minutes

    def down(_batch):
        raise ConnectionError("store unreachable")

    daemon.store.write_minutes = down
    try:
        for t in range(0, 300, 10):
            synth.step(NOW + t, latencies=[0.01 * (1 + t % 3)])
            daemon.run_cycle(now=NOW + t)
        daemon.history_writer.write_pending()
        assert daemon.history_writer.failing == "ConnectionError"
        assert len(daemon.history_writer.unwritten()) == 4  # minutes 0-3 (4 is current)
        answer = daemon.query("inference_latency_ns", 3600, {}, now=NOW + 300)
        assert answer["history"] and answer["series"][0]["samples"] == 29  # first: base
        daemon.store.write_minutes = real
        daemon.history_writer.write_pending()
        assert not daemon.history_writer.unwritten() and not daemon.history_writer.failing
        again = daemon.query("inference_latency_ns", 3600, {}, now=NOW + 300)
        assert again["series"][0]["samples"] == 29  # written once, not counted twice
    finally:
        daemon.close()
    # The minute in progress is written at shutdown, merged into the same rows.
    reopened = Store(None, state)
    rows = reopened.read_minutes({"ac_inference_latency_seconds_count"}, 0, 10 ** 9)
    assert sum(r[2] for r in rows["ac_inference_latency_seconds_count", LAT_LABELS]) == 29
    reopened.close()


class _LateRequests(Collector):
    """An engine that has served a million requests when its collector first comes up (it
    is down for the first 5 cycles, and again for 130 from cycle 201: longer than two 60 s
    windows, so the windows drop the series), 10 more a cycle."""
    name = "late"

    def __init__(self):
        self.cycle = 0

    def collect(self):
        from ac_observe.collectors.base import CollectorUnavailable
        self.cycle += 1
        if self.cycle <= 5 or 200 < self.cycle <= 330:
            raise CollectorUnavailable("not yet")
        family = new_family(m.REQUESTS)
        family.add_metric(["e1", "m", "throughput", "ok"], 1e6 + 10.0 * self.cycle)
        return [family]


def test_a_collector_up_late_or_back_from_an_outage_books_no_lifetime_as_one_increase(
        tmp_path):
    """Its counters' first values are bases: the rate is 10/s in memory and in the history,
    never a million requests in one interval (a windows-dropped series back after 90 s of
    outage in a 60 s window too)."""
    daemon = _history_daemon(None, tmp_path, _LateRequests(), window=60)
    try:
        for t in range(180):
            daemon.run_cycle(now=NOW + t)
        (series,) = daemon.query("requests_per_second", 60, {}, now=NOW + 179.5)["series"]
        assert series["mean"] == pytest.approx(10.0) and series["max"] == pytest.approx(10.0)
        for t in range(180, 460):
            daemon.run_cycle(now=NOW + t)
            if t == 345:  # back at t=330 after the windows dropped the series: a base again
                (series,) = daemon.query("requests_per_second", 60, {},
                                         now=NOW + 345.5)["series"]
                assert series["max"] == pytest.approx(10.0), series
        daemon.history_writer.write_pending()
        (series,) = daemon.query("requests_per_second", 86400, {}, now=NOW + 460)["series"]
        assert series["max"] < 20.0, series  # no minute holds the million
    finally:
        daemon.close()  # writes the minute in progress too
    store = Store(None, tmp_path / "state")
    (minutes,) = store.read_minutes({"ac_requests_total"}, 0, 10 ** 9).values()
    store.close()
    # Every request counted once from the first base (the outage's 1,300 included, booked
    # when the collector is back), the million before it never.
    assert sum(r[2] for r in minutes) == pytest.approx(10.0 * (460 - 6))


class _EnginesComeAndGo(Collector):
    """Always up. e1 counts 10 a cycle throughout. From cycle 50, e2 (a process that ran
    unseen: a million requests, said through counted_before_seen) and e3 (started just now: 10)."""
    name = "engines"

    def __init__(self):
        self.cycle = 0

    def collect(self):
        self.cycle += 1
        family = new_family(m.REQUESTS)
        family.add_metric(["e1", "m", "throughput", "ok"], 10.0 * self.cycle)
        if self.cycle >= 50:
            family.add_metric(["e2", "m", "throughput", "ok"], 1e6 + 10.0 * self.cycle)
            family.add_metric(["e3", "m", "throughput", "ok"], 10.0 * (self.cycle - 49))
        return [family]

    def counted_before_seen(self):
        return [{"engine": "e2"}] if self.cycle == 50 else []


def test_an_engine_with_a_past_found_while_its_collector_is_up_starts_from_a_base(tmp_path):
    daemon = _history_daemon(None, tmp_path, _EnginesComeAndGo())
    try:
        for t in range(120):
            daemon.run_cycle(now=NOW + t)
        answer = daemon.query("requests_per_second", 100, {}, now=NOW + 119.5)
        peak = {s["labels"]["engine"]: s["max"] for s in answer["series"]}
        # e2's million is a base; e3, born watched, counted its first 10 from zero.
        assert peak == {"e1": pytest.approx(10.0), "e2": pytest.approx(10.0),
                        "e3": pytest.approx(10.0)}, answer
        rows = daemon.history.current()[1]
        totals = {dict(k[1])["engine"]: row[1] for k, row in rows.items()
                  if k[0] == "ac_requests_total"}
        assert totals["e2"] < 1000 and totals["e3"] < 1000, totals
    finally:
        daemon.close()


def test_retention_prunes_history_transitions_and_finished_deliveries_only(store):
    minutes = {("ac_requests_total", REQ_LABELS): [1, 5.0, None, None, None]}
    store.write_minutes([(int(NOW // 60) - 9 * 1440, minutes), (int(NOW // 60), minutes)])
    # A series whose last minute is past retention (its engine gone for good) goes too.
    gone_labels = tuple((k, "gone" if k == "engine" else v) for k, v in REQ_LABELS)
    gone = {("ac_requests_total", gone_labels): [1, 2.0, None, None, None]}
    store.write_minutes([(int(NOW // 60) - 9 * 1440, gone)])
    with store.engine.begin() as connection:
        for at in (NOW - 9 * 86400, NOW):
            connection.execute(alert_transitions.insert().values(
                rule="r", fingerprint="f", labels="{}", from_state="pending",
                to_state="firing", at=at))
    old_done = store.add("ops", "test", {"n": 1}, NOW - 9 * 86400)
    old_pending = store.add("ops", "test", {"n": 2}, NOW - 9 * 86400)
    with store.engine.begin() as connection:
        connection.execute(deliveries.update().where(deliveries.c.id == old_done)
                           .values(state="delivered", finished_at=NOW - 9 * 86400))
    removed = store.prune(NOW - 8 * 86400)
    assert removed == {"minutes": 2, "series": 1, "transitions": 1, "deliveries": 1}
    left = store.read_minutes({"ac_requests_total"}, 0, 10 ** 9)
    assert [r[0] for r in left["ac_requests_total", REQ_LABELS]] == [int(NOW // 60)]
    assert ("ac_requests_total", gone_labels) not in left
    with store.engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(
            history_series)).scalar() == 1
    # The gone series comes back (its engine returns): written under a new id.
    store.write_minutes([(int(NOW // 60), gone)])
    assert store.read_minutes({"ac_requests_total"}, 0, 10 ** 9)[
        "ac_requests_total", gone_labels] == [(int(NOW // 60), 1, 2.0, None, None, None)]
    # Another daemon on the same store pruned a series this one has cached: the stale id
    # fails the foreign key, and the write looks the ids up again.
    with store.engine.begin() as connection:
        connection.execute(history_minutes.delete())
        connection.execute(history_series.delete())
    store.write_minutes([(int(NOW // 60), minutes)])
    assert store.read_minutes({"ac_requests_total"}, 0, 10 ** 9)[
        "ac_requests_total", REQ_LABELS] == [(int(NOW // 60), 1, 5.0, None, None, None)]
    assert store.delivery(old_done) is None and store.delivery(old_pending) is not None


def test_minute_rows_from_blocks_equal_rows_from_a_dict_and_a_reused_column_starts_clean():
    """The aggregator reads a cycle as a Frame of blocks as it reads a dict, to the same
    rows. A gauge absent a whole minute gives its column back: the series that takes it
    starts a row of its own (nothing of the old one's n, min, max or last). A counter
    unseen for FORGET_AFTER_MINUTES is forgotten: back, it counts from zero (100), not
    from its old value (100 - 12)."""
    import numpy as np

    from ac_observe.daemon.history import COUNTER, FORGET_AFTER_MINUTES, GAUGE
    from ac_observe.daemon.windows import Frame

    def key(name, engine):
        return (name, (("engine", engine),))

    a, b, d, e = (key("g", x) for x in "abde")
    c = key("c", "c")
    cycles = [(0, {a: 5.0, c: 10.0}), (20, {a: 1.0, c: 15.0}), (40, {a: 3.0, c: 12.0}),
              (60, {b: 7.0, c: 12.0}), (80, {b: 2.0, c: 12.0}), (120, {d: 4.0, e: 0.0})]
    cycles += [(60 * minute, {e: float(minute)})
               for minute in range(3, FORGET_AFTER_MINUTES + 5)]
    cycles += [(60 * (FORGET_AFTER_MINUTES + 5), {c: 100.0, e: 1.0}), (10 ** 6, {e: 0.0})]
    finished = {"dict": {}, "frame": {}}
    aggregators = {way: MinuteAggregator({"g": GAUGE, "c": COUNTER}) for way in finished}
    blocks: dict[tuple, tuple] = {}
    for t, samples in cycles:
        keys = blocks.setdefault(tuple(samples), tuple(samples))  # the same tuple each time
        frame = Frame([(keys, np.array(list(samples.values())))])
        for way, cycle in (("dict", samples), ("frame", frame)):
            done = aggregators[way].add(float(t), cycle)
            if done:
                finished[way][done[0]] = done[1]
        if t == 120:
            taken = aggregators["frame"].columns.column[d]
    assert finished["dict"] == finished["frame"]
    minutes = finished["frame"]
    assert minutes[0] == {a: [3, 9.0, 1.0, 5.0, 3.0],
                          c: [2, 5.0 + 12.0, None, None, None]}  # a base, then a reset
    assert minutes[1] == {b: [2, 9.0, 2.0, 7.0, 2.0], c: [2, 0.0, None, None, None]}
    assert minutes[2] == {d: [1, 4.0, 4.0, 4.0, 4.0], e: [1, 0.0, 0.0, 0.0, 0.0]}
    assert taken == 0  # a's column, given back after a minute without it
    back = minutes[FORGET_AFTER_MINUTES + 5]
    assert back[c] == [1, 100.0, None, None, None]
