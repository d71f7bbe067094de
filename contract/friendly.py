"""The names a user queries (the CLI, the query API, the alert rules, the dashboards):
each a computation over the contract's families (metrics.py), in a unit of its own."""
from __future__ import annotations

from dataclasses import dataclass

from ac_observe.metrics import (
    ATTRIBUTION_LABELS,
    BATCH_SEQUENCES,
    COLLECTOR_UP,
    COUNTER,
    CUDA_GRAPH_LAUNCHES,
    CUDA_KERNEL_LAUNCHES,
    CUDA_MEMCPY_BYTES,
    CUDA_SYNC_WAIT,
    DECODE_STEP_GPU,
    DELIVERY_LAG,
    E2E_LATENCY,
    ENGINE_RESTARTS,
    ENGINE_STEPS,
    ENGINE_UP,
    EVENT_LOOP_LAG,
    FIRST_TEXT,
    FIRST_TOKEN_SENT,
    FRONTEND,
    GAUGE,
    GENERATION_TOKENS,
    GPU_DRAM_ACTIVE,
    GPU_MEMORY_USED,
    GPU_POWER,
    GPU_SM_ACTIVE,
    GPU_SM_CLOCK,
    GPU_SM_OCCUPANCY,
    GPU_TEMPERATURE,
    GPU_TENSOR_ACTIVE,
    GPU_UTILIZATION,
    GPU_XID_ERRORS,
    HISTOGRAM,
    INFERENCE_LATENCY,
    INTER_TOKEN_LATENCY,
    KERNEL_SAMPLED_STEPS,
    KERNEL_SECONDS,
    KIND_LABEL,
    KV_EVICTION_AGE,
    KV_EVICTIONS,
    KV_HIT_BLOCKS,
    KV_HIT_TOKENS,
    KV_MISS_BLOCKS,
    KV_QUERY_BLOCKS,
    KV_QUERY_TOKENS,
    KV_REPORTED_HIT,
    KV_USAGE,
    PID_LABEL,
    PREEMPTIONS,
    PREFILL_GPU,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUEST_DECODE,
    REQUEST_PREFILL,
    REQUESTS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    SKELETON_COMPLEXITY,
    SKELETON_REQUESTS,
    STREAM_UTILIZATION,
    UPSTREAM_FAILURES,
    UPSTREAM_LABEL,
    MetricSpec,
    exposed_labels,
)

GAUGE_KIND, HISTOGRAM_KIND, RATE_KIND, RATIO_KIND = "gauge", "histogram", "rate", "ratio"


@dataclass(frozen=True, slots=True)
class Friendly:
    """A name a user queries: how to compute it from a family, in which unit.

    kind: gauge (samples as they are), histogram (quantiles from bucket increases), rate
    (per second from a counter), ratio (increase of one counter over another's).
    `scale` turns the family's unit into the one the name promises. A ratio sums its
    series over the `summed` labels unless the query filters on one of them, and its
    denominator over every label the numerator lacks (a share per miss reason is over all
    of the engine's lookups, whatever their skeleton).
    """
    name: str
    kind: str
    source: MetricSpec
    unit: str
    scale: float
    help: str
    denominator: MetricSpec | None = None
    summed: tuple[str, ...] = ()
    # Names answering for an engine this one has no series of, in order (its `basis`):
    # a hit rate in blocks, else in tokens (vLLM V1), else the engine's own gauge.
    fallbacks: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        expected = {GAUGE_KIND: GAUGE, HISTOGRAM_KIND: HISTOGRAM, RATE_KIND: COUNTER,
                    RATIO_KIND: COUNTER}.get(self.kind)
        if expected is None or self.source.type != expected:
            raise ValueError(f"{self.name}: a {self.kind} reads a {expected}, "
                             f"not {self.source.name} ({self.source.type})")
        if (self.kind == RATIO_KIND) != (self.denominator is not None):
            raise ValueError(f"{self.name}: ratios and only ratios have a denominator")
        if self.summed and (self.kind != RATIO_KIND
                            or not set(self.summed) <= set(self.source.labels)):
            raise ValueError(f"{self.name}: only a ratio sums, over labels it has")

    def families(self) -> tuple[MetricSpec, ...]:
        return (self.source,) + ((self.denominator,) if self.denominator else ())

    def sample_names(self) -> set[str]:
        """The sample names an answer for this name reads (a histogram's bucket, sum and
        count; a counter's or gauge's own)."""
        if self.kind == HISTOGRAM_KIND:
            return {self.source.family + suffix for suffix in ("_bucket", "_sum", "_count")}
        return {spec.name for spec in self.families()}

    def statistic_unit(self, statistic: str) -> str:
        """The unit a statistic of this name is in: a share is a percentage, a histogram's
        rate observations per second, anything else the name's own unit."""
        if statistic.startswith("share_below"):
            return "%"
        if statistic == "rate" and self.kind == HISTOGRAM_KIND:
            return "1/s"
        return self.unit


