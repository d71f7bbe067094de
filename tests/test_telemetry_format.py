"""The telemetry files are prometheus_client's multiprocess format: the daemon's reader and
`MultiProcessCollector`, from the lowest and the highest prometheus_client release that
pyproject allows, read the same samples from the same files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ac_observe.collectors.engine import EngineCollector

# Wheels of the prometheus_client releases at both ends of the pinned range, fetched by
# `scripts/install.sh --test` next to the virtual environment.
COMPAT_WHEELS = Path(sys.prefix) / "compat-wheels"

WRITER = r"""
import sys
from ac_observe import metrics as m
from ac_observe.engine.telemetry import TelemetryWriter
directory, k, stay = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stay"
w = TelemetryWriter(directory, {"started_at": 0.0}, engine="e1", model="m1",
                    heartbeat_seconds=60)
w.inc(m.REQUESTS, k, stream="throughput", status="ok")
w.inc(m.PROMPT_TOKENS, 17 * k)
for i in range(k + 2):
    w.observe(m.INFERENCE_LATENCY, 0.0031 * (i + 1) * k, stream="low_latency")
    w.observe(m.SKELETON_COMPLEXITY, float(i % 5 + 1))
w.inc(m.STREAM_BUSY, 0.1 / 3 * k, stream="throughput")
w.set(m.REQUESTS_RUNNING, 10 * k, stream="throughput")
w.set(m.KV_USAGE, 0.25 * k)
w.inc(m.SKELETON_REQUESTS, 1, skeleton=f"skeleton{k}")
if stay:
    print("ready", flush=True)
    sys.stdin.read()
