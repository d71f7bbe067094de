"""The kubelet's pod-resources gRPC service (v1 `List`), read over its unix socket.

What the kubelet tells: each pod's namespace and name, its containers' names, and the
devices (GPU UUIDs, MIG UUIDs) each container was given. It does not tell container ids
or pod UIDs: `resolver.py` joins a process to a container through the GPUs NVML sees it
on (as dcgm-exporter names GPUs by pod).

NOTE: the answer is bounded (MAX_MESSAGE_BYTES) and each name must be a Kubernetes name
(DNS-1123, at most 253 characters) before it may become a label; a pod with any other is
left out. A call has a deadline; the socket's absence is a reason, never an error.
"""
from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
SOCKET_ENV = "AC_OBSERVE_POD_RESOURCES_SOCKET"
MAX_MESSAGE_BYTES = 4 << 20
_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
# A device id as device plugins give it: a GPU or MIG UUID, a time-sliced replica of one
# (`GPU-...::3`), or an index.
_DEVICE = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")


@dataclass(frozen=True, slots=True)
class PodContainer:
    namespace: str
    pod: str
    container: str
    devices: frozenset[str]  # device ids as the device plugin named them, replica suffix off


def default_socket() -> Path:
    return Path(os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


def _device(device_id: str) -> str:
    return device_id.split("::", 1)[0]


class PodResources:
    """`List()` on the kubelet's socket, remembered for `max_age_seconds`; a failed call
    keeps the last good list for `keep_seconds` (a busy kubelet's one timeout must not
    take every series' pod labels away and bring them back: new series each time)."""

    def __init__(self, socket_path: Path, timeout_seconds: float = 2.0,
                 max_age_seconds: float = 60.0, keep_seconds: float = 300.0):
        self.socket_path = Path(socket_path)
        self.timeout_seconds = timeout_seconds
        self.max_age_seconds = max_age_seconds
        self.keep_seconds = keep_seconds
        self.reason = "not asked yet"
        self.ok = False
        self._containers: list[PodContainer] = []
        self._listed_at = -float("inf")
        self._good_at = -float("inf")  # the last List() that answered

    def usable(self) -> bool:
        """Whether the names to go by are the kubelet's: its last List() answered, or a
        later one failed within keep_seconds of one that did, the socket still there."""
        return self.ok or time.monotonic() - self._good_at < self.keep_seconds

    def present(self) -> bool:
        try:
            return stat.S_ISSOCK(os.stat(self.socket_path).st_mode)
        except OSError:
            return False

    def containers(self, fresh_within: float | None = None) -> list[PodContainer]:
        """The node's pod containers, listed again when the last list is older than
        `fresh_within` seconds (default max_age_seconds); [] without the socket."""
        if not self.present():  # a stat each cycle: a kubelet gone takes its names along
            self.ok = False
            self.reason = f"no kubelet pod-resources socket at {self.socket_path}"
            self._containers, self._listed_at = [], -float("inf")
            self._good_at = -float("inf")
            return self._containers
        limit = self.max_age_seconds if fresh_within is None else fresh_within
        if time.monotonic() - self._listed_at < limit:
            return self._containers
        self._listed_at = time.monotonic()
        try:
            self._containers = self._list()
        except Exception as exc:  # grpc's errors, a refused connection, a bad answer
            self.ok = False
            detail = getattr(exc, "details", lambda: None)() or type(exc).__name__
            self.reason = f"pod-resources List() on {self.socket_path} failed: {detail}"[:300]
            return self._containers
        self.ok, self.reason, self._good_at = True, "", time.monotonic()
        return self._containers

    def _list(self) -> list[PodContainer]:
        import grpc

        from ac_observe.collectors.attribution.podresources_v1 import api_pb2, api_pb2_grpc
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_http_proxy", 0)]
        with grpc.insecure_channel(f"unix://{self.socket_path}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            answer = stub.List(api_pb2.ListPodResourcesRequest(),
                               timeout=self.timeout_seconds)
        found = []
        for pod in answer.pod_resources:
            if not (_NAME.match(pod.namespace) and _NAME.match(pod.name)):
                continue
            for container in pod.containers:
                if not _NAME.match(container.name):
                    continue
                devices = frozenset(_device(d) for group in container.devices
                                    for d in group.device_ids if _DEVICE.match(d))
                found.append(PodContainer(pod.namespace, pod.name, container.name, devices))
        return found