FRIENDLY = {f.name: f for f in (
    Friendly("inference_latency_ns", HISTOGRAM_KIND, INFERENCE_LATENCY, "ns", 1e9,
             "Time to first token (arrival at the server to first token ready)."),
    Friendly("queue_time_ns", HISTOGRAM_KIND, QUEUE_TIME, "ns", 1e9,
             "Engine queue to first scheduled."),
    Friendly("frontend_ns", HISTOGRAM_KIND, FRONTEND, "ns", 1e9,
             "Arrival to the engine's queue (HTTP, validation, tokenization)."),
    Friendly("time_to_first_text_ns", HISTOGRAM_KIND, FIRST_TEXT, "ns", 1e9,
             "Arrival to the first visible text."),
    Friendly("first_token_sent_ns", HISTOGRAM_KIND, FIRST_TOKEN_SENT, "ns", 1e9,
             "Time to first token as it leaves the server: arrival to the first content "
             "bytes of a stream handed to the socket."),
    Friendly("delivery_lag_ns", HISTOGRAM_KIND, DELIVERY_LAG, "ns", 1e9,
             "First text ready to its bytes handed to the socket (the API server's share "
             "of time to first token)."),
    Friendly("event_loop_lag_ms", HISTOGRAM_KIND, EVENT_LOOP_LAG, "ms", 1e3,
             "How late the engine's API event loop ran a 100 ms timer (sampled)."),
    Friendly("e2e_latency_ms", HISTOGRAM_KIND, E2E_LATENCY, "ms", 1e3, "Arrival to finish."),
    Friendly("inter_token_latency_ms", HISTOGRAM_KIND, INTER_TOKEN_LATENCY, "ms", 1e3,
             "Time between output tokens."),
    Friendly("prefill_gpu_ms", HISTOGRAM_KIND, PREFILL_GPU, "ms", 1e3,
             "Device time of a prefill step."),
    Friendly("decode_step_gpu_ms", HISTOGRAM_KIND, DECODE_STEP_GPU, "ms", 1e3,
             "Device time of a decode step."),
    Friendly("skeleton_complexity", HISTOGRAM_KIND, SKELETON_COMPLEXITY, "levels", 1.0,
             "Prompt skeleton depth."),
    Friendly("batch_sequences", HISTOGRAM_KIND, BATCH_SEQUENCES, "seqs", 1.0,
             "Sequences in a model step, per lane and phase (--labels phase=prefill|decode): "
             "the mean is sequences per step (the bundled engine; vLLM and SGLang export "
             "no such figure)."),
    Friendly("kv_cache_hit_rate", RATIO_KIND, KV_HIT_BLOCKS, "%", 100.0,
             "Prefix-cache hits over lookups, in full blocks (per prompt skeleton with "
             "--labels skeleton=ID).", KV_QUERY_BLOCKS, ("skeleton",),
             (("tokens", "kv_cache_token_hit_rate"), ("gauge", "kv_cache_reported_hit_rate"))),
    Friendly("kv_cache_reported_hit_rate", GAUGE_KIND, KV_REPORTED_HIT, "%", 100.0,
             "Prefix-cache hit rate as the engine reports it (a gauge: vLLM V0, SGLang)."),
    Friendly("request_prefill_ms", HISTOGRAM_KIND, REQUEST_PREFILL, "ms", 1e3,
             "Time a request spent in its prefill phase: first scheduled to first token."),
    Friendly("request_decode_ms", HISTOGRAM_KIND, REQUEST_DECODE, "ms", 1e3,
             "Time a request spent in its decode phase: first token to finish."),
    Friendly("kv_cache_token_hit_rate", RATIO_KIND, KV_HIT_TOKENS, "%", 100.0,
             "Prompt tokens served from the prefix cache over prompt tokens (per prompt "
             "skeleton with --labels skeleton=ID).", KV_QUERY_TOKENS, ("skeleton",)),
    Friendly("kv_cache_miss_reasons", RATIO_KIND, KV_MISS_BLOCKS, "%", 100.0,
             "Share of looked-up blocks that missed, per reason: evicted (cache too small), "
             "cold (new traffic), diverged (the prompt's prefix changed).", KV_QUERY_BLOCKS),
    Friendly("kv_cache_eviction_age_s", HISTOGRAM_KIND, KV_EVICTION_AGE, "s", 1.0,
             "How long an evicted block had been unused when it was evicted."),
    Friendly("kernel_time_ms", HISTOGRAM_KIND, KERNEL_SECONDS, "ms", 1e3,
             "Device time of each kernel class (attention, gemm, norm, rope, activation, "
             "sampling, memcpy, other) in a sampled step, per lane and phase."),
    Friendly("kernel_sampled_fraction", RATIO_KIND, KERNEL_SAMPLED_STEPS, "%", 100.0,
             "Steps run under the profiler over all steps, per lane (per phase with "
             "--labels phase=prefill|decode).", ENGINE_STEPS, ("phase",)),
    Friendly("kv_cache_usage", GAUGE_KIND, KV_USAGE, "%", 100.0, "KV blocks held by requests."),
    Friendly("cuda_stream_utilization", GAUGE_KIND, STREAM_UTILIZATION, "%", 100.0,
             "Busy fraction of each lane's stream."),
    Friendly("requests_per_second", RATE_KIND, REQUESTS, "req/s", 1.0,
             "Finished requests per second, by status."),
    Friendly("generation_tokens_per_second", RATE_KIND, GENERATION_TOKENS, "tok/s", 1.0,
             "Generated tokens per second."),
    Friendly("prompt_tokens_per_second", RATE_KIND, PROMPT_TOKENS, "tok/s", 1.0,
             "Prompt tokens admitted per second."),
    Friendly("preemptions_per_second", RATE_KIND, PREEMPTIONS, "1/s", 1.0,
             "Requests preempted per second."),
    Friendly("kv_cache_eviction_rate", RATE_KIND, KV_EVICTIONS, "blocks/s", 1.0,
             "Cached blocks evicted per second."),
    Friendly("skeleton_request_rate", RATE_KIND, SKELETON_REQUESTS, "req/s", 1.0,
             "Requests per second per prompt skeleton."),
    Friendly("upstream_failure_rate", RATE_KIND, UPSTREAM_FAILURES, "req/s", 1.0,
             "Requests a gateway's upstream failed per second, by reason (unreachable, "
             "connect_timeout, tls, pool_full, read_timeout, bad_response, upstream_5xx, "
             "error_event, malformed_sse)."),
    Friendly("engine_restart_rate", RATE_KIND, ENGINE_RESTARTS, "1/s", 1.0,
             "New engine processes taking over an engine's telemetry, per second."),
    Friendly("gpu_xid_error_rate", RATE_KIND, GPU_XID_ERRORS, "1/s", 1.0,
             "XID errors per second (NVML)."),
    Friendly("requests_running", GAUGE_KIND, REQUESTS_RUNNING, "requests", 1.0,
             "Requests holding KV blocks."),
    Friendly("requests_waiting", GAUGE_KIND, REQUESTS_WAITING, "requests", 1.0,
             "Requests waiting for admission."),
    Friendly("gpu_utilization", GAUGE_KIND, GPU_UTILIZATION, "%", 100.0,
             "GPU busy fraction (NVML)."),
    Friendly("gpu_memory_used_bytes", GAUGE_KIND, GPU_MEMORY_USED, "B", 1.0,
             "Device memory in use."),
    Friendly("gpu_power_watts", GAUGE_KIND, GPU_POWER, "W", 1.0, "Board power."),
    Friendly("gpu_temperature_celsius", GAUGE_KIND, GPU_TEMPERATURE, "°C", 1.0,
             "GPU temperature."),
    Friendly("gpu_sm_clock_hertz", GAUGE_KIND, GPU_SM_CLOCK, "Hz", 1.0, "SM clock."),
    Friendly("gpu_sm_occupancy", GAUGE_KIND, GPU_SM_OCCUPANCY, "%", 100.0,
             "SM occupancy (GPM, Hopper+)."),
    Friendly("gpu_sm_active", GAUGE_KIND, GPU_SM_ACTIVE, "%", 100.0,
             "SM active (GPM, Hopper+)."),
    Friendly("gpu_tensor_active", GAUGE_KIND, GPU_TENSOR_ACTIVE, "%", 100.0,
             "Tensor cores active (GPM, Hopper+)."),
    Friendly("gpu_dram_active", GAUGE_KIND, GPU_DRAM_ACTIVE, "%", 100.0,
             "DRAM bandwidth used (GPM, Hopper+)."),
    Friendly("collector_up", GAUGE_KIND, COLLECTOR_UP, "", 1.0,
             "1 when the collector's last run succeeded, 0 when it is down."),
    Friendly("engine_up", GAUGE_KIND, ENGINE_UP, "", 1.0,
             "1 while an engine's heartbeat is fresh, 0 once it stopped (for an hour)."),
    Friendly("kernel_launch_rate", RATE_KIND, CUDA_KERNEL_LAUNCHES, "1/s", 1.0,
             "CUDA kernel launches per second, per process and stream (eBPF)."),
    Friendly("graph_launch_rate", RATE_KIND, CUDA_GRAPH_LAUNCHES, "1/s", 1.0,
             "CUDA graph launches per second, per process (eBPF)."),
    Friendly("sync_wait_ns", HISTOGRAM_KIND, CUDA_SYNC_WAIT, "ns", 1e9,
             "Host time blocked in CUDA synchronisation, per process and API (eBPF)."),
    Friendly("memcpy_bytes_rate", RATE_KIND, CUDA_MEMCPY_BYTES, "B/s", 1.0,
             "Bytes copied per second by direction (eBPF)."),
)}


