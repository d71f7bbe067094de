"""The benchmarks do not rot: `bench/run.py --quick` runs rows 1 (instrumentation
overhead, alternating engine processes, the profile), 5 (prefix caching), 6 (latency
isolation over HTTP) and 7 (what TTFT leaves out of a client's wait) end to end and prints
the table with each aim's status. (Their figures are for docs/benchmarks.md, from a full
run; a test never times anything.)"""
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
