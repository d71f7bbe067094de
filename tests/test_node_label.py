"""`node` on everything a daemon exports and answers: /metrics (first, on every sample, as
Prometheus adds external labels), the query API (and its filter), status and the CLI; the
name from --node-name, AC_OBSERVE_NODE_NAME or the host name, refused when it is not a
label value anyone could read."""
from __future__ import annotations

import json
import os
import random
import socket

import httpx
import pytest
from daemon_cost import traffic, write_engine
from prometheus_client.parser import text_string_to_metric_families

from ac_observe.daemon.config import DaemonConfig, check_node_name
from support.servers import run_cli, wait_for


@pytest.mark.parametrize("name, why", [
    ("", "empty"), ("   ", "empty"), ("n" * 254, "254 characters long: at most 253"),
    ("gpu\n7", "control character"), ("gpu\x1b[31m", "control character"),
    ("gpu\x85", "control character"),
])
def test_a_node_name_that_is_no_readable_label_value_is_refused(tmp_path, name, why):
    with pytest.raises(ValueError, match=why):
        check_node_name(name)
    with pytest.raises(ValueError, match=why):
        DaemonConfig(telemetry_root=tmp_path, node_name=name)


def test_the_cli_refuses_a_bad_node_name_in_one_line_from_option_or_environment(tmp_path):
    out = run_cli("daemon", "--telemetry-root", str(tmp_path), "--node-name", "")
    assert out.returncode == 2 and out.stderr.startswith("error: the node name is empty")
    out = run_cli("daemon", "--telemetry-root", str(tmp_path),
                  env={**os.environ, "AC_OBSERVE_NODE_NAME": "a\tb"})
    assert out.returncode == 2 and "control character" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_default_node_is_the_host_name(tmp_path):
    assert DaemonConfig(telemetry_root=tmp_path).node_name == socket.gethostname()
    # Any UTF-8 a Kubernetes or host name may hold is kept as it is.
    assert DaemonConfig(telemetry_root=tmp_path, node_name="gpu-é.zone-a").node_name == \
        "gpu-é.zone-a"


@pytest.mark.slow
def test_every_series_and_answer_carries_the_node(tmp_path, start_daemon):
    root = tmp_path / "telemetry"
    writer = write_engine(root / "e1", "e1", random.Random(1))
    try:
        daemon = start_daemon(root, "--collectors", "engine",
                              env={"AC_OBSERVE_NODE_NAME": "gpu-a"})
        text = httpx.get(daemon.url + "/metrics", timeout=10).text
        samples = [s for family in text_string_to_metric_families(text)
                   for s in family.samples]
        assert len(samples) > 100
        assert all(s.labels.get("node") == "gpu-a" for s in samples)
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert all(line.split("{", 1)[1].startswith('node="gpu-a"') for line in lines)

        def query(labels: str = "") -> dict:
            return httpx.get(daemon.url + "/api/v1/query", timeout=10, params={
                "metric": "inference_latency_ns", "window": "1h", "labels": labels}).json()
        rng = random.Random(2)

        def answered() -> dict | None:
            traffic(writer, rng, 5)  # requests finishing while the daemon watches
            answer = query()
            return answer if answer["series"] else None
        answer = wait_for(answered, 60, "e1's latency", interval=0.5)
        assert [list(s["labels"])[0] for s in answer["series"]] == \
            ["node"] * len(answer["series"])
        assert {s["labels"]["node"] for s in answer["series"]} == {"gpu-a"}
        # A filter on this node is every series; on another node, none.
        same = query("node=gpu-a,engine=e1")
        assert [s["labels"] for s in same["series"]] == [s["labels"] for s in answer["series"]]
        assert query("node=gpu-b")["series"] == []
        assert daemon.status()["node"] == "gpu-a"
        # The CLI shows it where it shows labels.
        out = run_cli("--daemon", daemon.url, "status")
        assert out.returncode == 0 and "node gpu-a" in out.stdout, out.stdout
        out = run_cli("--daemon", daemon.url, "--metric", "inference_latency_ns",
                      "--window", "1h", env={**os.environ, "COLUMNS": "120"})
        assert out.returncode == 0 and "node=gpu-a" in out.stdout, out.stdout
        out = run_cli("--daemon", daemon.url, "--metric", "inference_latency_ns",
                      "--window", "1h", "--labels", "node=gpu-a", "--json")
        assert {s["labels"]["node"] for s in json.loads(out.stdout)["series"]} == {"gpu-a"}
    finally:
        writer.close()
