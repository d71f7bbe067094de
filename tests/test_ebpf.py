"""The eBPF collector with real uprobes on stand-in CUDA libraries (built here from C with
the real exported names and calling conventions; the runtime calls the driver as the real
one does): exact counts per process and stream, no launch counted twice, bytes exact,
each wait in its log2 bucket, processes told apart, and down with the reason when it
cannot run."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from support.processes import start_process
from support.servers import sample_value, wait_for
from support.standins import Pattern, build_cuda

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF needs root")
pytestmark = pytest.mark.slow  # bcc compiles its probes (seconds) for each daemon started
STREAMS = {"0x1000": 1, "0x2000": 2, "0x3000": 3}  # handle -> iterations per round unit


@pytest.fixture(scope="module")
def cuda_standin(tmp_path_factory) -> Path:
    return build_cuda(tmp_path_factory.mktemp("cuda"))


def _status(daemon) -> dict:
    status = httpx.get(daemon.url + "/api/v1/status", timeout=10).json()
    return next(c for c in status["collectors"] if c["name"] == "ebpf")


def _le(exponent: int) -> str:
    """The `le` of the bucket bounded by 2^exponent ns."""
    from prometheus_client.utils import floatToGoString
    return floatToGoString(2.0 ** exponent / 1e9)


def _expect(metrics: dict, pid: str, rounds: int, timed_launches: bool) -> None:
    for stream, unit in STREAMS.items():  # 3 launch calls per iteration, runtime ones too
        assert sample_value(metrics, "ac_cuda_kernel_launches_total", pid=pid,
                            stream=stream) == 3 * unit * rounds, stream
    assert sample_value(metrics, "ac_cuda_graph_launches_total", pid=pid) == rounds
    for direction, size in (("htod", 1000), ("dtoh", 4096), ("dtod", 777)):
        assert sample_value(metrics, "ac_cuda_memcpy_bytes_total", pid=pid,
                            direction=direction) == size * rounds, direction
    assert sample_value(metrics, "ac_cuda_launch_call_seconds_count", pid=pid) == (
        3 * 6 * rounds + rounds if timed_launches else None)  # kernel and graph launches
    for api, seconds in (("cuEventSynchronize", 0.00038), ("cudaStreamSynchronize", 0.0031),
                         ("cudaDeviceSynchronize", 0.024)):
        labels = {"pid": pid, "api": api}
        assert sample_value(metrics, "ac_cuda_sync_wait_seconds_count", **labels) == rounds
        total = sample_value(metrics, "ac_cuda_sync_wait_seconds_sum", **labels)
        assert seconds * rounds <= total < seconds * rounds + 0.02, api  # slept at least that
        if rounds == 1:
            # The one wait sits in its log2 slot: [2^k, 2^(k+1)) ns holds it, so the bucket
            # bounded by 2^(k+1) counts it and the one bounded by 2^k does not.
            k = math.floor(math.log2(total * 1e9))
            assert sample_value(metrics, "ac_cuda_sync_wait_seconds_bucket", le=_le(k + 1),
                                **labels) == 1, api
            assert sample_value(metrics, "ac_cuda_sync_wait_seconds_bucket", le=_le(k),
                                **labels) == 0, api
    # The runtime's waits call the driver's: counted once, under the runtime's name.
    assert sample_value(metrics, "ac_cuda_sync_wait_seconds_count", pid=pid,
                        api="cuStreamSynchronize") is None


@needs_root
@pytest.mark.parametrize("probes", ["", "launch,graph,sync,memcpy,launch_latency,runtime"])
def test_probes_count_exactly_per_process_and_stream(start_daemon, cuda_standin, probes):
    """Default probes count at the driver; with the runtime group the runtime's entries
    count and the driver calls inside them do not count again."""
    extra = ("--ebpf-probes", probes) if probes else ()
    daemon = start_daemon(None, "--collectors", "ebpf", "--interval", "0.5s", *extra)
    first = Pattern(cuda_standin)  # both start after the daemon
    second = Pattern(cuda_standin)
    try:
        wait_for(lambda: _status(daemon)["up"], 30, "probes on the stand-in libraries")
        assert first.run("round 1") == "done" and second.run("round 1") == "done"
        metrics = wait_for(lambda: (m := daemon.metrics()) and all(sample_value(
            m, "ac_cuda_graph_launches_total", pid=p.pid) == 1 for p in (first, second))
            and m, 10, "the counts")
        timed = "launch_latency" in probes
        _expect(metrics, first.pid, 1, timed)
        _expect(metrics, second.pid, 1, timed)
        assert first.run("round 1") == "done"
        metrics = wait_for(lambda: (m := daemon.metrics()) and sample_value(
            m, "ac_cuda_graph_launches_total", pid=first.pid) == 2 and m, 10, "round two")
        _expect(metrics, first.pid, 2, timed)
        _expect(metrics, second.pid, 1, timed)  # untouched by the other's calls
        assert sample_value(metrics, "ac_cuda_kernel_launches_total", pid=first.pid,
                            stream="0x1000", comm="cuda_pattern") == 6
        # One exits: its series and its map entries go; the other's stay as they were (no
        # call of its own in between, so no new histogram slot or call in flight).
        entries = {p.pid: sample_value(metrics, "ac_ebpf_map_entries", pid=p.pid)
                   for p in (first, second)}
        assert all(entries.values()), entries
        second.exit()
        metrics = wait_for(lambda: (m := daemon.metrics()) and not [
            k for k in m if ("pid", second.pid) in k[1]] and m, 10,
            "the exited process's series and entries to go")
        assert sample_value(metrics, "ac_ebpf_map_entries", pid=first.pid) == \
            entries[first.pid]
        assert first.run("round 1") == "done"
        metrics = wait_for(lambda: (m := daemon.metrics()) and sample_value(
            m, "ac_cuda_graph_launches_total", pid=first.pid) == 3 and m, 10, "more counts")
        _expect(metrics, first.pid, 3, timed)
        assert _status(daemon)["up"]
    finally:
        for pattern in (first, second):
            pattern.exit()


@needs_root
@pytest.mark.parametrize("who", ["root without capabilities", "nobody"])
def test_without_bpf_capabilities_it_is_down_with_the_reason(tmp_path, cuda_standin, who):
    """Root with every capability dropped, and an unprivileged user (uid 65534), both by
    setpriv: the collector says why it is down and the daemon carries on with the others."""
    import tempfile

    from support.servers import AC_OBSERVE, free_port
    port = free_port()
    # Where uid 65534 can reach: a telemetry root of root's it can read, a state dir its own.
    shared = Path(tempfile.mkdtemp(prefix="ac-nobody-"))
    shared.chmod(0o755)
    root = shared / "telemetry"
    root.mkdir(mode=0o755)
    state = shared / "state"
    state.mkdir()
    drop = (["--bounding-set=-all", "--inh-caps=-all"] if who != "nobody" else
            ["--reuid=65534", "--regid=65534", "--clear-groups"])
    if who == "nobody":
        os.chown(state, 65534, 65534)
    daemon = start_process([shutil.which("setpriv"), *drop, AC_OBSERVE, "daemon", "--port",
                            str(port), "--collectors", "engine,ebpf", "--telemetry-root",
                            str(root)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           env={**os.environ, "AC_OBSERVE_STATE_DIR": str(state)})
    pattern = Pattern(cuda_standin)
    try:
        url = f"http://127.0.0.1:{port}"

        def ebpf_state():
            try:
                status = httpx.get(url + "/api/v1/status", timeout=5).json()
            except httpx.HTTPError:
                return None
            return {c["name"]: c for c in status["collectors"]}

        states = wait_for(lambda: (s := ebpf_state()) and s["ebpf"]["reason"] != "not run yet"
                          and s, 30, "a first cycle")
        assert not states["ebpf"]["up"] and "CAP_BPF" in states["ebpf"]["reason"]
        uid = 65534 if who == "nobody" else 0
        assert f"runs as uid {uid} without them" in states["ebpf"]["reason"], states
        assert states["engine"]["up"]
        text = httpx.get(url + "/metrics", timeout=5).text
        assert ',collector="ebpf"} 0.0' in text and 'node="' in text
        assert ',collector="engine"} 1.0' in text
    finally:
        pattern.exit()
        daemon.terminate()
        daemon.wait(timeout=20)
        shutil.rmtree(shared, ignore_errors=True)
