"""The daemon's memory under churn: engines come and go all day on a node, and the daemon's
memory must not keep what each of them left (the windows once held a whole hour per series
for an hour after it ended: ~25 MB per departed engine)."""
from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_cost import traffic  # bench/: what finished requests leave in the files

from ac_observe.daemon.windows import Windows
from support.servers import sample_value, wait_for

ENGINES = 20
AT_ONCE = 4  # engines alive together (a wave)
LIFE_SECONDS = 3.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _wave(daemon, root: Path, names: list[str], rng: random.Random) -> None:
    """`names` live together for LIFE_SECONDS with traffic (the engine's own telemetry
    writer, as the bundled engine writes), then stop; returns once every one of them has
    left /metrics (past its stale time and grace)."""
    from ac_observe.engine.telemetry import TelemetryWriter
    writers = [TelemetryWriter(root / name, {"started_at": time.time()}, engine=name,
                               model="tiny", heartbeat_seconds=0.5) for name in names]
    try:
        wait_for(lambda: all(sample_value(daemon.metrics(), "ac_engine_up", engine=name) == 1
                             for name in names), 30, f"{names} up")
        end = time.monotonic() + LIFE_SECONDS
        while time.monotonic() < end:
            for writer in writers:
                traffic(writer, rng, 5)
            time.sleep(0.2)
    finally:
        for writer in writers:
            writer.close()

    def gone() -> bool:
        metrics = daemon.metrics()
        return not any(n == "ac_inference_latency_seconds_count" and ("engine", name) in labels
                       for (n, labels) in metrics for name in names)
    wait_for(gone, 60, f"{names} to leave /metrics")


@pytest.mark.slow
def test_departed_engines_leave_little_memory_behind(start_daemon, tmp_path):
    """20 engine names, four at a time, each alive a few seconds with traffic: once they
    are past their grace, the daemon's RSS has grown by under 5 MB per departed engine
    (measured from after the first wave, which warms the daemon's code paths up). A loose
    bound against regressions; bench/daemon_soak.py measures the real curve."""
    root = tmp_path / "telemetry"
    root.mkdir()
    daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s",
                          "--engine-stale", "1s", "--engine-grace", "1s")
    rng = random.Random(29)
    names = [f"churn-{i:02d}" for i in range(ENGINES)]
    _wave(daemon, root, names[:AT_ONCE], rng)
    daemon.wait_cycles(3)
    warm = _rss_mb(daemon.proc.pid)
    for start in range(AT_ONCE, ENGINES, AT_ONCE):
        _wave(daemon, root, names[start:start + AT_ONCE], rng)
    daemon.wait_cycles(3)
    grown = _rss_mb(daemon.proc.pid) - warm
    departed = ENGINES - AT_ONCE
    print(f"daemon RSS: {warm:.1f} MB after the first wave, +{grown:.1f} MB after "
          f"{departed} more engines ({grown / departed:.2f} MB per departed engine)")
    assert grown / departed < 5.0, (warm, grown)
    metrics = daemon.metrics()
    assert sample_value(metrics, "ac_engine_up", engine=names[-1]) == 0
    assert sample_value(metrics, "ac_daemon_series") == sum(
        1 for name, labels in metrics if name.startswith("ac_engine_up"))
    assert sample_value(metrics, "ac_daemon_series_refused_total") == 0


# ----- the windows: memory follows the samples held, answers read back bit for bit ---------

NAME = "ac_kv_cache_usage_ratio"


def _value(kind: str, cycle: int, i: int, rng: random.Random) -> float | None:
    """A series' value at a cycle, of a kind that packs differently."""
    if kind == "still":
        return 7.0
    if kind == "counter":  # whole steps of 0..40
        return float(cycle * 20 + i + rng.randrange(0, 2))
    if kind == "big_steps":
        return float(cycle * 100_000 + i)
    if kind == "fraction":
        return cycle + i / 7
    if kind == "zeros":  # 0.0 and -0.0 are different bits
        return -0.0 if (cycle + i) % 3 else 0.0
    if kind == "huge":  # past 2^52: no steps in whole numbers
        return 2.0 ** 60 + cycle * 2.0 ** 10
    if kind == "reset":
        return float((cycle % 37) * 3)
    if kind == "gaps":
        return None if (cycle * 7 + i) % 5 == 0 else float(cycle)
    raise AssertionError(kind)


