"""Window statistics: histogram quantiles from bucket deltas, ratios, rates with resets."""
from __future__ import annotations

import math
import re

import pytest

from ac_observe.daemon.query import QueryEngine, bucket_quantile, parse_labels
from ac_observe.daemon.windows import Windows
from ac_observe.durations import parse_duration
from support.servers import wait_for

LABELS = (("engine", "e"), ("model", "m"), ("stream", "throughput"))


def _hist_samples(counts_by_le: dict[float, float], total_sum: float, labels=LABELS,
                  family="ac_inference_latency_seconds"):
    samples, cumulative = {}, 0.0
    for le in sorted(counts_by_le):
        cumulative += counts_by_le[le]
        le_text = "+Inf" if math.isinf(le) else repr(le)
        samples[(family + "_bucket", labels + (("le", le_text),))] = cumulative
    samples[(family + "_count", labels)] = cumulative
    samples[(family + "_sum", labels)] = total_sum
    return samples


def test_histogram_answer_uses_only_observations_inside_the_window():
    windows = Windows(capacity=100)
    engine = QueryEngine(windows, interval_seconds=1.0)
    # Before the window: 1000 slow observations. Inside: 10 at ~10 ms, 10 at ~30 ms.
    windows.append(0.0, _hist_samples({0.01: 0, 0.02: 0, 0.04: 0, 1.0: 1000, math.inf: 0}, 900.0))
    windows.append(50.0, _hist_samples({0.01: 0, 0.02: 0, 0.04: 0, 1.0: 1000, math.inf: 0}, 900.0))
    windows.append(51.0, _hist_samples({0.01: 0, 0.02: 10, 0.04: 0, 1.0: 1000, math.inf: 0}, 900.1))
    windows.append(52.0, _hist_samples({0.01: 0, 0.02: 10, 0.04: 10, 1.0: 1000, math.inf: 0},
                                       900.4))
    result = engine.query("inference_latency_ns", 5.0, {}, now=52.5)
    (series,) = result["series"]
    assert series["samples"] == 20
    assert series["mean"] == pytest.approx(0.4 / 20 * 1e9)
    assert series["p50"] == pytest.approx(0.02e9)           # rank 10 ends the 10-20 ms bucket
    assert series["p95"] == pytest.approx((0.02 + 0.02 * 9 / 10) * 1e9)
    assert series["min"] is None and series["max"] is None  # a histogram keeps no extremes
    assert series["min_bucket_le"] == pytest.approx(0.02e9)
    assert series["max_bucket_le"] == pytest.approx(0.04e9)
    assert series["last"] == pytest.approx(0.03e9)          # the last interval: 10 obs, 0.3 s


def test_an_answer_pinned_at_a_cycle_is_that_cycles_answer_whatever_came_since():
    """as_of names the newest cycle read; an answer asked at a time reads only the cycles up
    to it, so asked again at that time after more cycles it is the same answer."""
    windows = Windows(capacity=100)
    engine = QueryEngine(windows, interval_seconds=1.0)
    gauge = "ac_kv_cache_usage_ratio"
    for t, value in ((10.0, 0.1), (11.0, 0.2), (12.0, 0.6)):
        windows.append(t, {(gauge, (("engine", "e"), ("model", "m"))): value})
    assert engine.query("kv_cache_usage", 5.0, {}, now=12.4)["as_of"] == 12.0
    first = engine.query("kv_cache_usage", 5.0, {}, now=12.0)
    assert first["as_of"] == 12.0
    assert first["series"][0]["last"] == pytest.approx(60.0)
    for t, value in ((13.0, 0.9), (14.0, 0.05)):
        windows.append(t, {(gauge, (("engine", "e"), ("model", "m"))): value})
    assert engine.query("kv_cache_usage", 5.0, {}, now=12.0) == first
    later = engine.query("kv_cache_usage", 5.0, {}, now=14.2)
    assert later["as_of"] == 14.0 and later["series"][0]["last"] == pytest.approx(5.0)
    assert engine.query("kv_cache_usage", 5.0, {}, now=9.0)["as_of"] is None  # before any


