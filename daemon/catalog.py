"""The metric contract: every series ac-observe exports, as data.

One source of truth: the engine's telemetry writer, the daemon's exporter, the
dashboards check and the CLI's friendly names all read this table. Torch-free.

NOTE: names carry their unit and never contain a colon; label sets are bounded.
Prompt text, request ids and hashes of user content never become label values.
"""
from __future__ import annotations

from dataclasses import dataclass

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

# Latency buckets in seconds: sub-millisecond CPU steps up to multi-minute queues.
LATENCY_BUCKETS_SECONDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25,
    0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)
STEP_BUCKETS_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32,
    0.64, 1.28, 2.56, 5.12,
)
SKELETON_DEPTH_BUCKETS = tuple(float(d) for d in range(1, 17))

ENGINE_LABELS = ("engine", "model")
STREAM_LABELS = ("engine", "model", "stream")
LANES = ("low_latency", "throughput")
REQUEST_STATUSES = ("ok", "error", "aborted", "rejected")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: str
    help: str
    labels: tuple[str, ...]
    source: str
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if ":" in self.name or not self.name.startswith("ac_"):
            raise ValueError(f"bad metric name {self.name!r}")
        if (self.type == HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms and only histograms carry buckets")


def _engine(name, typ, help_text, labels=ENGINE_LABELS, buckets=()):
    return MetricSpec(name, typ, help_text, labels, "engine", buckets)


ENGINE_METRICS = (
    _engine("ac_inference_latency_seconds", HISTOGRAM,
            "Request arrival to first token ready (time to first token).",
            STREAM_LABELS, LATENCY_BUCKETS_SECONDS),
    _engine("ac_queue_time_seconds", HISTOGRAM,
            "Request arrival to first scheduled.", STREAM_LABELS, LATENCY_BUCKETS_SECONDS),
    _engine("ac_prefill_gpu_seconds", HISTOGRAM,
            "Device time of one prefill step (CUDA events; host clock on CPU).",
            STREAM_LABELS, STEP_BUCKETS_SECONDS),
    _engine("ac_decode_step_gpu_seconds", HISTOGRAM,
            "Device time of one decode step (CUDA events; host clock on CPU).",
            STREAM_LABELS, STEP_BUCKETS_SECONDS),
    _engine("ac_inter_token_latency_seconds", HISTOGRAM,
            "Time between two consecutive output tokens of a request.",
            STREAM_LABELS, LATENCY_BUCKETS_SECONDS),
    _engine("ac_e2e_latency_seconds", HISTOGRAM,
            "Request arrival to finish.", STREAM_LABELS, LATENCY_BUCKETS_SECONDS),
    _engine("ac_requests_total", COUNTER, "Finished requests by outcome.",
            ("engine", "model", "stream", "status")),
    _engine("ac_prompt_tokens_total", COUNTER, "Prompt tokens of admitted requests."),
    _engine("ac_generation_tokens_total", COUNTER, "Generated tokens."),
    _engine("ac_kv_cache_query_blocks_total", COUNTER,
            "Full prompt blocks looked up in the prefix cache (recompute excluded)."),
    _engine("ac_kv_cache_hit_blocks_total", COUNTER,
            "Full prompt blocks found in the prefix cache (recompute excluded)."),
    _engine("ac_kv_cache_query_tokens_total", COUNTER,
            "Prompt tokens looked up in the prefix cache (recompute excluded)."),
    _engine("ac_kv_cache_hit_tokens_total", COUNTER,
            "Prompt tokens found in the prefix cache (recompute excluded)."),
    _engine("ac_kv_cache_usage_ratio", GAUGE, "Fraction of KV blocks held by requests."),
    _engine("ac_kv_cache_blocks", GAUGE, "KV blocks in the pool."),
    _engine("ac_kv_cache_evictions_total", COUNTER,
            "Cached blocks evicted to make room for new content."),
    _engine("ac_preemptions_total", COUNTER, "Requests preempted (KV freed, recomputed later)."),
    _engine("ac_requests_running", GAUGE, "Requests holding KV blocks.", STREAM_LABELS),
    _engine("ac_requests_waiting", GAUGE, "Requests waiting for admission.", STREAM_LABELS),
    _engine("ac_skeleton_complexity", HISTOGRAM, "Prompt skeleton depth.",
            ENGINE_LABELS, SKELETON_DEPTH_BUCKETS),
    _engine("ac_skeleton_requests_total", COUNTER,
            "Requests per prompt skeleton (top skeleton ids, the rest as 'other').",
            ("engine", "model", "skeleton")),
    _engine("ac_cuda_stream_busy_seconds_total", COUNTER,
            "Time with work executing on the lane's stream.", STREAM_LABELS),
)

GPU_LABELS = ("gpu", "uuid")
NVML_METRICS = tuple(
    MetricSpec(name, typ, help_text, labels, "nvml")
    for name, typ, help_text, labels in (
        ("ac_gpu_utilization_ratio", GAUGE, "GPU busy fraction (NVML).", GPU_LABELS),
        ("ac_gpu_memory_used_bytes", GAUGE, "Device memory in use.", GPU_LABELS),
        ("ac_gpu_memory_total_bytes", GAUGE, "Device memory installed.", GPU_LABELS),
        ("ac_gpu_power_watts", GAUGE, "Board power draw.", GPU_LABELS),
        ("ac_gpu_temperature_celsius", GAUGE, "GPU die temperature.", GPU_LABELS),
        ("ac_gpu_sm_clock_hertz", GAUGE, "SM clock.", GPU_LABELS),
        ("ac_gpu_process_memory_bytes", GAUGE, "Device memory used by a process.",
         GPU_LABELS + ("pid",)),
        ("ac_gpu_sm_occupancy_ratio", GAUGE, "SM occupancy (GPM).", GPU_LABELS),
        ("ac_gpu_sm_active_ratio", GAUGE, "SM active (GPM).", GPU_LABELS),
        ("ac_gpu_tensor_active_ratio", GAUGE, "Tensor core active (GPM).", GPU_LABELS),
        ("ac_gpu_dram_active_ratio", GAUGE, "DRAM active (GPM).", GPU_LABELS),
        ("ac_gpu_xid_errors_total", COUNTER, "XID errors seen.", GPU_LABELS),
    )
)

PROC_LABELS = ("pid", "comm")
EBPF_METRICS = (
    MetricSpec("ac_cuda_kernel_launches_total", COUNTER, "CUDA kernel launches.",
               PROC_LABELS + ("stream",), "ebpf"),
    MetricSpec("ac_cuda_graph_launches_total", COUNTER, "CUDA graph launches.",
               PROC_LABELS, "ebpf"),
    MetricSpec("ac_cuda_launch_call_seconds", HISTOGRAM, "Host time inside a launch call.",
               PROC_LABELS, "ebpf", STEP_BUCKETS_SECONDS),
    MetricSpec("ac_cuda_sync_wait_seconds", HISTOGRAM, "Host time blocked in a CUDA sync.",
               PROC_LABELS + ("api",), "ebpf", LATENCY_BUCKETS_SECONDS),
    MetricSpec("ac_cuda_memcpy_bytes_total", COUNTER, "Bytes copied by cudaMemcpy*.",
               PROC_LABELS + ("direction",), "ebpf"),
)

DAEMON_METRICS = (
    MetricSpec("ac_cuda_stream_utilization", GAUGE,
               "Busy fraction of the lane's stream over the last collection interval.",
               STREAM_LABELS, "daemon"),
    MetricSpec("ac_collector_up", GAUGE, "1 when the collector's last run succeeded.",
               ("collector",), "daemon"),
    MetricSpec("ac_collector_duration_seconds", GAUGE, "Duration of the collector's last run.",
               ("collector",), "daemon"),
    MetricSpec("ac_collector_errors_total", COUNTER, "Failed collector runs.",
               ("collector",), "daemon"),
    MetricSpec("ac_alerts_firing", GAUGE, "Drift alerts firing.", ("rule", "severity"),
               "daemon"),
    MetricSpec("ac_webhook_deliveries_total", COUNTER, "Webhook delivery attempts by outcome.",
               ("outcome",), "daemon"),
    MetricSpec("ac_webhook_queue_depth", GAUGE, "Alerts waiting in the webhook outbox.", (),
               "daemon"),
    MetricSpec("ac_build_info", GAUGE, "ac-observe build.", ("version",), "daemon"),
)

ALL_METRICS = ENGINE_METRICS + NVML_METRICS + EBPF_METRICS + DAEMON_METRICS
