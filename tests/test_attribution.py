"""Per-process series named by container and pod: cgroup paths of every runtime's form,
real cgroups made by the test, and the daemon's series through the real pynvml."""
from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily

from ac_observe import metrics as m
from ac_observe.collectors.attribution import Attribution
from ac_observe.collectors.attribution.cgroup import NOBODY, parse_cgroup, start_time
from support.servers import sample_value, wait_for
from support.standins import Pattern, build_cuda, build_nvml

ID = "0123456789abcdef" * 4
UID = "8c5f1a2e-3b4d-4e6f-9a0b-1c2d3e4f5a6b"
UID_ = UID.replace("-", "_")

FORMS = [  # (/proc/PID/cgroup line, container id, runtime, pod uid)
    (f"0::/system.slice/docker-{ID}.scope", ID, "docker", ""),
    (f"12:memory:/docker/{ID}", ID, "docker", ""),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{ID}.scope", ID, "containerd", UID),
    (f"4:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{ID}", ID, "kubernetes", UID),
    (f"0::/kubepods/pod{UID}/{ID}", ID, "kubernetes", UID),
    (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope", ID, "cri-o", UID),
    (f"3:pids:/machine.slice/libpod-{ID}.scope", ID, "podman", ""),
]


def test_cgroups_a_container_makes_below_its_own_cannot_claim_another():
    """A process that may make cgroups (delegated cgroup v2) names one below its own after
    another container and pod: the outer names, which it cannot change, are the ones."""
    victim, other_uid = "f" * 64, "11111111-2222-3333-4444-555555555555"
    line = (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope/"
            f"kubepods-pod{other_uid.replace('-', '_')}.slice/docker-{victim}.scope")
    identity = parse_cgroup(line + "\n")
    assert (identity.container_id, identity.runtime, identity.pod_uid) == \
        (ID, "containerd", UID)


@pytest.mark.parametrize("line, container_id, runtime, pod_uid", FORMS)
def test_each_runtimes_cgroup_path_names_its_container(line, container_id, runtime, pod_uid):
    identity = parse_cgroup(f"9:name=systemd:/\n{line}\n1:cpuset:/\n")
    assert (identity.container_id, identity.runtime, identity.pod_uid) == \
        (container_id, runtime, pod_uid)


@pytest.mark.parametrize("text", [
    f"0::/kubepods.slice/crio-conmon-{ID}.scope",  # CRI-O's monitor, not in the container
    f"0::/docker/{ID[:-1]}",  # 63 digits
    f"0::/docker/{ID.upper()}",
    f"0::/system.slice/docker-{ID}.scope.evil",
    f"0::/elsewhere/{ID}",  # a bare id under no runtime's folder
    "0::/", "", "not a cgroup line", "x" * 100_000, "\x00\x01\x02",
    f"0:/docker/{ID}",  # two fields
    f"abc:memory:/docker/{ID}",
])
def test_odd_cgroup_text_names_nobody(text):
    assert parse_cgroup(text) == NOBODY


def test_the_unified_line_wins_over_v1_lines():
    other = "f" * 64
    text = f"4:memory:/docker/{other}\n0::/system.slice/docker-{ID}.scope\n"
    assert parse_cgroup(text).container_id == ID
    assert parse_cgroup(f"4:memory:/docker/{other}\n0::/\n").container_id == other


# ----- real cgroups, made by the test (root, on this machine's hierarchies) ---------------

V1_ROOT, V2_ROOT = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified")
if not (V2_ROOT / "cgroup.procs").exists():  # a pure cgroup v2 host
    V2_ROOT = Path("/sys/fs/cgroup")


def _writable(root: Path) -> bool:
    return os.geteuid() == 0 and (root / "cgroup.procs").exists() and os.access(root, os.W_OK)


class Placed:
    """A `sleep` process moved into a cgroup named as a runtime names its containers'."""

    def __init__(self, root: Path, relative: str, proc: subprocess.Popen | None = None):
        self.dir = root / relative
        self.dir.mkdir(parents=True)
        self.proc = proc or subprocess.Popen(["sleep", "300"])
        self.pid = self.proc.pid
        (self.dir / "cgroup.procs").write_text(str(self.pid))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for folder in [self.dir, *self.dir.parents]:
            if folder in (V1_ROOT, V2_ROOT) or not folder.is_relative_to(self.dir.parents[-3]):
                break
            try:
                folder.rmdir()
            except OSError:
                break


def _real_forms():
    tag = uuid.uuid4().hex[:8]
    uid = str(uuid.uuid4())
    for root, relative, runtime, pod_uid in (
            (V1_ROOT, f"docker/{tag}{ID[8:]}", "docker", ""),
            (V2_ROOT, f"ac-test-{tag}.slice/docker-{tag}{ID[8:]}.scope", "docker", ""),
            (V2_ROOT, f"ac-test-{tag}.slice/kubepods-burstable-pod{uid.replace('-', '_')}"
                      f".slice/cri-containerd-{tag}{ID[8:]}.scope", "containerd", uid),
            (V1_ROOT, f"kubepods/burstable/pod{uid}/{tag}{ID[8:]}", "kubernetes", uid),
            (V2_ROOT, f"ac-test-{tag}.slice/crio-{tag}{ID[8:]}.scope", "cri-o", "")):
        yield pytest.param(root, relative, f"{tag}{ID[8:]}", runtime, pod_uid,
                           id=f"{root.name}-{runtime}")


@pytest.mark.parametrize("root, relative, container_id, runtime, pod_uid", list(_real_forms()))
def test_a_process_placed_in_a_runtimes_cgroup_gets_its_container(
        root, relative, container_id, runtime, pod_uid):
    if not _writable(root):
        pytest.skip(f"{root}: cannot make cgroups here (needs root and the hierarchy)")
    placed = Placed(root, relative)
    try:
        attribution = Attribution()
        identity = attribution.identity(placed.pid)
        assert (identity.container_id, identity.runtime, identity.pod_uid) == \
            (container_id, runtime, pod_uid)
        labels = attribution.labels_of(placed.pid)
        assert labels.get("container_id") == container_id
        assert labels.get("pod_uid", "") == pod_uid
        assert attribution.labels_of(os.getpid()) == {}  # the test itself: no container
    finally:
        placed.stop()


def test_the_cache_follows_the_process_and_forgets_it_when_it_exits():
    if not _writable(V1_ROOT):
        pytest.skip("cannot make cgroups here")
    tag = uuid.uuid4().hex[:8]
    placed = Placed(V1_ROOT, f"docker/{tag}{ID[8:]}")
    attribution = Attribution()
    family = GaugeMetricFamily("ac_ebpf_map_entries", "x", labels=["pid", "comm"])
    family.add_metric([str(placed.pid), "sleep"], 3)
    try:
        attribution.label([family])
        assert family.samples[0].labels["container_id"] == f"{tag}{ID[8:]}"
        assert placed.pid in attribution._cache
        assert start_time(Path("/proc"), placed.pid) == \
            attribution._cache[placed.pid].started
    finally:
        placed.stop()
    gone = GaugeMetricFamily("ac_ebpf_map_entries", "x", labels=["pid", "comm"])
    gone.add_metric([str(placed.pid), "sleep"], 3)
    attribution.label([gone])  # the pid is gone: no labels, no entry
    assert "container_id" not in gone.samples[0].labels
    assert placed.pid not in attribution._cache
    attribution.label([])
    assert attribution._cache == {}


# ----- the daemon: NVML's series through the real pynvml, and status ----------------------

def test_nvml_series_of_a_containers_process_carry_its_container(start_daemon,
                                                                 tmp_path_factory):
    if not _writable(V2_ROOT):
        pytest.skip("cannot make cgroups here")
    nvml = build_nvml(tmp_path_factory.mktemp("nvml"))
    tag = uuid.uuid4().hex[:8]
    inside = Placed(V2_ROOT, f"ac-test-{tag}.slice/cri-containerd-{tag}{ID[8:]}.scope")
    outside = subprocess.Popen(["sleep", "300"])
    try:
        daemon = start_daemon(None, "--collectors", "nvml", "--pod-resources-socket", "",
                              env={"LD_LIBRARY_PATH": str(nvml),
                                   "AC_NVML_STANDIN_PIDS": f"{inside.pid},{outside.pid}"})
        deadline = time.monotonic() + 30
        while True:
            metrics = daemon.metrics()
            if sample_value(metrics, "ac_gpu_process_memory_bytes", pid=str(inside.pid)):
                break
            assert time.monotonic() < deadline, daemon.log_path.read_text()
            time.sleep(0.2)
        gpu0 = {"gpu": "0", "uuid": "GPU-11111111-2222-3333-4444-000000000000"}
        mine = {"pid": str(inside.pid), "container_id": f"{tag}{ID[8:]}", **gpu0}
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", **mine) == 512 << 20
        for family, value in (("sm", 0.30), ("memory", 0.20), ("encoder", 0.0),
                              ("decoder", 0.0)):
            assert sample_value(metrics, f"ac_gpu_process_{family}_utilization_ratio",
                                **mine) == pytest.approx(value)
        theirs = {"pid": str(outside.pid), **gpu0}
        assert sample_value(metrics, "ac_gpu_process_sm_utilization_ratio",
                            **theirs) == pytest.approx(0.31)
        assert sample_value(metrics, "ac_gpu_process_decoder_utilization_ratio",
                            **theirs) == pytest.approx(0.02)
        assert not any(("container_id", f"{tag}{ID[8:]}") in labels
                       for (name, labels) in metrics
                       if ("pid", str(outside.pid)) in labels)
        status = daemon.status()
        assert status["attribution"]["source"] == "cgroup"
        assert "switched off" in status["attribution"]["reason"]
        assert status["attribution"]["containers"] == 1
    finally:
        inside.stop()
        outside.kill()
        outside.wait(timeout=10)


def test_every_per_process_family_declares_the_attribution_labels():
    per_process = [s for s in m.ALL_METRICS if m.PID_LABEL in s.labels]
    assert {s.name for s in per_process} >= {"ac_ebpf_map_entries",
                                             "ac_gpu_process_memory_bytes",
                                             "ac_gpu_process_sm_utilization_ratio",
                                             "ac_engine_process"}
    for spec in per_process:
        assert set(m.ATTRIBUTION_LABELS) <= set(m.exposed_labels(spec)), spec.name


def _fake_process(proc: Path, pid: int, started: int, cgroup: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 18 + [str(started)] + ["0"] * 30
    (proc / str(pid) / "stat").write_text(f"{pid} (a (b) c) " + " ".join(fields) + "\n")
    (proc / str(pid) / "cgroup").write_text(cgroup)


def test_a_reused_pid_is_read_afresh_and_the_same_process_is_not(tmp_path):
    """Cached by (pid, start time): a new process under an old pid gets its own labels."""
    other = "f" * 64
    _fake_process(tmp_path, 77, 1000, f"0::/system.slice/docker-{ID}.scope\n")
    attribution = Attribution(proc=tmp_path)
    assert attribution.labels_of(77) == {"container_id": ID}
    # The same process (same start time): the cache answers, the file is not read again.
    _fake_process(tmp_path, 77, 1000, f"0::/system.slice/docker-{other}.scope\n")
    assert attribution.labels_of(77) == {"container_id": ID}
    # Another process under the same pid (a later start): read afresh.
    _fake_process(tmp_path, 77, 2000, f"0::/system.slice/docker-{other}.scope\n")
    assert attribution.labels_of(77) == {"container_id": other}


# ----- the kubelet's pod-resources socket: a stand-in from the real proto ----------------

GPU0 = "GPU-11111111-2222-3333-4444-000000000000"


def _wait_for(daemon, name, **labels):
    deadline = time.monotonic() + 30
    while True:
        metrics = daemon.metrics()
        if sample_value(metrics, name, **labels) is not None:
            return metrics
        assert time.monotonic() < deadline, daemon.log_path.read_text()[-3000:]
        time.sleep(0.2)


def _cli_status(daemon) -> str:
    from support.servers import AC_OBSERVE
    done = subprocess.run([AC_OBSERVE, "--daemon", daemon.url, "status"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _status(daemon) -> dict:
    import httpx
    return httpx.get(daemon.url + "/api/v1/status", timeout=10).json()


@pytest.mark.slow
def test_the_kubelets_socket_names_namespace_pod_and_container(start_daemon, tmp_path,
                                                               tmp_path_factory):
    if not _writable(V2_ROOT):
        pytest.skip("cannot make cgroups here")
    from support.kubelet import PodResourcesServer
    nvml = build_nvml(tmp_path_factory.mktemp("nvml"))
    tag, uid = uuid.uuid4().hex[:8], str(uuid.uuid4())
    pod_dir = f"ac-test-{tag}.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    inside = Placed(V2_ROOT, f"{pod_dir}/cri-containerd-{tag}{ID[8:]}.scope")
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [
        ("serving", "llama-7b-6d9f", [("vllm", [GPU0 + "::0"]), ("sidecar", [])]),
        ("other", "batch-1", [("trainer", ["GPU-11111111-2222-3333-4444-000000000009"])]),
    ])
    try:
        daemon = start_daemon(None, "--collectors", "nvml",
                              "--pod-resources-socket", str(socket_path),
                              env={"LD_LIBRARY_PATH": str(nvml),
                                   "AC_NVML_STANDIN_PIDS": str(inside.pid)})
        metrics = _wait_for(daemon, "ac_gpu_process_sm_utilization_ratio", pod="llama-7b-6d9f")
        named = {"pid": str(inside.pid), "container_id": f"{tag}{ID[8:]}", "pod_uid": uid,
                 "namespace": "serving", "pod": "llama-7b-6d9f", "container": "vllm"}
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", **named) == 512 << 20
        assert sample_value(metrics, "ac_gpu_process_sm_utilization_ratio",
                            **named) == pytest.approx(0.30)
        status = _status(daemon)["attribution"]
        assert (status["source"], status["reason"], status["named_containers"]) == \
            ("pod-resources", "", 1)
        assert "processes named by: pod-resources (1 container(s) among 1 process(es), " \
            "1 named by the kubelet)" in _cli_status(daemon)
        # The kubelet goes away: the names go with it, the cgroup's labels stay, and
        # status says why.
        kubelet.stop()
        socket_path.unlink(missing_ok=True)  # grpc removes it on stop
        deadline = time.monotonic() + 30
        while _status(daemon)["attribution"]["source"] != "cgroup":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert "no kubelet pod-resources socket at" in _status(daemon)["attribution"]["reason"]
        printed = _cli_status(daemon)
        assert "processes named by: cgroup" in printed
        assert f"no kubelet pod-resources socket at {socket_path}" in printed.replace("\n  ", "")
        metrics = daemon.metrics()
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", pid=str(inside.pid),
                            pod_uid=uid, container_id=f"{tag}{ID[8:]}") == 512 << 20
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", pod="llama-7b-6d9f") \
            is None
    finally:
        kubelet.stop()
        inside.stop()


def test_a_gpu_two_pods_share_names_neither(tmp_path):
    """Time-slicing: two containers hold replicas of one GPU; a process on it cannot be
    told apart by device, so it gets no pod name (its cgroup's labels still)."""
    from support.kubelet import PodResourcesServer
    cid = "a" * 64
    _fake_process(tmp_path, 50, 1, f"0::/kubepods/pod{UID}/{cid}\n")
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [
        ("a", "one", [("c", [GPU0 + "::0"])]), ("b", "two", [("c", [GPU0 + "::1"])])])
    try:
        attribution = Attribution(proc=tmp_path, socket_path=socket_path)
        family = GaugeMetricFamily("ac_gpu_process_memory_bytes", "x",
                                   labels=["gpu", "uuid", "pid"])
        family.add_metric(["0", GPU0, "50"], 1.0)
        attribution.label([family])
        assert family.samples[0].labels == {"gpu": "0", "uuid": GPU0, "pid": "50",
                                            "container_id": cid, "pod_uid": UID}
        assert attribution.status()["source"] == "pod-resources"
        kubelet.pods = [("a", "one", [("c", [GPU0 + "::0"])])]  # the other pod is gone
        attribution.kubelet._listed_at = -float("inf")
        family.samples[0] = family.samples[0]._replace(
            labels={"gpu": "0", "uuid": GPU0, "pid": "50"})
        attribution.label([family])
        assert family.samples[0].labels["pod"] == "one"
    finally:
        kubelet.stop()


def test_a_failed_list_keeps_the_last_names_a_while(tmp_path):
    """One List() that fails (a busy kubelet's timeout) keeps the names its last answer
    gave for keep_seconds, said in status: labels that came and went would make new
    series each time. Past keep_seconds, or with the socket gone, the names go."""
    import socket

    from support.kubelet import PodResourcesServer
    cid = "a" * 64
    _fake_process(tmp_path, 50, 1, f"0::/kubepods/pod{UID}/{cid}\n")
    (tmp_path / "self").symlink_to("50")
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [("a", "one", [("c", [GPU0])])])
    attribution = Attribution(proc=tmp_path, socket_path=socket_path)
    attribution.kubelet.timeout_seconds = 0.5

    def labelled() -> dict:
        family = GaugeMetricFamily("ac_gpu_process_memory_bytes", "x",
                                   labels=["gpu", "uuid", "pid"])
        family.add_metric(["0", GPU0, "50"], 1.0)
        attribution.label([family])
        return family.samples[0].labels

    assert labelled()["pod"] == "one"
    kubelet.stop()
    silent = socket.socket(socket.AF_UNIX)
    try:
        socket_path.unlink(missing_ok=True)
        silent.bind(str(socket_path))  # the socket is there, List() fails
        attribution.kubelet._listed_at = -float("inf")
        assert labelled()["pod"] == "one"
        status = attribution.status()
        assert status["source"] == "pod-resources"
        assert status["reason"].startswith(f"pod-resources List() on {socket_path} failed")
        attribution.kubelet._good_at -= attribution.kubelet.keep_seconds
        attribution.kubelet._listed_at = -float("inf")
        assert "pod" not in labelled()
        assert attribution.status()["source"] == "cgroup"
    finally:
        silent.close()


