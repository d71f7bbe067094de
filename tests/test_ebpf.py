"""The eBPF collector with real uprobes on stand-in CUDA libraries (built here from C with
the real exported names and calling conventions; the runtime calls the driver as the real
one does): exact counts per process and stream, no launch counted twice, bytes exact,
each wait in the log2 bucket of its known duration, processes told apart (one exiting
takes its series and its BPF map entries, the other keeps its own), and down with the
reason when it cannot run (as nobody, and as root without capabilities)."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from support.servers import sample_value, wait_for
from support.standins import PATTERN_WAITS, Pattern, build_cuda

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="eBPF needs root")
NOBODY = 65534
STREAMS = {"0x1000": 1, "0x2000": 2, "0x3000": 3}  # handle -> iterations per round unit
# Map entries a pattern process holds with the default probes: a count per stream (3),
# graph launches (1), bytes per direction (3), and a slot and a sum per wait API (3 + 3);
# nothing in flight between rounds.
DEFAULT_ENTRIES = 3 + 1 + 3 + 3 + 3


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


def _slot(seconds: float) -> int:
    """k of the log2 slot [2^k, 2^(k+1)) ns that holds a duration."""
    return math.floor(math.log2(seconds * 1e9))


def _expect(metrics: dict, pattern: Pattern, rounds: int, timed_launches: bool) -> None:
    pid = pattern.pid
    for stream, unit in STREAMS.items():  # 3 launch calls per iteration, runtime ones too
        assert sample_value(metrics, "ac_cuda_kernel_launches_total", pid=pid,
                            stream=stream) == 3 * unit * rounds, stream
    assert sample_value(metrics, "ac_cuda_graph_launches_total", pid=pid) == rounds
    for direction, size in (("htod", 1000), ("dtoh", 4096), ("dtod", 777)):
        assert sample_value(metrics, "ac_cuda_memcpy_bytes_total", pid=pid,
                            direction=direction) == size * rounds, direction
    assert sample_value(metrics, "ac_cuda_launch_call_seconds_count", pid=pid) == (
        3 * 6 * rounds + rounds if timed_launches else None)  # kernel and graph launches
    # Each wait's duration is known from both sides: the stand-in sleeps at least what
    # was asked, and the caller timed the whole call (probes included), which the probed
    # wait lies inside. So the sum lies between those sums, and each wait sits in the log2
    # slot of what was asked ([2^k, 2^(k+1)) ns: counted by the bucket bounded by 2^(k+1),
    # not by the one bounded by 2^k); a higher slot only where the caller's own timing of
    # that call reached it. The waits asked for sit 35-40 % below their slots' upper
    # edges, so a wait measured too long fails, whatever the sum says.
    took = pattern.waits()
    for api, asked in PATTERN_WAITS.items():
        labels = {"pid": pid, "api": api}
        assert len(took[api]) == rounds, (api, took)
        assert sample_value(metrics, "ac_cuda_sync_wait_seconds_count", **labels) == rounds
        total = sample_value(metrics, "ac_cuda_sync_wait_seconds_sum", **labels)
        assert asked * rounds <= total <= sum(took[api]) + 1e-9, (api, total, took[api])
        lowest = [_slot(asked)] * rounds
        highest = [_slot(seconds) for seconds in took[api]]
        for k in range(min(lowest) - 1, max(highest) + 1):  # waits in slots up to k
            counted = sample_value(metrics, "ac_cuda_sync_wait_seconds_bucket",
                                   le=_le(k + 1), **labels)
            assert sum(h <= k for h in highest) <= counted <= sum(l <= k for l in lowest), \
                (api, k, counted, took[api])
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
        _expect(metrics, first, 1, timed)
        _expect(metrics, second, 1, timed)
        # What the kernel's maps hold for each: the same pattern, the same entries (with
        # launch_latency, its sum and at least one slot besides).
        entries = {p.pid: sample_value(metrics, "ac_ebpf_map_entries", pid=p.pid,
                                       comm="cuda_pattern") for p in (first, second)}
        if timed:
            assert entries[first.pid] >= DEFAULT_ENTRIES + 2, entries
            assert entries[second.pid] >= DEFAULT_ENTRIES + 2, entries
        else:
            assert entries == {first.pid: DEFAULT_ENTRIES, second.pid: DEFAULT_ENTRIES}
        assert first.run("round 1") == "done"
        metrics = wait_for(lambda: (m := daemon.metrics()) and sample_value(
            m, "ac_cuda_graph_launches_total", pid=first.pid) == 2 and m, 10, "round two")
        _expect(metrics, first, 2, timed)
        _expect(metrics, second, 1, timed)  # untouched by the other's calls
        assert sample_value(metrics, "ac_cuda_kernel_launches_total", pid=first.pid,
                            stream="0x1000", comm="cuda_pattern") == 6
        held = sample_value(metrics, "ac_ebpf_map_entries", pid=first.pid)
        assert held == DEFAULT_ENTRIES or timed and held >= DEFAULT_ENTRIES + 2, held
        # One exits: its series go and so do its map entries (the kernel's maps, read back
        # each cycle, hold none for it); the other's go on.
        second.exit()
        metrics = wait_for(lambda: (m := daemon.metrics()) and not [
            k for k in m if ("pid", second.pid) in k[1]] and m, 10,
            "the exited process's series and map entries to go")
        assert sample_value(metrics, "ac_ebpf_map_entries", pid=second.pid) is None
        assert sample_value(metrics, "ac_ebpf_map_entries", pid=first.pid) == held
        assert first.run("round 1") == "done"
        metrics = wait_for(lambda: (m := daemon.metrics()) and sample_value(
            m, "ac_cuda_graph_launches_total", pid=first.pid) == 3 and m, 10, "more counts")
        _expect(metrics, first, 3, timed)
        if not timed:  # more of the same calls: the same keys, nothing new
            assert sample_value(metrics, "ac_ebpf_map_entries", pid=first.pid) == held
        assert sample_value(metrics, "ac_ebpf_map_entries", pid=second.pid) is None
        assert _status(daemon)["up"]
    finally:
        for pattern in (first, second):
            pattern.exit()


@needs_root
@pytest.mark.parametrize("who", ["nobody", "root without capabilities"])
def test_without_bpf_capabilities_it_is_down_with_the_reason(cuda_standin, who):
    """As an unprivileged user (nobody, uid 65534), and as root with every capability
    dropped (setpriv): the collector says why it is down, in /api/v1/status,
    ac_collector_up and `ac-observe status`, and the daemon carries on with the others."""
    from support.servers import AC_OBSERVE, free_port, run_cli
    base = Path(tempfile.mkdtemp(prefix="ac-ebpf-unprivileged-", dir="/tmp"))
    base.chmod(0o755)  # not under pytest's root-only folders: nobody must reach inside
    root, state = base / "telemetry", base / "state"
    root.mkdir(mode=0o755)
    state.mkdir(mode=0o700)
    setpriv = shutil.which("setpriv")
    if who == "nobody":
        uid = NOBODY
        os.chown(state, NOBODY, NOBODY)  # its history store
        switch = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    else:
        uid = 0
        switch = [setpriv, "--bounding-set=-all", "--inh-caps=-all"]
    port = free_port()
    with open(base / "daemon.log", "w") as log:  # the child keeps its own descriptor
        daemon = subprocess.Popen([*switch, AC_OBSERVE, "daemon", "--port", str(port),
                                   "--collectors", "engine,ebpf", "--interval", "0.5s",
                                   "--telemetry-root", str(root), "--state-dir", str(state)],
                                  stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HOME": str(base)})
    pattern = Pattern(cuda_standin)  # a CUDA process it would probe, could it
    try:
        url = f"http://127.0.0.1:{port}"

        def collectors():
            assert daemon.poll() is None, (base / "daemon.log").read_text()[-3000:]
            try:
                status = httpx.get(url + "/api/v1/status", timeout=5).json()
            except httpx.HTTPError:
                return None
            return {c["name"]: c for c in status["collectors"]}

        wait_for(lambda: (s := collectors()) and s["ebpf"]["reason"] != "not run yet", 60,
                 "a first cycle")
        # Really that user (setpriv exec'd the daemon: same pid), with no capability.
        with open(f"/proc/{daemon.pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        assert fields["Uid"].split() == [str(uid)] * 4, fields["Uid"]
        assert int(fields["CapEff"], 16) == 0, fields["CapEff"]
        time.sleep(2)  # several cycles on: still running, still the same answer
        states = collectors()
        reason = states["ebpf"]["reason"]
        assert not states["ebpf"]["up"] and "CAP_BPF" in reason and f"uid {uid} " in reason, \
            reason
        assert states["engine"]["up"], states
        text = httpx.get(url + "/metrics", timeout=5).text
        assert 'ac_collector_up{collector="ebpf"} 0.0' in text
        assert 'ac_collector_up{collector="engine"} 1.0' in text
        assert "ac_cuda_" not in text and "ac_ebpf_" not in text  # nothing half-collected
        shown = run_cli("--daemon", url, "status")
        assert shown.returncode == 0 and "CAP_BPF" in shown.stdout, shown.stdout + shown.stderr
        assert daemon.poll() is None
    finally:
        pattern.exit()
        daemon.terminate()
        daemon.wait(timeout=20)
        shutil.rmtree(base)
