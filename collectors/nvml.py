"""NVML collector: GPU state through the real `pynvml` binding (package nvidia-ml-py).

Which fields are exported is data (`DEVICE_FIELDS`, `GPM_FIELDS`), as in dcgm-exporter.
A field the device does not support is skipped; no library or no driver makes the
collector report down with the reason, and nothing else breaks. GPM metrics (Hopper+)
come from two samples at least 100 ms apart: the previous cycle's and this one's.
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ac_observe import metrics as m
from ac_observe.collectors.base import (
    Collector,
    CollectorUnavailable,
    new_counter,
    new_gauge,
    register,
)

log = logging.getLogger("ac_observe.collectors.nvml")
MIN_GPM_GAP_SECONDS = 0.1


def _utilization(nv, handle):
    return nv.nvmlDeviceGetUtilizationRates(handle).gpu


def _memory_used(nv, handle):
    return nv.nvmlDeviceGetMemoryInfo(handle).used


def _memory_total(nv, handle):
    return nv.nvmlDeviceGetMemoryInfo(handle).total


def _temperature(nv, handle):
    try:
        return nv.nvmlDeviceGetTemperatureV(handle, nv.NVML_TEMPERATURE_GPU)
    except nv.NVMLError_FunctionNotFound:  # drivers older than the V API
        return nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)


# family, reader(pynvml, handle), scale to the family's unit
DEVICE_FIELDS = (
    (m.GPU_UTILIZATION, _utilization, 0.01),
    (m.GPU_MEMORY_USED, _memory_used, 1.0),
    (m.GPU_MEMORY_TOTAL, _memory_total, 1.0),
    (m.GPU_POWER, lambda nv, h: nv.nvmlDeviceGetPowerUsage(h), 1e-3),
    (m.GPU_TEMPERATURE, _temperature, 1.0),
    (m.GPU_SM_CLOCK, lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1e6),
)

# family, GPM metric id name in pynvml, scale (NVML reports percent)
GPM_FIELDS = (
    (m.GPU_SM_OCCUPANCY, "NVML_GPM_METRIC_SM_OCCUPANCY", 0.01),
    (m.GPU_SM_ACTIVE, "NVML_GPM_METRIC_SM_UTIL", 0.01),
    (m.GPU_TENSOR_ACTIVE, "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    (m.GPU_DRAM_ACTIVE, "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
)


# XID codes are a driver's small numbers (13, 31, 48, 79, ...); any other value, and codes
# past this many distinct ones on a GPU, count as "other": the label stays bounded.
MAX_XID_CODES = 32
MAX_XID_CODE = 999
NOT_MIG = 0xFFFFFFFF  # a process's gpuInstanceId outside MIG

# nvmlDeviceGetProcessUtilization's sample fields, in the order of
# m.GPU_PROCESS_UTILIZATION (SM, memory, encoder, decoder); NVML reports percent.
PROCESS_UTILIZATION_FIELDS = ("smUtil", "memUtil", "encUtil", "decUtil")


@dataclass(slots=True)
class _Device:
    index: int
    handle: object
    uuid: str
    gpm: bool
    gpm_sample: object = None
    gpm_time: float = 0.0
    xid_counts: dict = field(default_factory=dict)  # XID code (label text) -> events
    handle_address: int = 0
    mig: list = field(default_factory=list)  # (MIG UUID, GPU instance, compute instance)
    process_utilization: bool = True  # until the device says it cannot
    process_seen: int = 0  # the newest process sample's timeStamp read (NVML's µs clock)
    gpm_values: dict = field(default_factory=dict)


@register("nvml")
class NvmlCollector(Collector):
    def __init__(self, config=None):
        import pynvml
        self.nv = pynvml
        self.devices: list[_Device] = []
        self.event_set = None

    def _init(self) -> None:
        nv = self.nv
        try:
            nv.nvmlInit()
        except nv.NVMLError_LibraryNotFound:
            raise CollectorUnavailable("NVML library libnvidia-ml.so.1 not found "
                                       "(no NVIDIA driver on this host)") from None
        except nv.NVMLError as exc:
            raise CollectorUnavailable(f"NVML init failed: {exc}") from None
        devices = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = nv.nvmlDeviceGetUUID(handle)
            devices.append(_Device(index, handle, uuid if isinstance(uuid, str) else uuid.decode(),
                                   self._gpm_supported(handle),
                                   handle_address=ctypes.cast(handle, ctypes.c_void_p).value or 0))
        for device in devices:
            device.mig = self._mig_devices(device.handle)
        self.devices = devices
        self.event_set = self._xid_events(devices)
        log.info("NVML: %d GPU(s)", len(devices))

    def _gpm_supported(self, handle) -> bool:
        try:
            return bool(self.nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except self.nv.NVMLError:
            return False

    def _mig_devices(self, handle) -> list[tuple[str, int, int]]:
        """(UUID, GPU instance, compute instance) of each MIG device; [] outside MIG mode
        (read once: a MIG layout changes only with the GPU idle and the daemon restarted,
        as dcgm-exporter reads it)."""
        nv = self.nv
        try:
            if nv.nvmlDeviceGetMigMode(handle)[0] != nv.NVML_DEVICE_MIG_ENABLE:
                return []
            slots = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nv.NVMLError:  # not MIG-capable, or a driver without MIG
            return []
        found = []
        for index in range(slots):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
                uuid = nv.nvmlDeviceGetUUID(mig)
                found.append((uuid if isinstance(uuid, str) else uuid.decode(),
                              nv.nvmlDeviceGetGpuInstanceId(mig),
                              nv.nvmlDeviceGetComputeInstanceId(mig)))
            except nv.NVMLError:  # an empty slot
                continue
        return found

    def _xid_events(self, devices):
        nv = self.nv
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return None
        for device in devices:
            try:
                nv.nvmlDeviceRegisterEvents(device.handle, nv.nvmlEventTypeXidCriticalError,
                                            event_set)
            except nv.NVMLError as exc:
                log.info("GPU %d: no XID events (%s)", device.index, exc)
        return event_set

    def collect(self):
        if not self.devices:
            self._init()
        nv = self.nv
        gauges = {spec.name: new_gauge(spec) for spec, *_ in DEVICE_FIELDS + GPM_FIELDS}
        processes = new_gauge(m.GPU_PROCESS_MEMORY)
        process_util = [new_gauge(spec) for spec in m.GPU_PROCESS_UTILIZATION]
        self._drain_xid()
        xid = new_counter(m.GPU_XID_ERRORS)
        mig = new_gauge(m.GPU_MIG_DEVICE)
        for device in self.devices:
            labels = [str(device.index), device.uuid]
            for spec, read, scale in DEVICE_FIELDS:
                try:
                    gauges[spec.name].add_metric(labels, read(nv, device.handle) * scale)
                except nv.NVMLError_NotSupported:
                    continue
            self._process_memory(device, labels, processes)
            for mig_uuid, gpu_instance, compute_instance in device.mig:
                mig.add_metric(labels + [mig_uuid, str(gpu_instance), str(compute_instance)], 1)
            self._process_utilization(device, labels, process_util)
            for name, value in self._gpm(device).items():
                gauges[name].add_metric(labels, value)
            for code, count in sorted(device.xid_counts.items()):
                xid.add_metric(labels + [code], count)
        return [g for g in gauges.values() if g.samples] + [processes, xid] + \
            [g for g in process_util if g.samples] + ([mig] if mig.samples else [])

    def _process_memory(self, device: _Device, labels: list[str], family) -> None:
        """Each compute process's device memory; on a MIG device with its instances (the
        labels there only: a series outside MIG has none)."""
        nv = self.nv
        try:
            running = nv.nvmlDeviceGetComputeRunningProcesses(device.handle)
        except nv.NVMLError_NotSupported:
            return
        for proc in running:
            if proc.usedGpuMemory is None:
                continue
            series = dict(zip(m.GPU_PROCESS_MEMORY.labels, labels + [str(proc.pid)],
                              strict=False))
            instance = getattr(proc, "gpuInstanceId", NOT_MIG)
            if device.mig and instance != NOT_MIG:
                series.update(zip(m.MIG_LABELS, (str(instance), str(proc.computeInstanceId)),
                                  strict=True))
            family.add_sample(family.name, series, proc.usedGpuMemory)

    def _process_utilization(self, device: _Device, labels: list[str], gauges: list) -> None:
        """Each process's newest sample since the last cycle's newest (NVML hands back every
        sample still in its buffer unless told the last one seen: an idle process would
        keep showing its last figures); a process with none since has no series."""
        if not device.process_utilization:
            return
        nv = self.nv
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(device.handle, device.process_seen)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            device.process_utilization = False
            return
        except nv.NVMLError_NotFound:  # no process sampled yet
            return
        newest: dict[int, Any] = {}
        for sample in samples:
            if sample.pid not in newest or sample.timeStamp > newest[sample.pid].timeStamp:
                newest[sample.pid] = sample
        device.process_seen = max([device.process_seen,
                                   *(sample.timeStamp for sample in newest.values())])
        for pid, sample in sorted(newest.items()):
            for gauge, name in zip(gauges, PROCESS_UTILIZATION_FIELDS, strict=True):
                gauge.add_metric(labels + [str(pid)], getattr(sample, name) * 0.01)

    def _gpm(self, device: _Device) -> dict[str, float]:
        """GPM ratios from the previous sample and a fresh one (>= 100 ms apart)."""
        if not device.gpm:
            return {}
        nv = self.nv
        if device.gpm_sample is None:
            device.gpm_sample = nv.nvmlGpmSampleGet(device.handle, nv.nvmlGpmSampleAlloc())
            device.gpm_time = time.monotonic()
            time.sleep(MIN_GPM_GAP_SECONDS)  # first cycle only: make a pair right away
        if time.monotonic() - device.gpm_time < MIN_GPM_GAP_SECONDS:
            return device.gpm_values
        sample = nv.nvmlGpmSampleGet(device.handle, nv.nvmlGpmSampleAlloc())
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_FIELDS)
        request.sample1, request.sample2 = device.gpm_sample, sample
        for i, (_, metric_id, _) in enumerate(GPM_FIELDS):
            request.metrics[i].metricId = getattr(nv, metric_id)
        nv.nvmlGpmMetricsGet(request)
        nv.nvmlGpmSampleFree(device.gpm_sample)
        device.gpm_sample, device.gpm_time = sample, time.monotonic()
        values = {}
        for i, (spec, _, scale) in enumerate(GPM_FIELDS):
            metric = request.metrics[i]
            if metric.nvmlReturn == nv.NVML_SUCCESS:
                values[spec.name] = metric.value * scale
        device.gpm_values = values
        return values

    def _drain_xid(self) -> None:
        if self.event_set is None:
            return
        nv = self.nv
        by_address = {d.handle_address: d for d in self.devices}
        while True:
            try:
                event = nv.nvmlEventSetWait_v2(self.event_set, 0)
            except nv.NVMLError_Timeout:
                return
            except nv.NVMLError as exc:
                log.debug("XID wait: %s", exc)
                return
            if event.eventType & nv.nvmlEventTypeXidCriticalError:
                address = ctypes.cast(event.device, ctypes.c_void_p).value or 0
                device = by_address.get(address)
                if device is not None:
                    code = event.eventData
                    label = str(code) if 0 <= code <= MAX_XID_CODE else "other"
                    if label not in device.xid_counts and \
                            len(device.xid_counts) >= MAX_XID_CODES:
                        label = "other"
                    device.xid_counts[label] = device.xid_counts.get(label, 0) + 1
                    log.warning("GPU %d: XID %d", device.index, code)

    def close(self) -> None:
        if not self.devices:
            return
        nv = self.nv
        try:
            for device in self.devices:
                if device.gpm_sample is not None:
                    nv.nvmlGpmSampleFree(device.gpm_sample)
            if self.event_set is not None:
                nv.nvmlEventSetFree(self.event_set)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self.devices = []
