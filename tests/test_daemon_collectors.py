"""Collector isolation in the daemon, and the NVML collector through the real pynvml."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily

from ac_observe.collectors.base import Collector, CollectorUnavailable
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from support.servers import sample_value
from support.standins import build_nvml


class Ticker(Collector):
    name = "ticker"

    def __init__(self):
        self.count = 0

    def collect(self):
        self.count += 1
        gauge = GaugeMetricFamily("ac_test_ticks", "Calls so far.")
        gauge.add_metric([], self.count)
        return [gauge]


class Raiser(Collector):
    name = "raiser"
    broken = True

    def collect(self):
        if self.broken:
            raise RuntimeError("source exploded")
        gauge = GaugeMetricFamily("ac_test_raiser_ok", "Recovered.")
        gauge.add_metric([], 1)
        return [gauge]


class Hanger(Collector):
    name = "hanger"
    timeout_seconds = 0.3

    def __init__(self):
        self.release = threading.Event()

    def collect(self):
        self.release.wait()
        return []


class Missing(Collector):
    name = "missing"

    def collect(self):
        raise CollectorUnavailable("no such device here")


def _parse(daemon: Daemon) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(daemon.render_metrics().decode())
            for s in fam.samples}


def test_raising_and_hanging_collectors_are_isolated_and_recover(tmp_path):
    ticker, raiser, hanger, missing = Ticker(), Raiser(), Hanger(), Missing()
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, collector_timeout_seconds=0.3),
                    collectors=[ticker, raiser, hanger, missing])
    try:
        for cycle in range(1, 4):
            started = time.monotonic()
            daemon.run_cycle()
            assert time.monotonic() - started < 1.0  # a hang costs at most its timeout
            metrics = _parse(daemon)
            assert sample_value(metrics, "ac_test_ticks") == cycle  # fresh every cycle
            assert sample_value(metrics, "ac_collector_up", collector="ticker") == 1
            assert sample_value(metrics, "ac_collector_up", collector="raiser") == 0
            assert sample_value(metrics, "ac_collector_up", collector="hanger") == 0
            assert sample_value(metrics, "ac_collector_up", collector="missing") == 0
        status = {c["name"]: c for c in daemon.status()["collectors"]}
        assert "source exploded" in status["raiser"]["reason"]
        assert status["hanger"]["reason"].startswith("hung")
        assert status["missing"]["reason"] == "no such device here"
        assert sample_value(metrics, "ac_collector_errors_total", collector="raiser") == 3
        assert sample_value(metrics, "ac_collector_errors_total", collector="hanger") == 1
        assert sample_value(metrics, "ac_collector_errors_total", collector="missing") == 0
        raiser.broken = False
        hanger.release.set()
        time.sleep(0.1)
        daemon.run_cycle()
        daemon.run_cycle()
        metrics = _parse(daemon)
        assert sample_value(metrics, "ac_collector_up", collector="raiser") == 1
        assert sample_value(metrics, "ac_collector_up", collector="hanger") == 1
        assert sample_value(metrics, "ac_test_raiser_ok") == 1
    finally:
        hanger.release.set()
        daemon.close()


@pytest.fixture(scope="module")
def nvml_standin(tmp_path_factory) -> Path:
    return build_nvml(tmp_path_factory.mktemp("nvml"))


def test_nvml_collector_exports_the_libraries_values_exactly(start_daemon, nvml_standin):
    daemon = start_daemon(None, "--collectors", "nvml",
                          env={"LD_LIBRARY_PATH": str(nvml_standin)})
    deadline = time.monotonic() + 20
    while True:
        metrics = daemon.metrics()
        if sample_value(metrics, "ac_gpu_sm_occupancy_ratio", gpu="0") is not None:
            break
        assert time.monotonic() < deadline, daemon.log_path.read_text()
        time.sleep(0.2)
    uuid0 = "GPU-11111111-2222-3333-4444-000000000000"
    uuid1 = "GPU-11111111-2222-3333-4444-000000000001"
    g0, g1 = {"gpu": "0", "uuid": uuid0}, {"gpu": "1", "uuid": uuid1}
    expected = {
        ("ac_gpu_utilization_ratio", "0"): 0.37, ("ac_gpu_utilization_ratio", "1"): 0.91,
        ("ac_gpu_memory_used_bytes", "0"): 1 << 30, ("ac_gpu_memory_used_bytes", "1"): 40 << 30,
        ("ac_gpu_memory_total_bytes", "0"): 80 << 30, ("ac_gpu_power_watts", "0"): 123.456,
        ("ac_gpu_temperature_celsius", "0"): 61, ("ac_gpu_temperature_celsius", "1"): 72,
        ("ac_gpu_sm_clock_hertz", "0"): 1.41e9, ("ac_gpu_sm_clock_hertz", "1"): 1.98e9,
        ("ac_gpu_sm_occupancy_ratio", "0"): 0.455, ("ac_gpu_sm_active_ratio", "0"): 0.8025,
        ("ac_gpu_tensor_active_ratio", "0"): 0.125, ("ac_gpu_dram_active_ratio", "0"): 0.33,
    }
    for (name, gpu), value in expected.items():
        labels = g0 if gpu == "0" else g1
        assert sample_value(metrics, name, **labels) == pytest.approx(value, rel=1e-12), name
    # Not supported on GPU 1: skipped, not zero, not an error.
    assert sample_value(metrics, "ac_gpu_power_watts", **g1) is None
    assert sample_value(metrics, "ac_gpu_sm_occupancy_ratio", **g1) is None
    assert sample_value(metrics, "ac_gpu_process_memory_bytes", pid="4242", **g0) == 512 << 20
    # XID errors by code: GPU 1's two events (79, 48); GPU 0 has none, so no series.
    assert sample_value(metrics, "ac_gpu_xid_errors_total", xid="79", **g1) == 1
    assert sample_value(metrics, "ac_gpu_xid_errors_total", xid="48", **g1) == 1
    assert sample_value(metrics, "ac_gpu_xid_errors_total", **g0) is None
    # MIG: GPU 1's two MIG devices, and its process with its GPU and compute instance.
    for instance in ("1", "2"):
        assert sample_value(metrics, "ac_gpu_mig_device_info", gpu_instance=instance,
                            compute_instance="0",
                            mig_uuid=f"MIG-aaaaaaaa-bbbb-cccc-dddd-00000000000{instance}",
                            **g1) == 1
    assert sample_value(metrics, "ac_gpu_mig_device_info", **g0) is None
    assert sample_value(metrics, "ac_gpu_process_memory_bytes", pid="4343", gpu_instance="2",
                        compute_instance="0", **g1) == 256 << 20
    (outside_mig,) = [labels for (name, labels) in metrics
                      if name == "ac_gpu_process_memory_bytes" and ("pid", "4242") in labels]
    assert not {k for k, _ in outside_mig} & {"gpu_instance", "compute_instance"}
    assert sample_value(metrics, "ac_collector_up", collector="nvml") == 1


def test_nvml_without_a_library_is_down_with_a_reason(start_daemon):
    import httpx
    daemon = start_daemon(None, "--collectors", "engine,nvml", env={"LD_LIBRARY_PATH": ""})
    daemon.wait_cycles(1)  # one that began after the start: nvml has tried and failed
    metrics = daemon.metrics()
    assert sample_value(metrics, "ac_collector_up", collector="nvml") == 0
    assert sample_value(metrics, "ac_collector_up", collector="engine") == 1
    assert not [k for k in metrics if k[0].startswith("ac_gpu_")]
    status = httpx.get(daemon.url + "/api/v1/status").json()
    nvml = next(c for c in status["collectors"] if c["name"] == "nvml")
    assert "libnvidia-ml.so.1 not found" in nvml["reason"]


def test_the_engine_collector_tells_an_engine_with_a_past_from_one_born_since(tmp_path):
    """Exported now and not at the last look: with a past at the daemon's first look or if
    it started before it, if it started before the last look and that look saw its
    directory (back from a bad spell), if it started before the look before last (found
    late), without a finite start time, or with an earlier process's files; from zero if it
    started since, or started just before the last look and was unseen by it (its
    engine.json came after)."""
    from types import SimpleNamespace

    from ac_observe.collectors.engine import EngineCollector, EngineState
    collector = EngineCollector(SimpleNamespace(telemetry_root=tmp_path, engine_stale_seconds=10,
                                                engine_grace_seconds=60, telemetry_owner=None))

    def look(now, bad=(), inherited=(), **started):
        seen = {f"dir-{e}": EngineState(f"dir-{e}", {"engine": e, "started_at": t}
                                        if t is not None else {"engine": e}, True, now,
                                        inherited=e in inherited)
                for e, t in started.items()}
        seen.update({f"dir-{e}": EngineState(f"dir-{e}", {}, False, 0.0, "bad") for e in bad})
        collector._note_new_engines({e: f"dir-{e}" for e in started}, seen, now)
        return sorted(s["engine"] for s in collector.counted_before_seen())

    assert look(100.0, a=50.0) == ["a"]                   # the first look: all have a past
    assert look(101.0, a=50.0, b=100.5, x=99.0) == ["x"]  # b started after the last look;
    # x before the daemon's first look, which did not see it (past its grace, say)
    assert look(102.0, a=50.0, b=100.5) == []             # nothing new
    assert look(103.0, bad=["a"], b=100.5) == []          # a: a bad directory ...
    assert look(104.0, a=50.0, b=100.5, c=None, d=102.99) == ["a", "c"]  # ... back;
    # c: no start time; d: started before the last look, its engine.json after it
    assert look(105.0, a=50.0, b=100.5, c=None, d=102.99, e=102.5) == ["e"]  # e: found late
    assert look(106.0, a=50.0, b=100.5, c=None, d=102.99, e=102.5, f=105.5) == []
    assert look(107.0, bad=["f", "g"], a=50.0) == []      # two bad directories, back: g's
    assert look(108.0, a=50.0, f=107.5, g=106.5) == ["g"]  # engine started before the look
    # that found it bad; f's is another engine now, started since
    assert look(109.0, a=50.0, h=float("nan"), i=108.5, inherited=["i"]) == ["h", "i"]
    # h: no finite start time; i: started since, but its counts carry on from the files of
    # an earlier process in its directory


def test_an_engine_that_carries_on_an_earlier_processes_counts_has_a_past(tmp_path):
    """A directory left by an engine the daemon forgot (its files stay: a read-only
    mount): a new engine there, started after the daemon's looks, counts on from the old
    process's counters, so its first values are a base, not its predecessor's lifetime as
    one interval's increase. Without them it would count from zero."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.metrics import REQUESTS

    root = tmp_path / "telemetry"
    root.mkdir()
    subprocess.run([sys.executable, "-c", f"""
from ac_observe.engine.telemetry import TelemetryWriter
from ac_observe.metrics import REQUESTS
w = TelemetryWriter({str(root / "e1")!r}, {{}}, engine="e1", model="m")
w.inc(REQUESTS, 500, stream="throughput", status="ok")
w.close()
"""], check=True)
    (root / "e1" / "engine.json").unlink()  # forgotten: no engine there now
    collector = EngineCollector(SimpleNamespace(telemetry_root=root, engine_stale_seconds=10,
                                                engine_grace_seconds=60, telemetry_owner=None))
    for _ in range(2):
        collector.collect()
        time.sleep(0.02)
    writer = TelemetryWriter(root / "e1", {}, engine="e1", model="m")
    other = TelemetryWriter(root / "e2", {}, engine="e2", model="m")
    try:
        writer.inc(REQUESTS, 1, stream="throughput", status="ok")
        collector.collect()
        assert collector.engines["e1"].inherited and not collector.engines["e2"].inherited
        assert collector.counted_before_seen() == [{"engine": "e1"}]
    finally:
        writer.close()
        other.close()