def test_a_histograms_rate_is_over_the_span_watched_not_the_whole_window():
    """A daemon 30 s old asked for a 300 s window: 10 observations/s over what it watched
    (the count's increase over /window would say 1/s)."""
    windows = Windows(capacity=1000)
    engine = QueryEngine(windows, interval_seconds=1.0)
    for t in range(31):
        windows.append(100.0 + t, _hist_samples({0.01: 10 * t, math.inf: 0}, 0.005 * 10 * t))
    (series,) = engine.query("inference_latency_ns", 300.0, {}, now=130.5)["series"]
    assert series["samples"] == 300
    assert series["rate"] == pytest.approx(10.0)
    # Watched all along: the window's own span (299 s between its first and last cycles).
    for t in range(31, 700):
        windows.append(100.0 + t, _hist_samples({0.01: 10 * t, math.inf: 0}, 0.005 * 10 * t))
    (series,) = engine.query("inference_latency_ns", 300.0, {}, now=799.5)["series"]
    assert series["rate"] == pytest.approx(10.0)


def test_bucket_quantile_matches_prometheus_interpolation():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 10.0), (math.inf, 10.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * (5 - 2) / 4)
    assert bucket_quantile(0.1, buckets) == pytest.approx(0.05)
    assert bucket_quantile(1.0, buckets) == pytest.approx(0.4)
    assert bucket_quantile(0.99, [(1.0, 0.0), (math.inf, 5.0)]) == 1.0  # +Inf: last finite bound


def test_a_whole_number_histograms_quantiles_and_shares_are_observed_values():
    """Skeleton depths: three prompts of depth 2 and one of 5. The p50 is 2 and the p95 5
    (interpolating inside the buckets would say 1.67 and 4.8), and the share at or below
    4.5 is 75 % (interpolating: 87.5 %)."""
    from ac_observe.daemon.query import _friendly
    windows = Windows(capacity=10)
    engine = QueryEngine(windows, interval_seconds=1.0)
    labels = (("engine", "e"), ("model", "m"))
    edges = [float(d) for d in range(1, 17)] + [math.inf]
    for t, depths in enumerate(([], [2, 2, 2, 5])):
        counts = {le: sum(1 for d in depths if (le == math.inf or d <= le) and
                          (le == 1.0 or d > edges[edges.index(le) - 1])) for le in edges}
        windows.append(float(t), _hist_samples(counts, float(sum(depths)), labels,
                                               "ac_skeleton_complexity"))
    (series,) = engine.query("skeleton_complexity", 10, {}, now=1.0)["series"]
    assert (series["p50"], series["p95"], series["p99"]) == (2.0, 5.0, 5.0)
    assert series["mean"] == pytest.approx(11 / 4)
    friendly = _friendly("skeleton_complexity")
    view = windows.view(friendly.sample_names(), -9.0, 1.0)
    (shared,) = engine.answer(view, friendly, 10, -9.0, {}, {"share": 4.5})["series"]
    assert shared["share"] == pytest.approx(75.0)
    # A latency histogram still interpolates as histogram_quantile does.
    assert not _friendly("inference_latency_ns").source.whole
    from ac_observe.metrics import MetricSpec
    for buckets in ((1.0, 3.0), (1.5, 2.5), ()):  # a bucket at each whole number, or no
        with pytest.raises(ValueError, match="a bucket at each whole number"):
            MetricSpec("ac_x", "histogram" if buckets else "gauge", "x", (), "engine", "",
                       buckets, whole=True)


def test_ratio_is_delta_over_delta_and_rate_survives_a_counter_reset():
    windows = Windows(capacity=10)
    engine = QueryEngine(windows, interval_seconds=1.0)
    labels = (("engine", "e"), ("model", "m"))
    hits, queries = [0, 5, 5, 14], [10, 20, 20, 30]
    tokens = [100, 150, 10, 60]  # reset between t=1 and t=2
    for t, (h, q, n) in enumerate(zip(hits, queries, tokens, strict=False)):
        windows.append(float(t), {("ac_kv_cache_hit_blocks_total", labels): h,
                                  ("ac_kv_cache_query_blocks_total", labels): q,
                                  ("ac_generation_tokens_total", labels): n})
    (hit,) = engine.query("kv_cache_hit_rate", 10, {}, now=3.0)["series"]
    assert hit["mean"] == pytest.approx(100 * 14 / 20)
    assert hit["min"] == pytest.approx(50.0) and hit["max"] == pytest.approx(90.0)
    assert hit["last"] == pytest.approx(90.0)
    (rate,) = engine.query("generation_tokens_per_second", 10, {}, now=3.0)["series"]
    assert rate["mean"] == pytest.approx((50 + 10 + 50) / 3)
    assert rate["min"] == pytest.approx(10.0)