def test_a_socket_that_is_not_the_kubelets_is_a_reason_not_an_error(tmp_path):
    import socket
    _fake_process(tmp_path, 50, 1, f"0::/kubepods/pod{UID}/{'a' * 64}\n")
    (tmp_path / "self").symlink_to("50")
    path = tmp_path / "kubelet.sock"
    silent = socket.socket(socket.AF_UNIX)
    silent.bind(str(path))  # bound, never listening: connections are refused
    try:
        attribution = Attribution(proc=tmp_path, socket_path=path)
        attribution.kubelet.timeout_seconds = 0.5
        family = GaugeMetricFamily("ac_gpu_process_memory_bytes", "x",
                                   labels=["gpu", "uuid", "pid"])
        family.add_metric(["0", GPU0, "50"], 1.0)
        attribution.label([family])
        assert family.samples[0].labels["container_id"] == "a" * 64
        status = attribution.status()
        assert status["source"] == "cgroup"
        assert status["reason"].startswith(f"pod-resources List() on {path} failed")
    finally:
        silent.close()


# ----- eBPF and NVML together: processes in docker's and CRI-O's cgroups ------------------

@pytest.mark.slow  # bcc compiles its probes
def test_ebpf_and_nvml_series_carry_each_processs_container(start_daemon, tmp_path_factory):
    if os.geteuid() != 0 or not (_writable(V1_ROOT) and _writable(V2_ROOT)):
        pytest.skip("needs root and cgroups to make")
    cuda = build_cuda(tmp_path_factory.mktemp("cuda"))
    nvml = build_nvml(tmp_path_factory.mktemp("nvml"))
    tag = uuid.uuid4().hex[:8]
    docker_id, crio_id = f"{tag}{ID[8:]}", f"{tag}{'e' * 56}"
    first, second = Pattern(cuda), Pattern(cuda)
    placed = [Placed(V1_ROOT, f"docker/{docker_id}", first.proc),
              Placed(V2_ROOT, f"ac-test-{tag}.slice/crio-{crio_id}.scope", second.proc)]
    try:
        daemon = start_daemon(None, "--collectors", "ebpf,nvml", "--interval", "0.5s",
                              "--pod-resources-socket", "",
                              env={"LD_LIBRARY_PATH": str(nvml),
                                   "AC_NVML_STANDIN_PIDS": f"{first.pid},{second.pid}"})
        wait_for(lambda: next(c for c in _status(daemon)["collectors"]
                              if c["name"] == "ebpf")["up"], 60, "probes on the libraries")
        assert first.run("round 1") == "done" and second.run("round 1") == "done"
        metrics = wait_for(lambda: (got := daemon.metrics()) and all(sample_value(
            got, "ac_cuda_graph_launches_total", pid=p.pid) == 1 for p in (first, second))
            and got, 20, "the counts")
        for pattern, container_id in ((first, docker_id), (second, crio_id)):
            mine = {"pid": pattern.pid, "container_id": container_id}
            assert sample_value(metrics, "ac_cuda_kernel_launches_total", stream="0x1000",
                                **mine) == 3
            assert sample_value(metrics, "ac_cuda_graph_launches_total", **mine) == 1
            assert sample_value(metrics, "ac_ebpf_map_entries", **mine) > 0
            assert sample_value(metrics, "ac_cuda_sync_wait_seconds_count",
                                api="cudaDeviceSynchronize", **mine) == 1
            assert sample_value(metrics, "ac_gpu_process_memory_bytes", **mine) == 512 << 20
            assert sample_value(metrics, "ac_gpu_process_sm_utilization_ratio", **mine) > 0
    finally:
        for pattern in (first, second):
            pattern.exit()
        for cgroup in placed:
            cgroup.stop()