def test_an_engine_whose_files_came_after_the_daemons_look_counts_from_zero(tmp_path):
    """The engine takes its start time, the daemon looks (no engine.json yet), the engine
    writes its files and serves three requests before the next look: the window counts
    those three, not a base of three and nothing since (that lost a test's requests)."""
    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.metrics import INFERENCE_LATENCY

    root = tmp_path / "telemetry"
    root.mkdir()
    config = DaemonConfig(telemetry_root=root, collectors=(), interval_seconds=0.1,
                          window_seconds=600)
    daemon = Daemon(config, collectors=[EngineCollector(config)])
    writer = None
    try:
        daemon.run_cycle()  # the daemon's first look: nothing there
        time.sleep(0.1)
        started = time.time()
        time.sleep(0.1)
        daemon.run_cycle()  # after the engine's start time, before its files
        writer = TelemetryWriter(root / "e1", {"started_at": started}, engine="e1", model="m")
        for seconds in (0.02, 0.04, 0.3):
            writer.observe(INFERENCE_LATENCY, seconds, stream="low_latency")
        time.sleep(0.1)
        daemon.run_cycle()
        [series] = [s for s in daemon.query("inference_latency_ns", 60.0, {"engine": "e1"})
                    ["series"] if s["labels"]["stream"] == "low_latency"]
        assert series["samples"] == 3
        assert series["mean"] == pytest.approx(0.36e9 / 3)
    finally:
        if writer is not None:
            writer.close()
        daemon.close()


