"""Per-process series named by their container and pod: `container_id`, `pod_uid`, and
on Kubernetes with the kubelet's socket `namespace`, `pod`, `container`.

Each cycle the daemon hands every family to `Attribution.label`: a sample with a `pid`
gets its process's labels. Who a process is comes from its cgroup (cgroup.py), cached by
(pid, start time): a reused pid is read afresh, and a process no series names any more
(it exited) drops its entry. Pod and container names come from the kubelet's
pod-resources `List()` (pod_resources.py), which names the devices each container holds
but no container id: a process is joined to a pod's container through the GPUs NVML
reports it on (`ac_gpu_process_*{uuid,pid}`), when exactly one container holds them, and
what is learnt holds for every process of that container (its eBPF series too) and the
pod's other containers' `namespace` and `pod`.

NOTE: labels stay bounded: one set per live process (at most MAX_PROCESSES are looked
up a cycle), and every value matched a strict pattern first.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from ac_observe import metrics as m
from ac_observe.collectors.attribution.cgroup import (
    NOBODY,
    CgroupIdentity,
    read_cgroup,
    start_time,
)
from ac_observe.collectors.attribution.pod_resources import PodContainer, PodResources

MAX_PROCESSES = 4096
# A process of a pod not yet named has the kubelet listed again, at most this often.
MISS_REFRESH_SECONDS = 5.0
SOURCE_POD_RESOURCES, SOURCE_CGROUP, SOURCE_NONE = "pod-resources", "cgroup", "none"


@dataclass(slots=True)
class _Entry:
    started: int
    identity: CgroupIdentity


class Attribution:
    def __init__(self, proc: Path = Path("/proc"), socket_path: Path | None = None):
        self.proc = Path(proc)
        self.kubelet = PodResources(socket_path) if socket_path is not None else None
        self._cache: dict[int, _Entry] = {}
        self._containers: dict[str, tuple[str, str, str]] = {}  # container id -> ns, pod, name
        self._pods: dict[str, tuple[str, str]] = {}  # pod uid -> ns, pod

    # ----- who a process is --------------------------------------------------------------

    def identity(self, pid: int) -> CgroupIdentity:
        started = start_time(self.proc, pid)
        if started is None:
            self._cache.pop(pid, None)
            return NOBODY
        entry = self._cache.get(pid)
        if entry is None or entry.started != started:
            entry = self._cache[pid] = _Entry(started, read_cgroup(self.proc, pid))
        return entry.identity

    def labels_of(self, pid: int) -> dict[str, str]:
        identity = self.identity(pid)
        labels = {}
        if identity.container_id:
            labels[m.CONTAINER_ID_LABEL] = identity.container_id
        if identity.pod_uid:
            labels[m.POD_UID_LABEL] = identity.pod_uid
        named = self._containers.get(identity.container_id)
        if named:
            labels.update(zip(m.POD_NAME_LABELS, named, strict=True))
        elif identity.pod_uid in self._pods:
            labels.update(zip(m.POD_NAME_LABELS[:2], self._pods[identity.pod_uid],
                              strict=True))
        return labels

    # ----- the cycle ---------------------------------------------------------------------

    def label(self, families: list[Metric], engines: dict[str, int] | None = None) -> None:
        """Add each per-process sample's labels (in place): a sample with a pid, and one
        of an engine whose process is known (`engines`: {engine: pid}; its series keep no
        pid label). Forget processes no sample names any more."""
        found = _per_process(families, engines or {})  # one pass: ~1 ms per 10k samples
        pids = {pid for _, _, pid in found}
        if self.kubelet is not None:
            self._join_pods(families)
        wanted = {pid: self.labels_of(pid) for pid in sorted(pids)[:MAX_PROCESSES]}
        for pid in set(self._cache) - set(wanted):
            del self._cache[pid]
        for samples, i, pid in found:
            extra = wanted.get(pid)
            if extra:
                samples[i] = samples[i]._replace(labels={**samples[i].labels, **extra})

    def _join_pods(self, families: list[Metric]) -> None:
        assert self.kubelet is not None
        gpus = _gpus_of(families)
        unnamed = [pid for pid in gpus if self._unnamed(pid)]
        listed = self.kubelet.containers(MISS_REFRESH_SECONDS if unnamed else None)
        if not self.kubelet.usable():
            self._containers, self._pods = {}, {}
            return
        holders: dict[str, list[PodContainer]] = {}
        for container in listed:
            for device in container.devices:
                holders.setdefault(device, []).append(container)
        containers: dict[str, tuple[str, str, str]] = {}
        pods: dict[str, tuple[str, str]] = {}
        for pid, uuids in gpus.items():
            identity = self.identity(pid)
            if not identity.container_id:
                continue
            found = {c for uuid in uuids for c in holders.get(uuid, ())}
            if len(found) != 1:
                continue  # no container holds the GPU, or several share it
            (container,) = found
            containers[identity.container_id] = (container.namespace, container.pod,
                                                 container.container)
            if identity.pod_uid:
                pods[identity.pod_uid] = (container.namespace, container.pod)
        # A container named before keeps its name while the kubelet still lists it and a
        # process of it is still seen (so these tables hold live containers only).
        live = {(c.namespace, c.pod, c.container) for c in listed}
        seen = {e.identity for e in self._cache.values()}
        seen_ids = {i.container_id for i in seen}
        seen_uids = {i.pod_uid for i in seen}
        for cid, named in self._containers.items():
            if cid not in containers and named in live and cid in seen_ids:
                containers[cid] = named
        for uid, pod in self._pods.items():
            if uid not in pods and uid in seen_uids and \
                    any(pod == (c.namespace, c.pod) for c in listed):
                pods[uid] = pod
        self._containers, self._pods = containers, pods

    def _unnamed(self, pid: int) -> bool:
        identity = self.identity(pid)
        return bool(identity.container_id) and identity.container_id not in self._containers

    # ----- status ------------------------------------------------------------------------

    def status(self) -> dict:
        """Which source names processes now, and why a better one is missing."""
        reasons = []
        if self.kubelet is not None:
            if self.kubelet.usable():
                source = SOURCE_POD_RESOURCES
            if not self.kubelet.ok:  # failing, its last answer kept a while, or gone
                reasons.append(self.kubelet.reason)
        else:
            reasons.append("the kubelet's pod-resources socket is switched off")
        if self.kubelet is None or not self.kubelet.usable():
            readable = os.access(self.proc / "self" / "cgroup", os.R_OK)
            source = SOURCE_CGROUP if readable else SOURCE_NONE
            if not readable:
                reasons.append(f"{self.proc}/self/cgroup does not read: no cgroups")
        entries = list(self._cache.values())  # the cycle's thread changes the cache
        return {"source": source, "reason": "; ".join(r for r in reasons if r),
                "socket": str(self.kubelet.socket_path) if self.kubelet else None,
                "processes": len(entries),
                "containers": len({e.identity.container_id for e in entries
                                   if e.identity.container_id}),
                "named_containers": len(self._containers)}


def _per_process(families: list[Metric],
                 engines: dict[str, int]) -> list[tuple[list, int, int]]:
    """(a family's samples, the index of one of a process, its pid) of every such sample."""
    found = []
    for family in families:
        samples = family.samples
        for i, sample in enumerate(samples):
            text = sample.labels.get(m.PID_LABEL)
            if text and text.isdigit() and len(text) <= 10:
                found.append((samples, i, int(text)))
            elif engines and text is None:
                pid = engines.get(sample.labels.get("engine", ""))
                if pid is not None:
                    found.append((samples, i, pid))
    return found


def _gpus_of(families: list[Metric]) -> dict[int, set[str]]:
    """{pid: GPU UUIDs, and MIG devices' where the process runs in one} from NVML's
    per-process series (device plugins hand out MIG devices by their own UUID)."""
    mig = {tuple(s.labels.get(k) for k in ("uuid", *m.MIG_LABELS)): s.labels.get("mig_uuid")
           for f in families if f.name == m.GPU_MIG_DEVICE.family for s in f.samples}
    gpus: dict[int, set[str]] = {}
    for family in families:
        if family.name not in m.GPU_PROCESS_FAMILIES:
            continue
        for sample in family.samples:
            text, uuid = sample.labels.get(m.PID_LABEL), sample.labels.get("uuid")
            if text and text.isdigit() and uuid:
                held = gpus.setdefault(int(text), set())
                held.add(uuid)
                instance = mig.get((uuid, *(sample.labels.get(k) for k in m.MIG_LABELS)))
                if instance:
                    held.add(instance)
    return gpus