def test_a_process_on_a_mig_device_is_named_by_the_container_holding_that_device(
        start_daemon, tmp_path, tmp_path_factory):
    """Device plugins hand out MIG devices by their own UUID: the process's GPU and
    compute instance lead to it (ac_gpu_mig_device_info), and so to the pod."""
    if not _writable(V2_ROOT):
        pytest.skip("cannot make cgroups here")
    from support.kubelet import PodResourcesServer
    nvml = build_nvml(tmp_path_factory.mktemp("nvml"))
    tag, uid = uuid.uuid4().hex[:8], str(uuid.uuid4())
    inside = Placed(V2_ROOT, f"ac-test-{tag}.slice/kubepods-pod{uid.replace('-', '_')}.slice/"
                             f"crio-{tag}{ID[8:]}.scope")
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [
        ("ml", "small-1", [("worker", ["MIG-aaaaaaaa-bbbb-cccc-dddd-000000000001"])]),
        ("ml", "small-2", [("worker", ["MIG-aaaaaaaa-bbbb-cccc-dddd-000000000002"])]),
    ])
    try:
        daemon = start_daemon(None, "--collectors", "nvml",
                              "--pod-resources-socket", str(socket_path),
                              env={"LD_LIBRARY_PATH": str(nvml),
                                   "AC_NVML_STANDIN_MIG_PID": str(inside.pid)})
        metrics = _wait_for(daemon, "ac_gpu_process_memory_bytes", pod="small-2")
        assert sample_value(metrics, "ac_gpu_process_memory_bytes", pid=str(inside.pid),
                            gpu_instance="2", compute_instance="0", namespace="ml",
                            pod="small-2", container="worker", pod_uid=uid,
                            container_id=f"{tag}{ID[8:]}") == 256 << 20
    finally:
        kubelet.stop()
        inside.stop()