def test_the_engine_collectors_watch_keys_are_the_samples_own(tmp_path):
    """The engine collector hands the daemon its samples as blocks of keys and values
    (one block an engine and family): those keys and values are exactly each exposed
    sample's name, labels in their order, and value, for counters, gauges and every
    cumulative histogram bucket, two engines merged into one family."""
    import random

    from daemon_cost import traffic, write_engine
    writers = [write_engine(tmp_path / f"engine-{i}", f"engine-{i}", random.Random(i))
               for i in range(2)]
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, collectors=("engine",)))
    try:
        seen = []
        for cycle in range(2):  # the second reuses the first's samples where nothing moved
            if cycle:
                traffic(writers[1], random.Random(9), 5)
            daemon.run_cycle()
            families = daemon._snapshot
            frame = daemon._watched_samples(families)
            keyed = dict(frame.items())
            assert len(keyed) == len(list(frame.keys()))  # a key once in a frame
            plain = {(s.name, tuple(s.labels.items())): s.value for f in families
                     if f.name in daemon._watched for s in f.samples}
            assert keyed == plain
            seen.append(keyed)
            objects = {(s.name, tuple(s.labels.items())): s for f in families
                       for s in f.samples}
            if cycle == 0:
                first_objects = objects
        assert frame.blocks  # the engines' series came as blocks, not one by one:
        assert not [k for k in frame.loose if k[0].endswith("_bucket")]
        buckets = [k for k in keyed if k[0].endswith("_bucket")]
        assert len({dict(k[1])["engine"] for k in buckets}) == 2
        assert len(keyed) > 1000
        moved = {dict(k[1])["engine"] for k in buckets if seen[0].get(k) != keyed[k]}
        assert moved == {"engine-1"}  # its new requests' buckets
        still = [k for k in buckets if dict(k[1])["engine"] == "engine-0"]
        assert all(objects[k] is first_objects[k] for k in still)  # reused, not rebuilt
    finally:
        daemon.close()
        for writer in writers:
            writer.close()