def test_label_filter_and_unknown_metric():
    windows = Windows(capacity=10)
    engine = QueryEngine(windows, interval_seconds=1.0)
    for t in range(3):
        windows.append(float(t), {
            ("ac_cuda_stream_utilization", LABELS): 0.5,
            ("ac_cuda_stream_utilization", LABELS[:2] + (("stream", "low_latency"),)): 0.25})
    result = engine.query("cuda_stream_utilization", 60, {"stream": "low_latency"}, now=2.0)
    assert [s["mean"] for s in result["series"]] == [25.0]
    with pytest.raises(KeyError):
        engine.query("no_such_metric", 60, {}, now=2.0)


def test_duration_and_label_parsing():
    assert parse_duration("60s") == 60 and parse_duration("5m") == 300
    assert parse_duration("1h") == 3600 and parse_duration("250ms") == 0.25
    with pytest.raises(ValueError):
        parse_duration("soon")
    assert parse_labels("stream=low_latency, engine=e1") == {"stream": "low_latency",
                                                              "engine": "e1"}
    with pytest.raises(ValueError):
        parse_labels("stream")
    known = ("engine", "model", "stream")
    assert parse_labels("engine=a=b", known) == {"engine": "a=b"}  # a value may hold '='
    for bad, words in (("=x", "is not a label name"), ("stream=", "give stream a value"),
                       ("a b=c", "is not a label name"),
                       ("strem=low_latency", "no label 'strem' (labels: engine, model, "
                                             "stream)"),
                       ("stream=low_latency,stream=throughput", "'stream' given twice")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_labels(bad, known)


def test_hit_rate_is_the_ratio_of_increases_not_a_mean_of_ratios():
    """1 hit of 1 lookup, then 0 of 99: the window's hit rate is 1 %, not (100 % + 0 %) / 2."""
    windows = Windows(capacity=10)
    engine = QueryEngine(windows, interval_seconds=1.0)
    labels = (("engine", "e"), ("model", "m"))
    for t, (hits, queries) in enumerate([(0, 0), (1, 1), (1, 100)]):
        windows.append(float(t), {("ac_kv_cache_hit_blocks_total", labels): hits,
                                  ("ac_kv_cache_query_blocks_total", labels): queries})
    (series,) = engine.query("kv_cache_hit_rate", 10, {}, now=2.0)["series"]
    assert series["mean"] == pytest.approx(1.0)
    assert (series["min"], series["max"], series["last"]) == (0.0, 100.0, 0.0)


@pytest.mark.slow
def test_queries_during_cycles_read_one_consistent_state(tmp_path):  # noqa: C901 - threads and checks together
    """Cycles append while four threads query, until the ring has wrapped 20 times: every
    answer equals the serial one (hit rate 60 %, rate 7/s at every interval), never an error
    or a point out of order."""
    import threading

    from ac_observe import metrics as m
    from ac_observe.collectors.base import Collector, new_family
    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.service import Daemon

    class Counting(Collector):
        name = "counting"
        cycle = 0

        def collect(self):
            self.cycle += 1
            families = []
            # Hits and lookups grow faster each cycle (a torn read mixes cycles and moves
            # the ratio off 60 %); tokens grow by 7 a cycle (1 s): a rate of 7/s.
            growth = self.cycle * (self.cycle + 1) / 2
            for spec, value in ((m.KV_HIT_BLOCKS, 3 * growth), (m.KV_QUERY_BLOCKS, 5 * growth),
                                (m.GENERATION_TOKENS, 7 * self.cycle)):
                family = new_family(spec)
                family.add_metric(["e", "m"], value)
                families.append(family)
            return families

    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, window_seconds=200, history=False),
                    collectors=[Counting()])
    stop, failures, answers = threading.Event(), [], [0]

    def cycles():
        t = 0
        while not stop.is_set():
            t += 1
            daemon.run_cycle(now=float(t))

    def queries():
        while not stop.is_set():
            try:
                for name, expected in (("kv_cache_hit_rate", 60.0),
                                       ("generation_tokens_per_second", 7.0)):
                    for series in daemon.query(name, 1e9, {}, now=1e8)["series"]:
                        got = (series["min"], series["mean"], series["max"], series["last"])
                        if any(v != pytest.approx(expected) for v in got):
                            failures.append((name, got))
                answers[0] += 1
            except Exception as exc:  # noqa: BLE001 - any error is the finding
                failures.append(repr(exc))

    threads = [threading.Thread(target=cycles)] + [threading.Thread(target=queries)
                                                   for _ in range(4)]
    import sys
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        for thread in threads:
            thread.start()
        # Until the ring has wrapped 20 times under the readers and they have answered
        # 10,000 times (about 10 s on two busy cores), or something failed: a loaded
        # machine takes longer, never fewer interleavings.
        wait_for(lambda: failures or (answers[0] >= 10_000 and
                                      daemon.windows.cycle >= 20 * daemon.windows.capacity),
                 120, "20 wraps of the ring and 10,000 answers", interval=0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switch)
        daemon.close()
    assert not failures, failures[:5]
    assert answers[0] > 50 and daemon.windows.cycle > 200  # the ring wrapped, often