def test_packed_windows_read_back_every_value_bit_for_bit():
    """Series of every kind the packing tells apart (still, whole steps small and large,
    fractions, -0.0, past 2^52, resets, gaps), born and gone at any cycle: every view of
    the windows, at any since/until, holds exactly the bits written, NaN where a series
    was absent, as a dense copy would."""
    rng = random.Random(7)
    capacity = 150  # not a whole number of blocks
    windows = Windows(capacity)
    kinds = ["still", "counter", "big_steps", "fraction", "zeros", "huge", "reset", "gaps"]
    lives = {}  # key -> (kind, born, ends)
    for i in range(160):
        born = rng.randrange(0, 500)
        lives[(NAME, (("engine", f"e{i}"),))] = (kinds[i % len(kinds)], born,
                                                 born + rng.choice([1, 5, 40, 64, 300, 900]))
    written: dict[tuple, dict[int, float]] = {key: {} for key in lives}
    for cycle in range(700):
        samples = {}
        for i, (key, (kind, born, ends)) in enumerate(lives.items()):
            if born <= cycle < ends:
                value = _value(kind, cycle, i, rng)
                if value is not None:
                    samples[key] = written[key][cycle] = value
        windows.append(1000.0 + cycle, samples)
        if cycle % 23 == 0 or cycle > 690:
            oldest = max(0, cycle + 1 - capacity)
            since = rng.randrange(oldest, cycle + 1)
            until = rng.choice([None, rng.randrange(since, cycle + 1)])
            view = windows.view({NAME}, 1000.0 + since,
                                None if until is None else 1000.0 + until)
            last = cycle if until is None else until
            assert list(view.times) == [1000.0 + c for c in range(since, last + 1)]
            for key, values in view.series.items():
                expected = np.array([written[key].get(c, np.nan)
                                     for c in range(since, last + 1)])
                assert np.asarray(values).tobytes() == expected.tobytes(), (key, lives[key])
            # Every series with a point in the view is in it.
            assert {k for k, v in written.items()
                    if any(since <= c <= last for c in v)} <= set(view.series)


def test_a_series_that_lived_40_cycles_costs_40_samples_not_a_window():
    """200 series alive for 40 cycles of a one-hour window cost about their 40 samples
    each (not 3,600), and once gone a whole window they leave it, their memory with them."""
    windows = Windows(3600)
    short = [(NAME, (("engine", f"short{i}"),)) for i in range(200)]
    still = [(NAME, (("engine", f"still{i}"),)) for i in range(5)]
    rng = np.random.default_rng(1)
    for cycle in range(200):
        samples = {key: 1.0 for key in still}
        if cycle < 40:
            samples.update(zip(short, rng.random(len(short)).tolist(), strict=True))
        windows.append(float(cycle), samples)
    # The blocks packed (the open one is 64 cycles of the series live now, in chunks).
    packed = sum(block.nbytes for block in windows._packed) - 5 * 16 * 3  # less the still
    assert packed / len(short) < 45 * 8, packed / len(short)  # 40 samples and the index
    # (a dense ring held 3,600 samples a series: 28,800 bytes)
    assert windows.view({NAME}, 0.0).points(short[0])[39][0] == 39.0
    for cycle in range(200, 3600 + 200):
        windows.append(float(cycle), {key: 1.0 for key in still})
    assert set(windows.series) == set(still)
    assert len(windows._chunks) == 1  # the open block: one chunk of slots
    packed = sum(block.nbytes for block in windows._packed)
    assert packed < 8 * 1024, packed  # 5 still series: one value a block each


def test_counters_in_whole_steps_take_about_a_byte_a_sample():
    """An hour of 1,000 counters stepping by 0..100 a cycle (a histogram's buckets under
    traffic) holds ~1 byte a sample, and 1,000 still ones next to nothing: under a byte a
    sample in all, the open block included."""
    windows = Windows(3600)
    moving = tuple((NAME, (("engine", f"m{i}"),)) for i in range(1000))
    still = tuple((NAME, (("engine", f"s{i}"),)) for i in range(1000))
    from ac_observe.daemon.windows import Frame
    rng = np.random.default_rng(2)
    values = np.zeros(1000)
    for cycle in range(3600):
        values += rng.integers(0, 100, 1000)
        windows.append(float(cycle), Frame([(moving, values.copy()),
                                            (still, np.full(1000, 3.0))]))
    samples = 2 * 1000 * 3600
    assert windows.nbytes / samples < 1.0, windows.nbytes / samples  # dense: 8
    view = windows.view({NAME}, 3000.0)
    assert view.points(moving[5])[-1] == (3599.0, values[5])