def test_metrics_text_is_prometheus_clients_own_over_cycles_that_move(tmp_path):
    """/metrics says exactly what prometheus_client's generate_latest writes for the same
    snapshot (families, help, types, samples and values, in order; labels in the
    contract's order, which generate_latest sorts), cycle after cycle, while one engine's
    series move and another's stand still (their lines come from the renderer's cache: a
    stale line would differ here)."""
    import random

    from daemon_cost import traffic, write_engine
    from prometheus_client import CollectorRegistry, generate_latest
    writers = [write_engine(tmp_path / f"engine-{i}", f"engine-{i}", random.Random(i))
               for i in range(2)]
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, collectors=("engine",),
                                 node_name='gpu "7"\\a'))  # escaped as any label value

    class Snapshot:
        def collect(self):
            return daemon._snapshot
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    try:
        rendered = set()
        for cycle in range(4):
            traffic(writers[1], random.Random(cycle), 3)
            daemon.run_cycle()
            ours = daemon.render_metrics()
            # The daemon's node on every sample, first, as an external label is added.
            assert _parsed(ours) == _parsed(generate_latest(registry),
                                            node='gpu "7"\\a'), cycle
            samples = [line for line in ours.decode().splitlines()
                       if not line.startswith("#")]
            assert samples and all('{node="gpu \\"7\\"\\\\a"' in line for line in samples)
            rendered.add(ours)
        assert len(rendered) == 4  # every cycle moved something
    finally:
        daemon.close()
        for writer in writers:
            writer.close()


