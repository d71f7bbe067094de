"""What a fleet costs the Prometheus that scrapes it: N daemons on loopback (each its own
node, a stand-in engine written by the engine's telemetry writer, the shipped alerting
defaults), one real Prometheus (Debian's) with the shipped config and rules scraping them
every 5 s; after a warm-up, its own figures over a minute: series per node, samples
ingested per second, CPU and resident memory, and the projection to 1,000 nodes.

Usage: python bench/fleet.py [--nodes 20] [--seconds 90] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from ac_observe.engine.telemetry import TelemetryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_cost import traffic  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AC_OBSERVE = str(Path(sys.executable).with_name("ac-observe"))
TOKEN = "bench-fleet"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait(url: str, timeout: float = 120.0, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def prometheus_config(base: Path, targets: list[str], port: int) -> Path:
    shutil.copytree(REPO / "dashboards" / "prometheus", base / "etc", dirs_exist_ok=True)
    config = yaml.safe_load((base / "etc" / "prometheus.yml").read_text())
    config.pop("alerting")
    (base / "etc" / "token").write_text(TOKEN)
    for job in config["scrape_configs"]:
        if job["job_name"] == "ac-observe":
            job["static_configs"] = [{"targets": targets}]
            job["authorization"]["credentials_file"] = str(base / "etc" / "token")
        else:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    (base / "etc" / "prometheus.yml").write_text(yaml.safe_dump(config))
    return base / "etc" / "prometheus.yml"


def query(url: str, expr: str) -> float:
    result = httpx.get(url + "/api/v1/query", params={"query": expr},
                       timeout=30).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else float("nan")


def measure(nodes: int, seconds: float) -> dict:
    base = Path(tempfile.mkdtemp(prefix="ac-fleet-bench-"))
    (base / "alerting.yaml").write_text("rules: defaults\n")
    writers, procs, stop = [], [], threading.Event()
    try:
        for i in range(nodes):
            writers.append(TelemetryWriter(base / f"n{i}" / "telemetry" / "engine-8000",
                                           {"api_address": "", "started_at": time.time()},
                                           engine="engine-8000", model="tiny",
                                           heartbeat_seconds=0.5))
            traffic(writers[-1], random.Random(i), 50)
            writers[-1].flush()

        def drive() -> None:  # 20 requests a second an engine
            rng = random.Random(0)
            while not stop.wait(1.0):
                for writer in writers:
                    traffic(writer, rng, 20)
                    writer.flush()
        threading.Thread(target=drive, daemon=True).start()
        ports = [free_port() for _ in range(nodes)]
        for i, port in enumerate(ports):
            log = open(base / f"n{i}" / "daemon.log", "w")
            procs.append(subprocess.Popen(
                [AC_OBSERVE, "daemon", "--port", str(port), "--telemetry-root",
                 str(base / f"n{i}" / "telemetry"), "--collectors", "engine",
                 "--node-name", f"node-{i:04d}", "--token", TOKEN, "--no-history",
                 "--alerting", str(base / "alerting.yaml"),
                 "--state-dir", str(base / f"n{i}" / "state")],
                stdout=log, stderr=subprocess.STDOUT))
        for port in ports:
            wait(f"http://127.0.0.1:{port}/healthz")
        port = free_port()
        config = prometheus_config(base / "prometheus", [f"127.0.0.1:{p}" for p in ports],
                                   port)
        log = open(base / "prometheus.log", "w")
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={base / 'prometheus' / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait(url + "/-/ready")
        time.sleep(seconds)  # a benchmark's measuring span, not a test's wait
        series = query(url, 'sum(scrape_samples_scraped{job="ac-observe"})')
        return {
            "nodes": nodes,
            "targets_up": query(url, 'sum(up{job="ac-observe"})'),
            "series_per_node": series / nodes,
            "head_series": query(url, "prometheus_tsdb_head_series"),
            "samples_per_second": query(
                url, "rate(prometheus_tsdb_head_samples_appended_total[1m])"),
            "cpu_cores": query(url, 'rate(process_cpu_seconds_total{job="prometheus"}[1m])'),
            "rss_bytes": query(url, 'process_resident_memory_bytes{job="prometheus"}'),
            "rule_seconds_per_eval": query(
                url, "sum(prometheus_rule_group_last_duration_seconds)"),
        }
    finally:
        stop.set()
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for writer in writers:
            writer.close()
        shutil.rmtree(base, ignore_errors=True)


def project(figures: dict, nodes: int = 1000) -> dict:
    """Linear in nodes (every node sends the same series); what it leaves out: the
    TSDB's per-series overhead grows a little faster, queries over all nodes much."""
    scale = nodes / figures["nodes"]
    return {"nodes": nodes, "head_series": figures["head_series"] * scale,
            "samples_per_second": figures["samples_per_second"] * scale,
            "cpu_cores": figures["cpu_cores"] * scale,
            "rss_bytes": figures["rss_bytes"] * scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.nodes, args.seconds)
    projected = project(figures)
    if args.json:
        print(json.dumps({"measured": figures, "projected": projected}))
        return
    print(f"{figures['nodes']} nodes ({figures['targets_up']:.0f} up): "
          f"{figures['series_per_node']:.0f} series a node, "
          f"{figures['head_series']:.0f} head series, "
          f"{figures['samples_per_second']:.0f} samples/s, "
          f"Prometheus {figures['cpu_cores'] * 100:.1f} % of a core, "
          f"{figures['rss_bytes'] / 2**20:.0f} MiB resident, "
          f"rules {figures['rule_seconds_per_eval'] * 1e3:.0f} ms an evaluation")
    print(f"projected to {projected['nodes']} nodes: {projected['head_series']:.0f} series, "
          f"{projected['samples_per_second']:.0f} samples/s, "
          f"{projected['cpu_cores']:.1f} cores, {projected['rss_bytes'] / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