# ----- engine series: a discovered vLLM (stand-in) in a containerd cgroup ----------------

def test_a_discovered_engines_series_and_processes_carry_its_container(tmp_path):
    """The server (and the child it starts, as vLLM's EngineCore) run in the container's
    cgroup from their first instruction: its engine series, ac_engine_up and both rows of
    ac_engine_process carry the container's id; a process outside it none."""
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.service import Daemon
    from support.processes import start_process, stop_process
    from support.servers import free_port
    if not _writable(V2_ROOT):
        pytest.skip("cannot make cgroups here")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(tests, "support", "standin_engines"), tests])}
    tag, uid = uuid.uuid4().hex[:8], str(uuid.uuid4())
    cgroup = V2_ROOT / (f"ac-test-{tag}.slice/kubepods-besteffort-pod{uid.replace('-', '_')}"
                        f".slice/cri-containerd-{tag}{ID[8:]}.scope")
    cgroup.mkdir(parents=True)
    port = free_port()
    server = start_process(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"',
                            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                            "--port", str(port)], env=env)
    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "telemetry", collectors=(),
                                 history=False, engine_discovery=True,
                                 pod_resources_socket=None))
    try:
        def rendered():
            daemon.run_cycle()
            text = daemon.render_metrics().decode()
            return f'pid="{server.pid}"' in text.split("ac_requests_running", 1)[-1] and text
        text = wait_for(rendered, 30, "the stand-in vLLM found and read")
        series = [(f.name, s.labels) for f in text_string_to_metric_families(text)
                  for s in f.samples if s.labels.get("engine") == f"vllm-{server.pid}"]
        mine = {"container_id": f"{tag}{ID[8:]}", "pod_uid": uid}
        names = {name for name, _ in series}
        assert {"ac_requests_running", "ac_engine_up", "ac_engine_process"} <= names
        for name, labels in series:
            assert {k: labels.get(k) for k in mine} == mine, (name, labels)
        roles = {labels["role"] for name, labels in series if name == "ac_engine_process"}
        assert roles == {"server", "child"}
        # The query API picks the engine by its container, as PromQL would.
        (picked,) = daemon.query("requests_running", 3600,
                                 {"container_id": f"{tag}{ID[8:]}"})["series"]
        assert picked["labels"]["engine"] == f"vllm-{server.pid}"
        assert picked["labels"]["pod_uid"] == uid
    finally:
        daemon.close()
        stop_process(server)
        for folder in (cgroup, cgroup.parent, cgroup.parent.parent):
            try:
                folder.rmdir()
            except OSError:
                pass