@dataclass(frozen=True, slots=True)
class Part:
    """One additive part of a latency name's mean: a request's time is the sum of its
    parts, so the mean (a histogram's sum over its count) is the sum of their means."""
    name: str
    metric: str  # a histogram friendly name whose mean is the part


# The parts of each latency name's mean, in order (what they leave out is the rest): the
# daemon's explanation of an alert and the exported Prometheus rules' both read them.
_FRONT = Part("front-end", "frontend_ns")
_QUEUE = Part("queue", "queue_time_ns")
_PREFILL = Part("prefill", "request_prefill_ms")
_DECODE = Part("decode", "request_decode_ms")
LATENCY_PARTS = {
    "inference_latency_ns": (_FRONT, _QUEUE, _PREFILL),
    "time_to_first_text_ns": (_FRONT, _QUEUE, _PREFILL),
    "first_token_sent_ns": (_FRONT, _QUEUE, _PREFILL, Part("delivery", "delivery_lag_ns")),
    "e2e_latency_ms": (_FRONT, _QUEUE, _PREFILL, _DECODE),
    "inter_token_latency_ms": (Part("decode step", "decode_step_gpu_ms"),),
}
# How an explanation names a rule's metric.
TITLES = {"inference_latency_ns": "TTFT", "time_to_first_text_ns": "time to first text",
          "first_token_sent_ns": "TTFT at the socket", "e2e_latency_ms": "e2e latency",
          "inter_token_latency_ms": "inter-token latency",
          "kv_cache_hit_rate": "KV hit rate", "kv_cache_token_hit_rate": "KV token hit rate"}


def query_labels(friendly: Friendly) -> tuple[str, ...]:
    """The labels a query of this name may filter on: its series' exposed ones, the pid a
    discovered vLLM's or SGLang's series carry, and an engine family's `upstream` (a
    gateway's series carry it, others match none)."""
    labels = exposed_labels(friendly.source)
    if KIND_LABEL in labels and PID_LABEL not in labels:
        labels += (PID_LABEL,) + ATTRIBUTION_LABELS
    return labels + (UPSTREAM_LABEL,) if friendly.source.source == "engine" else labels


def watched_families() -> set[str]:
    """Families whose history the daemon keeps for queries."""
    return {spec.family for friendly in FRIENDLY.values() for spec in friendly.families()}