def test_latency_quantiles_from_the_buckets_are_within_10_percent():
    """Latencies from 1 ms to 10 s: spread over the whole range (log-uniform) and, as TTFTs
    usually are, clustered (lognormal, sigma 0.2) around nine centres from 1.5 ms to 6 s.
    The daemon's p50/p95/p99 from the contract's latency buckets are within 10 % of the
    exact sample quantiles (the buckets before this contract were off by up to 37 %)."""
    import bisect
    import random

    from ac_observe.metrics import LATENCY_BUCKETS_SECONDS as bounds

    rng = random.Random(7)
    draws = {"log-uniform": [10 ** rng.uniform(-3, 1) for _ in range(50_000)]}
    for centre in (0.0015, 0.005, 0.013, 0.03, 0.1, 0.3, 1.0, 2.5, 6.0):
        draws[f"around {centre} s"] = [rng.lognormvariate(math.log(centre), 0.2)
                                       for _ in range(20_000)]
    for name, values in draws.items():
        counts = [0] * (len(bounds) + 1)
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1
        windows = Windows(capacity=10)
        engine = QueryEngine(windows, interval_seconds=1.0)
        empty = {b: 0 for b in (*bounds, math.inf)}
        windows.append(0.0, _hist_samples(empty, 0.0))
        windows.append(1.0, _hist_samples(dict(zip((*bounds, math.inf), counts, strict=False)),
                                          sum(values)))
        (series,) = engine.query("inference_latency_ns", 10, {}, now=1.0)["series"]
        ordered = sorted(values)
        for q, key in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            exact = ordered[int(q * (len(ordered) - 1))] * 1e9
            assert abs(series[key] - exact) / exact < 0.10, (name, key, series[key], exact)


def test_a_series_absent_a_whole_window_is_dropped_and_one_back_in_time_is_kept():
    """A series missing for every cycle of the window leaves the windows (its memory with
    it); one missing for less, then back, keeps its ring, NaN where it was absent."""
    windows = Windows(capacity=4)
    name = "ac_kv_cache_usage_ratio"
    a, b, c = ((name, (("engine", e),)) for e in "abc")
    for t in range(8):  # a: cycles 0-3, then gone for 4-7, exactly a window
        windows.append(float(t), {b: float(t), **({a: 1.0} if t < 4 else {}),
                                  **({c: 1.0} if t in (0, 4) else {})})
    # The cleanup after cycle 7: a missed the whole window (4-7); c was there at 4.
    assert a not in windows.series and a not in windows.first_seen
    assert a not in windows.by_sample[name]
    assert c in windows.series and b in windows.series
    assert windows.view({name}, 0.0).points(c) == [(4.0, 1.0)]
    for t in range(8, 12):
        windows.append(float(t), {b: float(t)})
    assert c not in windows.series  # gone since cycle 5: dropped after cycle 11
    assert windows.view({name}, 8.0).points(b) == [(8.0, 8.0), (9.0, 9.0), (10.0, 10.0),
                                                   (11.0, 11.0)]


