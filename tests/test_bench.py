"""The benchmarks do not rot: `bench/run.py --quick` runs rows 1 (instrumentation
overhead, alternating engine processes, the profile), 5 (prefix caching), 6 (latency
isolation over HTTP) and 7 (what TTFT leaves out of a client's wait) end to end and prints
the table with each aim's status; the gateway's and the daemon's own benchmarks run
shrunk. (Their figures are for docs/benchmarks.md, from a full run; a test holds at most a
loose bound, ten times an aim, against a regression.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from support.stack import REPO

pytestmark = [pytest.mark.bench, pytest.mark.slow]


def test_bench_run_prints_the_table_of_the_rows_it_ran():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--quick",
                          "--only", "1,5,6,7"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
            for line in table[1:]}
    for name in ("1 instrumentation, batch 1", "1 instrumentation, batch 16",
                 "1 instrumentation, one process, batch 16",
                 "1 instrumentation timed in place, batch 1",
                 "5 prefix cache, warm vs cold TTFT"):
        figure, aim, status = rows[name]
        assert aim and (status == "met" or status.startswith("missed")
                        or status.startswith("not resolved: the pairs spread")), (name, status)
    assert "of the step loop's working time" in rows["1 profile: instrumentation"][0]
    figure, aim, status = rows["6 low_latency TTFT p99, 8 clients, throughput flooded"]
    assert figure.startswith("lanes ") and "unloaded" in figure and "one lane" in figure
    assert status == "met" or status.startswith("missed")
    figure, aim, status = rows["7 client's first event - engine TTFT, bare socket"]
    assert figure.startswith("median ") and aim == "median < 1 ms", figure
    assert status == "met" or status.startswith("missed")


def test_daemon_soak_prints_an_rss_curve_and_a_slope():
    """bench/daemon_soak.py, shrunk: engines and pids churn through a daemon on a
    simulated clock, and the curve, the slope and the RSS above idle come out."""
    import json
    out = subprocess.run([sys.executable, str(REPO / "bench" / "daemon_soak.py"), "--hours",
                          "0.1", "--window", "60", "--every", "1", "--engines", "2",
                          "--engine-life", "0.5-1", "--pids", "5", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert len(result["curve"]) == 6 and result["engines_started"] > 2
    assert all(point["live"] > 2 * result["series_per_engine"] * 0.9
               for point in result["curve"])
    assert result["slope_mb_per_hour_after_two_windows"] == \
        result["slope_mb_per_hour_after_two_windows"]  # a number, not NaN
    assert result["above_idle_mb"] > 0


def test_gateway_overhead_runs_both_sides_and_loses_nothing():
    """bench/gateway_overhead.py, shrunk (2 rounds, 640 requests for memory): both sides
    answered at each level, every stream whole and in order, and one stream's added TTFT
    under 5 ms (ten times the aim: a relay that held events back would pass it by far)."""
    import json
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gateway_overhead.py"),
                          "--levels", "1,16", "--rounds", "2", "--memory-requests", "640",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    one, sixteen = result["levels"]
    for row in (one, sixteen):
        assert row["requests_per_side"] >= 300
        assert row["direct_lost_or_reordered"] == row["gateway_lost_or_reordered"] == 0
        assert row["gateway_req_per_s"] > 0 and row["direct_req_per_s"] > 0
    assert one["added_ttft_p50_ms"] < 5.0, one
    assert result["memory"]["requests"] >= 640 and result["memory"]["lost_or_reordered"] == 0