# ----- the series budget ----------------------------------------------------------------------

def test_past_max_series_new_series_are_refused_counted_and_logged_once(tmp_path, caplog):
    """--max-series: series held keep their place; new ones past it are left out of
    /metrics and the windows and counted once while refused; a series gone frees its
    place for the next cycle; an engine's family (a block of series) is taken in part
    when only part of it fits. The refusal is logged once, not every cycle."""
    import logging

    from ac_observe import metrics as m
    from ac_observe.collectors.base import Collector, build, new_gauge
    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.service import Daemon
    from ac_observe.engine.telemetry import TelemetryWriter
    from support.servers import parse_metrics

    class Pids(Collector):
        name = "pids"
        pids: list[int] = []

        def collect(self):
            family = new_gauge(m.GPU_PROCESS_MEMORY)
            for pid in self.pids:
                family.add_metric(["0", "GPU-0", str(pid)], 1e9 + pid)
            return [family]

    root = tmp_path / "telemetry"
    root.mkdir()
    writers = [TelemetryWriter(root / "e1", {"started_at": time.time()}, engine="e1",
                               model="tiny")]
    config = dict(telemetry_root=root, collectors=("engine",), history=False)
    probe = Daemon(DaemonConfig(**config))
    probe.run_cycle()
    engine_series = probe.budget.held
    probe.close()
    assert engine_series > 500  # one engine's series, ac_engine_up among them

    pids = Pids()
    limited = DaemonConfig(**config, max_series=engine_series + 3)
    daemon = Daemon(limited, collectors=[*build(("engine",), config=limited), pids])

    def cycle() -> dict:
        daemon.run_cycle()
        return parse_metrics(daemon.render_metrics().decode())

    def pids_exported(metrics) -> set[str]:
        return {dict(labels)["pid"] for name, labels in metrics
                if name == "ac_gpu_process_memory_bytes"}

    with caplog.at_level(logging.WARNING, logger="ac_observe.daemon"):
        pids.pids = [1, 2, 3, 4, 5]
        metrics = cycle()
        assert pids_exported(metrics) == {"1", "2", "3"}
        assert sample_value(metrics, "ac_daemon_series") == engine_series + 3
        assert sample_value(metrics, "ac_daemon_series_refused_total") == 2
        windowed = daemon.windows.by_sample.get("ac_gpu_process_memory_bytes", set())
        assert {dict(key[1])["pid"] for key in windowed} <= {"1", "2", "3"}
        metrics = cycle()  # refused again: counted once
        assert sample_value(metrics, "ac_daemon_series_refused_total") == 2
        pids.pids = [3, 4, 5]  # 1 and 2 gone: their places are free from the next cycle
        assert pids_exported(cycle()) == {"3"}
        metrics = cycle()
        assert pids_exported(metrics) == {"3", "4", "5"}
        assert sample_value(metrics, "ac_daemon_series") == engine_series + 3
        assert sample_value(metrics, "ac_daemon_series_refused_total") == 2
        # A second engine while the budget is full: none of its series.
        writers.append(TelemetryWriter(root / "e2", {"started_at": time.time()}, engine="e2",
                                       model="tiny"))
        metrics = cycle()
        assert not [name for name, labels in metrics if ("engine", "e2") in labels]
        refused = sample_value(metrics, "ac_daemon_series_refused_total")
        assert refused == 2 + engine_series
        # The pids go: three places, taken by three of the engine's series.
        pids.pids = []
        cycle()
        metrics = cycle()
        assert len([name for name, labels in metrics if ("engine", "e2") in labels]) == 3
        assert sample_value(metrics, "ac_daemon_series") == engine_series + 3
        windowed = [key for keys in daemon.windows.by_sample.values() for key in keys
                    if ("engine", "e2") in key[1]]
        assert len(windowed) <= 3
        assert sample_value(metrics, "ac_daemon_series_refused_total") == refused
    warnings = [r for r in caplog.records if "--max-series" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    daemon.close()
    for writer in writers:
        writer.close()