def _parsed(text: bytes, node: str | None = None) -> list:
    from prometheus_client.parser import text_string_to_metric_families
    own = {"node": node} if node is not None else {}
    return [(f.name, f.type, f.documentation,
             [(s.name, sorted({**s.labels, **own}.items()), s.value) for s in f.samples])
            for f in text_string_to_metric_families(text.decode())]


def test_a_cycle_renders_ahead_only_when_a_scrape_is_due(tmp_path):
    """Scraped every 15th cycle (Prometheus at 15 s), the daemon learns the pace and renders
    ahead in the two cycles before a scrape is due, not in all 15: every scrape still
    finds its snapshot rendered (nothing made on demand), and a daemon no one scrapes
    renders nothing."""
    from ac_observe.daemon.scrape_pace import RENDER_AHEAD_SECONDS, ScrapePace
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path, collectors=("engine",)))
    renders = []
    real = daemon._renderer.render
    daemon._renderer.render = lambda families: renders.append(daemon._generation) or \
        real(families)
    try:
        for _ in range(5):
            daemon.run_cycle()
        assert renders == []  # not scraped: nothing rendered
        on_demand = 0
        for cycle in range(1, 91):
            daemon.run_cycle()
            if cycle % 15 == 0:
                before = len(renders)
                assert daemon.rendered_metrics(gzipped=False) is not None or cycle <= 15
                daemon.render_metrics()
                on_demand += len(renders) - before
        generations = [g for g in renders if g > 5 + 45]  # once three scrapes were seen
        assert len(generations) == 6  # two cycles before each of the last three scrapes
        assert all((g - 5) % 15 in (14, 0) for g in generations), generations
        assert on_demand == 1  # the first scrape only
        pace = ScrapePace()
        for cycle in (3, 18, 33):
            pace.scraped(cycle)
        assert [c for c in range(34, 50) if pace.due(c)] == [47, 48, 49]
        pace._last -= RENDER_AHEAD_SECONDS
        assert not pace.due(48)  # no scrape for five minutes: nobody to render for
        two = ScrapePace()  # two scrapers at 15 cycles, 3 apart: gaps 3, 12, 3, 12
        for cycle in (0, 3, 15, 18, 30):
            two.scraped(cycle)
        assert two.due(32)  # due by the closer pair's gap, not a median's 12
    finally:
        daemon.close()


