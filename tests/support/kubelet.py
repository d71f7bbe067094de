"""A stand-in of the kubelet's pod-resources gRPC service, built from its real proto (the
stubs ac-observe ships, collectors/attribution/podresources_v1/), on a unix socket."""
from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from ac_observe.collectors.attribution.podresources_v1 import api_pb2, api_pb2_grpc


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, server: PodResourcesServer):
        self.server = server

    def List(self, request, context):  # noqa: N802 (the proto's name)
        self.server.calls += 1
        return api_pb2.ListPodResourcesResponse(pod_resources=[
            api_pb2.PodResources(namespace=namespace, name=pod, containers=[
                api_pb2.ContainerResources(name=container, devices=[
                    api_pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                             device_ids=list(devices))])
                for container, devices in containers])
            for namespace, pod, containers in self.server.pods])


class PodResourcesServer:
    """pods: [(namespace, pod, [(container, [device ids])])], changeable while it runs."""

    def __init__(self, socket_path: Path, pods: list):
        self.socket_path = socket_path
        self.pods = pods
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), self.server)
        self.server.add_insecure_port(f"unix://{socket_path}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(10)