w.close()
"""

READER = r"""
import json, sys
import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry, path=sys.argv[1])
samples = [[s.name, s.labels, s.value] for f in registry.collect() for s in f.samples]
print(json.dumps({"module": prometheus_client.__file__, "samples": samples}))
"""


def _normal(name: str, labels: dict, value: float):
    labels = dict(labels)
    if "le" in labels:
        labels["le"] = float(labels["le"])
    return name, tuple(sorted(labels.items())), value


def _ours(root: Path) -> dict:
    collector = EngineCollector(SimpleNamespace(telemetry_root=root, engine_stale_seconds=600,
                                                engine_grace_seconds=600, telemetry_owner=None))
    families = [f for f in collector.collect()
                if f.name not in ("ac_engine_restarts", "ac_engine_up")]
    # The daemon adds `kind` to what the files hold; the files alone are compared.
    assert all(s.labels.pop("kind") == "ac-observe" for f in families for s in f.samples)
    samples = [_normal(s.name, s.labels, s.value) for f in families for s in f.samples]
    assert collector.engines["e1"].error == ""
    return {(name, labels): value for name, labels, value in samples}


def _multiprocess_collector(wheel: Path, directory: Path) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", READER, str(directory)], check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(wheel)})
    result = json.loads(out.stdout)
    assert result["module"].startswith(str(wheel)), result["module"]  # that release, not ours
    samples = [_normal(*sample) for sample in result["samples"]]
    return {(name, labels): value for name, labels, value in samples}


def test_daemon_reader_equals_multiprocess_collector_across_restarts_and_dead_pids(tmp_path):
    wheels = sorted(COMPAT_WHEELS.glob("prometheus_client-*.whl"))
    assert len(wheels) >= 2, \
        f"scripts/install.sh --test fetches the pinned range's ends into {COMPAT_WHEELS}"
    directory = tmp_path / "telemetry" / "e1"
    # Engine 1 exits cleanly, engine 2 is killed with SIGKILL (its live-gauge file stays
    # behind), engine 3 is alive while both readers read.
    subprocess.run([sys.executable, "-c", WRITER, str(directory), "1", "exit"],
                   check=True, capture_output=True, text=True)
    killed = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), "2", "stay"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "ready"
    killed.kill()
    killed.wait()
    alive = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), "3", "stay"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout.readline().strip() == "ready"
        files = sorted(p.name for p in directory.glob("*.db"))
        pids = {name.rsplit("_", 1)[1].split(".")[0] for name in files}
        assert len(pids) == 3, files  # counters and histograms of all three pids
        # The killed engine's live gauges were removed by the next engine's start (as
        # mark_process_dead would); its counters and histograms stay and are summed.
        assert sorted(p for p in files if p.startswith("gauge")) == \
            [f"gauge_livesum_{alive.pid}.db"]
        assert f"counter_{killed.pid}.db" in files
        ours = _ours(directory.parent)
        for wheel in wheels:
            theirs = _multiprocess_collector(wheel, directory)
            assert set(ours) == set(theirs), (wheel.name, set(ours) ^ set(theirs))
            for key, value in ours.items():
                assert value == pytest.approx(theirs[key], rel=1e-12), (wheel.name, key)
    finally:
        alive.communicate("", timeout=30)
    # The three engines' counters add up (1 + 2 + 3), the gauges are the live one's alone.
    labels = (("engine", "e1"), ("model", "m1"), ("status", "ok"), ("stream", "throughput"))
    assert ours[("ac_requests_total", labels)] == 6
    running = (("engine", "e1"), ("model", "m1"), ("stream", "throughput"))
    assert ours[("ac_requests_running", running)] == 30


def _buckets(samples: dict, family: str, label: tuple) -> list[tuple[float, float]]:
    """(le, cumulative count) of the one series with that (name, value) label."""
    return sorted((dict(key)["le"], value) for (name, key), value in samples.items()
                  if name == f"{family}_bucket" and label in key)


def test_every_histogram_series_has_every_bucket_up_to_inf(tmp_path):
    """A series first touched by one observation (a sampled step's kernel class) still
    shows every bound, +Inf included and equal to its count, to the daemon and to
    MultiProcessCollector alike: without +Inf, Prometheus' histogram_quantile is NaN."""
    from ac_observe import metrics as m
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.metrics import HISTOGRAM
    directory = tmp_path / "telemetry" / "e1"
    writer = TelemetryWriter(directory, {"started_at": 0.0}, engine="e1", model="m1",
                             heartbeat_seconds=60)
    labels = dict(stream="throughput", phase="decode")
    writer.observe(m.KERNEL_SECONDS, 0.0003, **labels, **{"class": "gemm"})
    # An engine of an older release wrote only the buckets that were hit: the daemon
    # still exposes them all.
    _, keys = writer._sample_keys(m.KERNEL_SECONDS, {**labels, "class": "rope"})
    writer._add(HISTOGRAM, keys[2], 3.0)
    writer.flush()
    bounds = sorted(float(b) for b in m.KERNEL_SECONDS.buckets) + [float("inf")]
    ours = _ours(directory.parent)
    for klass, count, first in (("gemm", 1.0, 0.0003), ("rope", 3.0, bounds[2])):
        got = _buckets(ours, "ac_kernel_seconds", ("class", klass))
        assert [le for le, _ in got] == bounds, klass
        assert got == [(le, count if le >= first else 0.0) for le in bounds], klass
        assert ours[("ac_kernel_seconds_count", tuple(sorted(
            {"engine": "e1", "model": "m1", **labels, "class": klass}.items())))] == count
    theirs = _multiprocess_collector(sorted(COMPAT_WHEELS.glob("prometheus_client-*.whl"))[-1],
                                     directory)
    assert _buckets(theirs, "ac_kernel_seconds", ("class", "gemm")) == \
        _buckets(ours, "ac_kernel_seconds", ("class", "gemm"))
    writer.close()


def _stamps(directory: Path, name: str) -> dict[str, float]:
    """{key: timestamp} of the entries of one `.db` file whose key names `name`."""
    from ac_observe.telemetry_format import scan_entries, used_size, value_at
    (path,) = directory.glob(f"{name}_*.db")
    data = path.read_bytes()
    entries, _ = scan_entries(data, 8, used_size(data))
    return {key: value_at(data, at + 8) for at, key in entries}


def test_a_buffered_writer_writes_what_moved_at_each_flush_and_gauges_on_change(tmp_path):
    """The engine's writer keeps a step's events in memory and writes each moved series
    once per flush; a gauge set to the value it holds is not written again; only the
    owner's flush writes (not the heartbeat), and close flushes the rest."""
    import time

    from ac_observe import metrics as m
    from ac_observe.engine.telemetry import TelemetryWriter
    directory = tmp_path / "telemetry" / "e1"
    writer = TelemetryWriter(directory, {"started_at": 0.0}, engine="e1", model="m1",
                             heartbeat_seconds=60, buffered=True)
    base = (("engine", "e1"), ("model", "m1"))
    ok = ("ac_requests_total", base + (("status", "ok"), ("stream", "throughput")))
    itl = base + (("stream", "throughput"),)
    usage = ("ac_kv_cache_usage_ratio", base)
    try:
        assert _ours(directory.parent)[ok] == 0  # declared at start, before traffic
        writer.inc(m.REQUESTS, 2, stream="throughput", status="ok")
        writer.observe_many(m.INTER_TOKEN_LATENCY, [0.001, 0.002, 0.5], stream="throughput")
        writer.set(m.KV_USAGE, 0.5)
        assert _ours(directory.parent)[ok] == 0  # in memory until the flush
        writer.flush()
        ours = _ours(directory.parent)
        assert ours[ok] == 2 and ours[usage] == 0.5
        assert ours[("ac_inter_token_latency_seconds_count", itl)] == 3
        assert ours[("ac_inter_token_latency_seconds_sum", itl)] == pytest.approx(0.503)
        counters, gauges = _stamps(directory, "counter"), _stamps(directory, "gauge_livesum")
        time.sleep(0.01)
        writer.set(m.KV_USAGE, 0.5)  # unchanged: not written
        writer.inc(m.REQUESTS, 1, stream="throughput", status="ok")
        writer.flush()
        moved = {k for k, t in _stamps(directory, "counter").items() if t != counters[k]}
        assert len(moved) == 1 and '"ok"' in next(iter(moved))  # only the series that moved
        assert _stamps(directory, "gauge_livesum") == gauges
        writer.set(m.KV_USAGE, 0.75)
        writer.flush()
        assert _stamps(directory, "gauge_livesum") != gauges
        assert _ours(directory.parent)[usage] == 0.75
    finally:
        writer.close()
    closing = TelemetryWriter(tmp_path / "telemetry" / "e2", {"started_at": 0.0}, engine="e2",
                              model="m1", heartbeat_seconds=0.05, buffered=True)
    key = ("ac_requests_total", (("engine", "e2"), ("model", "m1"), ("status", "rejected"),
                                 ("stream", "throughput")))
    try:
        closing.inc(m.REQUESTS, 2, stream="throughput", status="rejected")
        time.sleep(0.2)  # heartbeats write no figures: only the owner's flush does
        assert _ours(tmp_path / "telemetry")[key] == 0
    finally:
        closing.close()
    assert _ours(tmp_path / "telemetry")[key] == 2  # close flushes



def test_the_reader_follows_a_file_rewritten_with_as_many_entries_and_one_appended_to(
        tmp_path):
    """The daemon gathers a file's values in one call, laid out from its entries: a file
    replaced by another of the same size, and entries appended, are read by their own
    keys and values, never by the layout of the file before."""
    from ac_observe.collectors.engine import FileIndex
    from ac_observe.telemetry_format import ValueFile
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        def write(pairs):
            value_file = ValueFile(fd, "counter_1.db")
            for key, value in pairs:
                value_file.write(key, value, 0.0)
            value_file.close()

        def read():
            values = index.read(fd, "counter_1.db")
            return {} if values is None else dict(zip(index.keys, values.tolist(), strict=False))
        write([("a-key", 1.0), ("b", 2.0)])
        index = FileIndex()
        assert read() == {"a-key": 1.0, "b": 2.0}
        os.unlink("counter_1.db", dir_fd=fd)
        write([("c-longer-key", 3.0), ("d", 4.0)])
        assert read() == {"c-longer-key": 3.0, "d": 4.0}
        write([("e", 5.0), ("d", 6.0)])
        assert read() == {"c-longer-key": 3.0, "d": 6.0, "e": 5.0}
        os.unlink("counter_1.db", dir_fd=fd)
        write([])  # started over, no entry yet
        assert read() == {}
    finally:
        os.close(fd)


def test_a_key_written_twice_in_one_file_adds_up_as_multiprocess_collector_adds_it(tmp_path):
    from ac_observe import metrics as m
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.telemetry_format import ValueFile, open_dir_nofollow
    directory = tmp_path / "telemetry" / "e1"
    writer = TelemetryWriter(directory, {"started_at": 0.0}, engine="e1", model="m1",
                             heartbeat_seconds=60)
    writer.inc(m.REQUESTS, 2, stream="throughput", status="ok")
    writer.close()
    (name,) = [p.name for p in directory.glob("counter_*.db")]
    fd = open_dir_nofollow(directory)
    try:
        again = ValueFile(fd, name)
        (key,) = [k for k in again._positions if '"ok"' in k and "throughput" in k]
        again._positions.clear()  # a hostile or broken writer appends the key once more
        again.write(key, 5.0, 0.0)
        again.close()
    finally:
        os.close(fd)
    ours = _ours(directory.parent)
    labels = (("engine", "e1"), ("model", "m1"), ("status", "ok"), ("stream", "throughput"))
    assert ours[("ac_requests_total", labels)] == 7
    theirs = _multiprocess_collector(sorted(COMPAT_WHEELS.glob("prometheus_client-*.whl"))[-1],
                                     directory)
    assert theirs[("ac_requests_total", labels)] == 7