# ----- a bundled engine's series: through its verified process --------------------------

WRITER = """
import sys, time
from ac_observe.engine.telemetry import TelemetryWriter
from ac_observe.metrics import REQUESTS
w = TelemetryWriter(sys.argv[1], {}, engine="boxed", model="m")
w.inc(REQUESTS, 5, stream="throughput", status="ok")
print("ready", flush=True)
sys.stdin.readline()
w.close()
"""


def test_a_bundled_engines_series_carry_its_processs_container(tmp_path):
    """engine.json's pid, checked against the process mapping the engine's telemetry file:
    the engine in a docker cgroup has its container on its series (no pid label added);
    one in no container has none."""
    import sys

    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.service import Daemon
    from ac_observe.engine.telemetry import TelemetryWriter
    from ac_observe.metrics import REQUESTS
    from support.servers import parse_metrics
    if not _writable(V1_ROOT):
        pytest.skip("cannot make cgroups here")
    tag = uuid.uuid4().hex[:8]
    cgroup = V1_ROOT / "docker" / f"{tag}{ID[8:]}"
    cgroup.mkdir(parents=True)
    root = tmp_path / "telemetry"
    root.mkdir(mode=0o700)
    boxed = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"',
                              sys.executable, "-c", WRITER, str(root / "boxed")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mine = TelemetryWriter(root / "free", {}, engine="free", model="m")
    mine.inc(REQUESTS, 1, stream="throughput", status="ok")
    daemon = Daemon(DaemonConfig(telemetry_root=root, collectors=("engine",), history=False,
                                 pod_resources_socket=None))
    try:
        assert boxed.stdout.readline().strip() == "ready"

        def rendered():
            daemon.run_cycle()
            got = parse_metrics(daemon.render_metrics().decode())
            return sample_value(got, "ac_requests_total", engine="boxed", status="ok",
                                stream="throughput") is not None and got
        metrics = wait_for(rendered, 30, "both engines read")
        assert sample_value(metrics, "ac_requests_total", engine="boxed", status="ok",
                            stream="throughput", container_id=f"{tag}{ID[8:]}") == 5
        boxed_labels = [dict(labels) for (name, labels) in metrics
                        if ("engine", "boxed") in labels and name == "ac_requests_total"]
        assert all("pid" not in labels for labels in boxed_labels)
        free = [dict(labels) for (name, labels) in metrics if ("engine", "free") in labels]
        assert free and not any("container_id" in labels for labels in free)
    finally:
        daemon.close()
        mine.close()
        boxed.stdin.write("\n")
        boxed.stdin.flush()
        boxed.wait(timeout=30)
        cgroup.rmdir()