def test_windows_hold_blocks_and_loose_samples_alike_across_chunks_and_reuse_columns_clean():
    """A cycle comes as blocks (a collector's keys tuple, kept while its series stay, and
    an array of values) and loose samples; over several chunks of columns every series
    reads back exactly its own values. A block that changes its keys leaves the dropped
    series NaN; once they are gone for a whole window their columns go to new series,
    which read back only their own values (nothing left from the old ones)."""
    import numpy as np

    from ac_observe.daemon.windows import CHUNK, Frame
    name = "ac_kv_cache_usage_ratio"
    keys = tuple((name, (("engine", f"b{i}"),)) for i in range(CHUNK + 100))
    loose = [(name, (("engine", f"l{i}"),)) for i in range(CHUNK)]
    windows = Windows(capacity=3)

    def value(i, t):
        return 1000.0 * t + i

    for t in range(3):
        block = np.array([value(i, t) for i in range(len(keys))])
        windows.append(float(t), Frame([(keys, block)],
                                       {k: -value(i, t) for i, k in enumerate(loose)}))
    view = windows.view({name}, 0.0)
    for i in (0, CHUNK - 1, CHUNK, len(keys) - 1):
        assert view.points(keys[i]) == [(float(t), value(i, t)) for t in range(3)]
    assert view.points(loose[CHUNK - 1]) == [(float(t), -value(CHUNK - 1, t))
                                             for t in range(3)]
    # The block loses its first 50 series and gains 50 new ones (a new keys tuple).
    fresh = tuple((name, (("engine", f"n{i}"),)) for i in range(50))
    changed = keys[50:] + fresh
    for t in range(3, 6):
        block = np.array([1e6 + 1000.0 * t + i for i in range(len(changed))])
        windows.append(float(t), Frame([(changed, block)]))
    assert keys[0] not in windows.series and loose[0] not in windows.series  # a window gone
    view = windows.view({name}, 0.0)
    assert view.points(keys[50]) == [(float(t), 1e6 + 1000.0 * t) for t in range(3, 6)]
    for i, key in enumerate(fresh):
        assert view.points(key) == [(float(t), 1e6 + 1000.0 * t + len(changed) - 50 + i)
                                    for t in range(3, 6)]
    # New series take the released columns, and start with nothing in them.
    later = tuple((name, (("engine", f"z{i}"),)) for i in range(CHUNK))
    windows.append(6.0, Frame([(later, np.arange(CHUNK, dtype=float))]))
    assert max(windows.series[k] for k in later) < len(keys) + len(loose) + len(fresh)
    taken = sorted(windows.series[k] for k in later)  # the lowest free first: keys[:50]'s
    assert taken[:50] == list(range(50))
    view = windows.view({name}, 0.0)
    assert all(view.points(k) == [(6.0, float(i))] for i, k in enumerate(later))


def test_a_spike_of_series_gives_its_memory_back_once_gone_for_a_window():
    """600 series for one cycle, then 10 of them: once the rest have been gone a whole
    window the chunks past the last live column are freed (one left of three), and new
    series take the lowest free columns."""
    import numpy as np

    from ac_observe.daemon.windows import CHUNK, Frame
    name = "ac_kv_cache_usage_ratio"
    keys = tuple((name, (("engine", f"e{i}"),)) for i in range(600))
    assert 600 > 2 * CHUNK
    windows = Windows(capacity=2)
    windows.append(0.0, Frame([(keys, np.ones(600))]))
    assert len(windows._chunks) == 3
    for t in range(1, 5):
        windows.append(float(t), Frame([(keys[:10], np.full(10, float(t)))]))
    assert len(windows.series) == 10 and len(windows._chunks) == 1
    fresh = (name, (("engine", "new"),))
    windows.append(5.0, {fresh: 7.0})
    assert windows.series[fresh] == 10  # the lowest free column
    assert windows.view({name}, 5.0).points(fresh) == [(5.0, 7.0)]
    assert windows.view({name}, 4.0).points(keys[9]) == [(4.0, 4.0)]