def test_an_engine_over_the_series_limit_is_refused_alone_before_its_keys_are_parsed(
        tmp_path, monkeypatch):
    """More keys than MAX_SERIES_PER_ENGINE across an engine's files (each file under it)
    make that engine an error with the reason, before any of its keys is parsed, and the
    refusal stands without counting again while its files stay as they are; the other
    engine is exported whole. Entries across files are bounded the same way."""
    import random

    from daemon_cost import write_engine

    from ac_observe import metrics as m
    from ac_observe.collectors.engine import collector, files, plan
    from ac_observe.engine.telemetry import TelemetryWriter
    small = TelemetryWriter(tmp_path / "a", {"started_at": time.time()}, engine="a",
                            model="m", heartbeat_seconds=0.5)
    small.set(m.KV_BLOCKS, 64)
    small.observe(m.INFERENCE_LATENCY, 0.1, stream="throughput")
    writers = [small, write_engine(tmp_path / "big", "big", random.Random(1))]
    config = DaemonConfig(telemetry_root=tmp_path, collectors=("engine",))
    try:
        reference = collector.EngineCollector(config)
        reference.collect()
        sizes = {name: [len(index.entries) for index in directory.files.indexes.values()]
                 for name, directory in reference._directories.items()}
        limit = sum(sizes["a"])  # every file of both under it, big's sum over it
        assert max(sizes["big"]) <= limit < sum(sizes["big"])
        monkeypatch.setattr(files, "MAX_SERIES_PER_ENGINE", limit)
        plans, counts = [], []
        monkeypatch.setattr(plan.SeriesPlan, "__init__", _counting(plan.SeriesPlan.__init__,
                                                                   plans))
        real_count = files.too_many_keys
        monkeypatch.setattr(files, "too_many_keys",
                            lambda indexes: counts.append(1) or real_count(indexes))
        checked = []
        real_check = plan.check_key
        monkeypatch.setattr(plan, "check_key",
                            lambda key, expected: checked.append(expected["engine"])
                            or real_check(key, expected))
        limited = collector.EngineCollector(config)
        for _ in range(3):
            families = limited.collect()
        errors = {s["engine"] or s["directory"].rsplit("/", 1)[-1]: s["error"]
                  for s in limited.status()}
        assert errors["big"] == f"more than {limit} keys"
        assert errors["a"] == ""
        exported = {(s.name, s.labels.get("engine")) for f in families for s in f.samples}
        mine = {(s.name, s.labels.get("engine")) for f in reference.collect()
                for s in f.samples if s.labels.get("engine") == "a"}
        assert {e for e in exported if e[1] == "big"} <= {("ac_engine_up", "big")}
        assert mine <= exported
        assert len(plans) == 1 and set(checked) == {"a"}  # none of big's keys parsed
        assert len(counts) == 2  # a's and big's, once: the refusal stands while big's
        # files stay as they are
        # Entries across many pids' files are bounded apart, reading no further.
        monkeypatch.setattr(files, "MAX_ENTRIES_PER_ENGINE", limit)
        capped = collector.EngineCollector(config)
        capped.collect()
        errors = {s["engine"] or s["directory"].rsplit("/", 1)[-1]: s["error"]
                  for s in capped.status()}
        assert errors == {"a": "", "big": f"more than {limit} entries in its files"}
    finally:
        for writer in writers:
            writer.close()


def _counting(real, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return real(self, *args, **kwargs)
    return counted


def test_a_skipped_entry_adds_to_no_series_and_missing_buckets_stay_zero(tmp_path):
    """An entry the contract does not allow (a foreign family, a bound the histogram does
    not have) is skipped with a warning and its value lands in no series: an engine's
    histogram that was hit in one bucket only reads 0 below it and 1 from it up to +Inf
    and its _count, whatever the skipped entries hold."""
    import bisect
    import math
    import os

    from ac_observe import metrics as m
    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.telemetry_format import ValueFile, db_file_name, open_dir_nofollow, sample_key
    writer = TelemetryWriter(tmp_path / "e", {"started_at": time.time()}, engine="e",
                             model="m", heartbeat_seconds=60)
    family = m.INFERENCE_LATENCY.family
    labels = {"engine": "e", "model": "m", "stream": "throughput"}
    try:
        writer.observe(m.INFERENCE_LATENCY, 0.003, stream="throughput")
        fd = open_dir_nofollow(tmp_path / "e")
        try:
            foreign = ValueFile(fd, db_file_name("histogram", 424242))
            foreign.write(sample_key("evil", "evil_total", labels, ""), 1e6, 0.0)
            foreign.write(sample_key(family, f"{family}_bucket", {**labels, "le": "0.0042"},
                                     ""), 1e6, 0.0)
            foreign.close()
        finally:
            os.close(fd)
        collector = EngineCollector(DaemonConfig(telemetry_root=tmp_path,
                                                 collectors=("engine",)))
        (latency,) = [f for f in collector.collect() if f.name == family]
        buckets = {float(s.labels["le"]): s.value for s in latency.samples
                   if s.name.endswith("_bucket") and s.labels["stream"] == "throughput"}
        bounds = sorted(buckets)
        assert bounds[-1] == math.inf and len(bounds) > 10
        hit = bisect.bisect_left(bounds, 0.003)
        assert [buckets[b] for b in bounds] == [0.0] * hit + [1.0] * (len(bounds) - hit)
        (count,) = [s.value for s in latency.samples if s.name == f"{family}_count"
                    and s.labels["stream"] == "throughput"]
        assert count == 1.0
        (state,) = collector.status()
        assert state["warning"].startswith("2 entries skipped")
    finally:
        writer.close()