def test_an_engine_pid_that_does_not_map_its_file_names_no_process(tmp_path):
    """As an engine in another pid namespace: engine.json's pid is someone else here."""
    from ac_observe.collectors.engine.process import EngineProcesses
    from ac_observe.engine.telemetry import TelemetryWriter
    root = tmp_path / "telemetry"
    root.mkdir(mode=0o700)
    writer = TelemetryWriter(root / "e1", {}, engine="e1", model="m")
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        processes = EngineProcesses(root)
        assert processes.pid_of("e1", "e1", os.getpid()) == os.getpid()  # it maps the file
        os.link(root / "e1" / f"counter_{os.getpid()}.db",
                root / "e1" / f"counter_{stranger.pid}.db")
        assert processes.pid_of("e1", "e2", stranger.pid) is None  # the file, not mapped
        assert processes.pid_of("e1", "e3", 2 ** 22 + 7) is None  # no such process
        assert processes.pid_of("e1", "e4", "1") is None
    finally:
        stranger.kill()
        stranger.wait()
        writer.close()


def test_names_that_are_not_kubernetes_names_never_become_labels(tmp_path):
    from ac_observe.collectors.attribution.pod_resources import PodResources
    from support.kubelet import PodResourcesServer
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [
        ("ok", "fine-pod", [("c", [GPU0]), ('x" } evil', [GPU0])]),
        ("Bad_NS", "p", [("c", [GPU0])]),
        ("ns", "p" * 300, [("c", [GPU0])]),
        ("ns", "odd-device", [("c", ["GPU-1\n2"])]),
    ])
    try:
        listed = PodResources(socket_path).containers()
        assert [(c.namespace, c.pod, c.container, sorted(c.devices)) for c in listed] == [
            ("ok", "fine-pod", "c", [GPU0]), ("ns", "odd-device", "c", [])]
    finally:
        kubelet.stop()


def test_a_named_container_keeps_its_name_on_its_ebpf_series_while_listed(tmp_path):
    """Named once through its GPU, a container's other series (eBPF's, with no GPU on
    them) carry its pod's name, also in cycles where NVML has no series of it; once the
    kubelet no longer lists the pod, the name goes."""
    from support.kubelet import PodResourcesServer
    cid = "c" * 64
    _fake_process(tmp_path, 60, 5, f"0::/kubepods/burstable/pod{UID}/{cid}\n")
    _fake_process(tmp_path, 61, 5, f"0::/kubepods/burstable/pod{UID}/{cid}\n")
    socket_path = tmp_path / "kubelet.sock"
    kubelet = PodResourcesServer(socket_path, [("prod", "api-0", [("model", [GPU0])])])

    def cycle(with_gpu: bool) -> dict:
        ebpf = GaugeMetricFamily("ac_ebpf_map_entries", "x", labels=["pid", "comm"])
        ebpf.add_metric(["61", "python"], 4)  # a process of the container without a GPU
        families = [ebpf]
        if with_gpu:
            gpu = GaugeMetricFamily("ac_gpu_process_memory_bytes", "x",
                                    labels=["gpu", "uuid", "pid"])
            gpu.add_metric(["0", GPU0, "60"], 1.0)
            families.append(gpu)
        attribution.label(families)
        return ebpf.samples[0].labels

    try:
        attribution = Attribution(proc=tmp_path, socket_path=socket_path)
        named = {"namespace": "prod", "pod": "api-0", "container": "model"}
        assert cycle(with_gpu=True).items() >= named.items()
        assert cycle(with_gpu=False).items() >= named.items()
        kubelet.pods = []
        attribution.kubelet._listed_at = -float("inf")  # the next list is due
        labels = cycle(with_gpu=False)
        assert labels["container_id"] == cid and "pod" not in labels
    finally:
        kubelet.stop()
