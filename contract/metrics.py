"""The metric contract: every family ac-observe exports, and the names users query, as data.

One source of truth: the engine's telemetry writer, the collectors, the exporter, the
CLI's friendly names (and the dashboards and alert rules) all read these tables.

NOTE: a leaf module (standard library only). Names carry their unit and never contain a
colon; label sets are bounded. Prompt text, request ids and hashes of user content never
become label values.
"""
from __future__ import annotations

from dataclasses import dataclass

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

LOW_LATENCY, THROUGHPUT = LANES = ("low_latency", "throughput")
DEFAULT_LANE = THROUGHPUT
LANE_HEADER = "x-ac-stream"
REQUEST_STATUSES = ("ok", "error", "aborted", "rejected")
DEFAULT_ENGINE_PORT = 8000
DEFAULT_DAEMON_PORT = 9410  # dcgm-exporter already takes 9400
# Every Grafana annotation the daemon makes carries this tag; the dashboards filter on it.
GRAFANA_ANNOTATION_TAG = "ac-observe"
OTHER_SKELETON = "other"
NO_SKELETON = "none"  # requests sent as token ids carry no text, so no skeleton
# Why a looked-up prefix block missed (docs/engine.md, "Cache-miss attribution").
MISS_EVICTED, MISS_COLD, MISS_DIVERGED = MISS_REASONS = ("evicted", "cold", "diverged")
PHASE_PREFILL, PHASE_DECODE = PHASES = ("prefill", "decode")
# Why a gateway's upstream failed a request (docs/gateway.md, "Limits and failures"):
# unreachable (refused, no route, no such host), connect_timeout, tls (the handshake or
# the certificate), pool_full (every upstream connection busy), read_timeout, bad_response
# (no valid HTTP answer, or it broke off), upstream_5xx, error_event (an error event in a
# stream), malformed_sse (events that could not be read; the stream is relayed as it is).
UPSTREAM_FAILURE_REASONS = ("unreachable", "connect_timeout", "tls", "pool_full",
                            "read_timeout", "bad_response", "upstream_5xx", "error_event",
                            "malformed_sse")
# Sampled kernel time: every profiled op or kernel lands in one of these classes, decided
# by its name (docs/engine.md, "Sampled kernel time"); kernel names never become labels.
KERNEL_CLASSES = ("attention", "gemm", "norm", "rope", "activation", "sampling", "memcpy",
                  "other")

# Latency buckets in seconds: three per doubling (ratio 2^(1/3) ~ 1.26) from 1 ms to ~66 s,
# 0.25 and 0.5 ms below, 2 and 4 min above; 54 bounds with +Inf. A quantile interpolated
# inside a bucket is off by at most the bucket's width (26 % in the worst case) and, for
# latencies that spread over several buckets, by a few percent (tests/test_daemon_query.py:
# p50/p95/p99 within 10 % from 1 ms to 10 s).
LATENCY_BUCKETS_SECONDS = (0.00025, 0.0005) + tuple(
    float(f"{0.001 * 2 ** (k / 3):.6g}") for k in range(49)) + (120.0, 240.0)
STEP_BUCKETS_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32,
    0.64, 1.28, 2.56, 5.12,
)
# One class's device time in one sampled step: 5 us to ~5 s.
KERNEL_BUCKETS_SECONDS = (0.000005, 0.00001, 0.000025, 0.00005) + STEP_BUCKETS_SECONDS
# How late the API server's event loop ran a timer: 50 us up, then the latency buckets.
LOOP_LAG_BUCKETS_SECONDS = (0.00005, 0.0001) + LATENCY_BUCKETS_SECONDS
SKELETON_DEPTH_BUCKETS = tuple(float(d) for d in range(1, 17))
# Sequences in one model step: each power of two from 1 to 1024 (the mean, sum over
# count, is exact whatever the buckets; a quantile is off by at most a doubling).
BATCH_BUCKETS = tuple(float(2 ** k) for k in range(11))
# How long an unused cached block survived before eviction: 10 ms to a day.
AGE_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                       120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
# The eBPF collector's histograms are log2 in the kernel (a slot per power of two of the
# nanoseconds), so their buckets are those powers of two, 2^8 ns (256 ns) to 2^35 ns (34 s).
LOG2_FIRST_EXPONENT = 8
LOG2_BUCKETS_SECONDS = tuple(2.0 ** k / 1e9 for k in range(LOG2_FIRST_EXPONENT, 36))

# A base unit in a family's name is its last word (before _total for counters).
# (Ratios too, but for ac_cuda_stream_utilization, a name users already rely on.)
_BASE_UNITS = ("seconds", "bytes", "celsius", "watts", "hertz")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str                     # the exposed name (counters end in _total)
    type: str
    help: str
    labels: tuple[str, ...]
    source: str                   # engine | nvml | ebpf | daemon
    unit: str = ""                # seconds, bytes, ratio, ... ("" for plain counts)
    buckets: tuple[float, ...] = ()
    # A histogram of whole numbers with a bucket at each one (a skeleton's depth): its
    # quantiles are observed values, read off the buckets, never interpolated between.
    whole: bool = False

    def __post_init__(self) -> None:
        if ":" in self.name or not self.name.startswith("ac_"):
            raise ValueError(f"bad metric name {self.name!r}")
        if (self.type == HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms and only histograms carry buckets")
        if (self.type == COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters and only counters end in _total")
        if self.unit in _BASE_UNITS and not self.family.endswith("_" + self.unit):
            raise ValueError(f"{self.name}: the unit {self.unit!r} must end the name")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"{self.name}: buckets must be strictly increasing")
        if self.whole and (not self.buckets or self.buckets[0] % 1 or [
                b - self.buckets[0] for b in self.buckets] != list(range(len(self.buckets)))):
            raise ValueError(f"{self.name}: a histogram of whole numbers has a bucket at "
                             "each whole number")

    @property
    def family(self) -> str:
        """The family name as prometheus_client keeps it (a counter's without _total)."""
        return self.name[:-len("_total")] if self.type == COUNTER else self.name


ENGINE_LABELS = ("engine", "model")
STREAM_LABELS = ("engine", "model", "stream")
SKELETON_LABELS = ("engine", "model", "skeleton")
PHASE_LABELS = ("engine", "model", "stream", "phase")


def _engine(name, typ, help_text, labels=ENGINE_LABELS, unit="", buckets=(), whole=False):
    return MetricSpec(name, typ, help_text, labels, "engine", unit, buckets, whole)


def _latency(name, help_text):
    return _engine(name, HISTOGRAM, help_text, STREAM_LABELS, "seconds", LATENCY_BUCKETS_SECONDS)


def _step(name, help_text):
    return _engine(name, HISTOGRAM, help_text, STREAM_LABELS, "seconds", STEP_BUCKETS_SECONDS)


INFERENCE_LATENCY = _latency("ac_inference_latency_seconds",
                             "Request arrival at the server to first token ready (time to "
                             "first token).")
QUEUE_TIME = _latency("ac_queue_time_seconds",
                      "Entry in the engine's waiting queue to first scheduled.")
FRONTEND = _latency("ac_frontend_seconds",
                    "Request arrival at the server to its entry in the engine's queue "
                    "(HTTP, validation, tokenization).")
FIRST_TEXT = _latency("ac_time_to_first_text_seconds",
                      "Request arrival to the first non-empty text sent (later than the first "
                      "token when its bytes do not yet form a character).")
FIRST_TOKEN_SENT = _latency("ac_first_token_sent_seconds",
                            "Request arrival to the first content bytes of a streamed answer "
                            "handed to the socket (time to first token at the server's edge).")
DELIVERY_LAG = _latency("ac_delivery_lag_seconds",
                        "First text ready on the engine thread to its bytes handed to the "
                        "socket: the event loop's turn, serialisation and the write "
                        "(streamed answers).")
EVENT_LOOP_LAG = _engine("ac_event_loop_lag_seconds", HISTOGRAM,
                         "How late the API server's event loop ran a timer due every 100 ms "
                         "(sampled): a saturated API server shows here.", ENGINE_LABELS,
                         "seconds", LOOP_LAG_BUCKETS_SECONDS)
PREFILL_GPU = _step("ac_prefill_gpu_seconds",
                    "Device time of one prefill step (CUDA events; host clock on CPU).")
DECODE_STEP_GPU = _step("ac_decode_step_gpu_seconds",
                        "Device time of one decode step (CUDA events; host clock on CPU).")
INTER_TOKEN_LATENCY = _latency("ac_inter_token_latency_seconds",
                               "Time between two consecutive output tokens of a request.")
E2E_LATENCY = _latency("ac_e2e_latency_seconds", "Request arrival to finish.")
REQUESTS = _engine("ac_requests_total", COUNTER, "Finished requests by outcome.",
                   STREAM_LABELS + ("status",), "requests")
PROMPT_TOKENS = _engine("ac_prompt_tokens_total", COUNTER,
                        "Prompt tokens of admitted requests.", unit="tokens")
GENERATION_TOKENS = _engine("ac_generation_tokens_total", COUNTER, "Generated tokens.",
                            unit="tokens")
KV_QUERY_BLOCKS = _engine("ac_kv_cache_query_blocks_total", COUNTER,
                          "Full prompt blocks looked up in the prefix cache (recompute "
                          "excluded), by prompt skeleton.", SKELETON_LABELS, "blocks")
KV_HIT_BLOCKS = _engine("ac_kv_cache_hit_blocks_total", COUNTER,
                        "Full prompt blocks found in the prefix cache (recompute excluded), "
                        "by prompt skeleton.", SKELETON_LABELS, "blocks")
KV_QUERY_TOKENS = _engine("ac_kv_cache_query_tokens_total", COUNTER,
                          "Prompt tokens looked up in the prefix cache (recompute excluded), "
                          "by prompt skeleton.", SKELETON_LABELS, "tokens")
KV_HIT_TOKENS = _engine("ac_kv_cache_hit_tokens_total", COUNTER,
                        "Prompt tokens found in the prefix cache (recompute excluded), by "
                        "prompt skeleton.", SKELETON_LABELS, "tokens")
KV_MISS_BLOCKS = _engine("ac_kv_cache_miss_blocks_total", COUNTER,
                         "Looked-up prompt blocks that missed, by why: evicted (cached before "
                         "and reclaimed), cold (never seen, nothing earlier in the prompt hit), "
                         "diverged (never seen after earlier blocks of the prompt hit).",
                         ENGINE_LABELS + ("reason",), "blocks")
KV_MISS_TOKENS = _engine("ac_kv_cache_miss_tokens_total", COUNTER,
                         "Prompt tokens in looked-up blocks that missed, by why.",
                         ENGINE_LABELS + ("reason",), "tokens")
KV_EVICTION_AGE = _engine("ac_kv_cache_eviction_age_seconds", HISTOGRAM,
                          "How long a cached block had been unused (no request holding it) "
                          "when it was evicted.", ENGINE_LABELS, "seconds", AGE_BUCKETS_SECONDS)
KV_REPORTED_HIT = _engine("ac_kv_cache_reported_hit_ratio", GAUGE,
                          "Prefix-cache hit rate as an engine reports it, a gauge with no "
                          "counts behind it (vLLM V0's gpu_prefix_cache_hit_rate, SGLang's "
                          "cache_hit_rate); engines with lookup counters leave it out.",
                          unit="ratio")
REQUEST_PREFILL = _latency("ac_request_prefill_seconds",
                           "Time a request spent in its prefill phase: first scheduled to "
                           "first token (vLLM's request_prefill_time_seconds; not the device "
                           "time of one step). Front-end + queue + prefill = TTFT.")
REQUEST_DECODE = _latency("ac_request_decode_seconds",
                          "Time a request spent in its decode phase: first token to finish "
                          "(vLLM's request_decode_time_seconds).")
KV_USAGE = _engine("ac_kv_cache_usage_ratio", GAUGE, "Fraction of KV blocks held by requests.",
                   unit="ratio")
KV_BLOCKS = _engine("ac_kv_cache_blocks", GAUGE, "KV blocks in the pool.", unit="blocks")
KV_EVICTIONS = _engine("ac_kv_cache_evictions_total", COUNTER,
                       "Cached blocks evicted to make room for new content.", unit="blocks")
PREEMPTIONS = _engine("ac_preemptions_total", COUNTER,
                      "Requests preempted (KV freed, recomputed later).", unit="requests")
REQUESTS_RUNNING = _engine("ac_requests_running", GAUGE, "Requests holding KV blocks.",
                           STREAM_LABELS, "requests")
REQUESTS_WAITING = _engine("ac_requests_waiting", GAUGE, "Requests waiting for admission.",
                           STREAM_LABELS, "requests")
SKELETON_COMPLEXITY = _engine("ac_skeleton_complexity", HISTOGRAM, "Prompt skeleton depth.",
                              ENGINE_LABELS, "levels", SKELETON_DEPTH_BUCKETS, whole=True)
SKELETON_REQUESTS = _engine("ac_skeleton_requests_total", COUNTER,
                            "Requests per prompt skeleton (top skeleton ids, the rest as "
                            "'other').", ("engine", "model", "skeleton"), "requests")
STREAM_BUSY = _engine("ac_cuda_stream_busy_seconds_total", COUNTER,
                      "Time with work executing on the lane's stream.", STREAM_LABELS,
                      "seconds")
ENGINE_STEPS = _engine("ac_engine_steps_total", COUNTER,
                      "Model steps run, by lane and phase (prefill or decode).", PHASE_LABELS,
                      "steps")
BATCH_SEQUENCES = _engine("ac_engine_batch_sequences", HISTOGRAM,
                          "Sequences in one model step (its batch size), by lane and phase: "
                          "one observation a step.", PHASE_LABELS, "sequences", BATCH_BUCKETS)
KERNEL_SAMPLED_STEPS = _engine("ac_kernel_sampled_steps_total", COUNTER,
                               "Steps run under the profiler for ac_kernel_seconds (their "
                               "share of ac_engine_steps_total is the sampled fraction).",
                               PHASE_LABELS, "steps")
KERNEL_SECONDS = _engine("ac_kernel_seconds", HISTOGRAM,
                         "Device time of one kernel class in one sampled step (CUDA kernel "
                         "time on a GPU, operator self time on CPU), by lane and phase.",
                         PHASE_LABELS + ("class",), "seconds", KERNEL_BUCKETS_SECONDS)
UPSTREAM_FAILURES = _engine("ac_gateway_upstream_failures_total", COUNTER,
                            "Requests a gateway's upstream failed, by reason (one reason a "
                            "request: the first failure), whatever the path.",
                            ENGINE_LABELS + ("reason",), "requests")

ENGINE_METRICS = (
    INFERENCE_LATENCY, FRONTEND, QUEUE_TIME, FIRST_TEXT, FIRST_TOKEN_SENT, DELIVERY_LAG,
    EVENT_LOOP_LAG, PREFILL_GPU, DECODE_STEP_GPU, INTER_TOKEN_LATENCY, E2E_LATENCY, REQUESTS,
    PROMPT_TOKENS, GENERATION_TOKENS,
    KV_QUERY_BLOCKS, KV_HIT_BLOCKS,
    KV_QUERY_TOKENS, KV_HIT_TOKENS, KV_MISS_BLOCKS, KV_MISS_TOKENS, KV_EVICTION_AGE, KV_USAGE,
    KV_BLOCKS, KV_EVICTIONS, PREEMPTIONS, REQUESTS_RUNNING, REQUESTS_WAITING,
    SKELETON_COMPLEXITY, SKELETON_REQUESTS, STREAM_BUSY, ENGINE_STEPS, BATCH_SEQUENCES,
    KERNEL_SAMPLED_STEPS, KERNEL_SECONDS, KV_REPORTED_HIT, REQUEST_PREFILL, REQUEST_DECODE,
    UPSTREAM_FAILURES,
)
# What a gateway (ac_observe.gateway) measures of the requests it relays: the client-side
# figures (its time to first token goes into both INFERENCE_LATENCY and FIRST_TOKEN_SENT,
# a gateway having no device-side figure), outcomes, usage tokens and skeletons.
GATEWAY_METRICS = (
    INFERENCE_LATENCY, FIRST_TOKEN_SENT, INTER_TOKEN_LATENCY, E2E_LATENCY, REQUESTS,
    PROMPT_TOKENS, GENERATION_TOKENS, SKELETON_COMPLEXITY, SKELETON_REQUESTS,
    UPSTREAM_FAILURES,
)
# What only a gateway writes: the bundled engine's writer leaves them out (a figure an
# engine does not have is missing, never a zero).
GATEWAY_ONLY_METRICS = (UPSTREAM_FAILURES,)
BUNDLED_ENGINE_METRICS = tuple(spec for spec in ENGINE_METRICS
                               if spec not in GATEWAY_ONLY_METRICS)
# Every engine series carries `kind` beside `engine` and `model`: which engine wrote it
# (the bundled one, through its files; vLLM and SGLang, scraped by collectors/scrape/), so
# a query may filter on it and a quantile never mixes two engines' bucket layouts. It is
# the daemon's label, added on export: the bundled engine's files never hold it.
KIND_LABEL = "kind"
# Every series the daemon exports and answers carries `node`, first: the node the daemon
# watches (`--node-name`, default the host name). The daemon adds it on export and in its
# answers, as Prometheus adds external labels; no collector writes it.
NODE_LABEL = "node"
# A scraped engine's server process, where the daemon knows it (one it discovered): its
# series carry `pid`, so NVML's and eBPF's per-process series (`pid` too) join them.
PID_LABEL = "pid"
KIND_AC_OBSERVE = "ac-observe"
KIND_VLLM, KIND_SGLANG = SCRAPED_KINDS = ("vllm", "sglang")
KIND_GATEWAY = "gateway"
ENGINE_KINDS = (KIND_AC_OBSERVE,) + SCRAPED_KINDS + (KIND_GATEWAY,)
# A gateway's series also carry `upstream`: the server it relays to (engine.json's
# `upstream`: the upstream's engine name when known, else its host:port).
UPSTREAM_LABEL = "upstream"
# The closed sets of values an engine may write under these labels (the engine declares
# them, the daemon refuses any other).
LABEL_VALUES = {"stream": LANES, "status": REQUEST_STATUSES, "reason": MISS_REASONS,
                "phase": PHASES, "class": KERNEL_CLASSES}
# A family whose label takes another closed set than LABEL_VALUES gives that label.
FAMILY_LABEL_VALUES = {(UPSTREAM_FAILURES.name, "reason"): UPSTREAM_FAILURE_REASONS}


def label_values(spec: MetricSpec, label: str) -> tuple[str, ...] | None:
    """The closed set of values `label` takes in `spec`'s series (None: not closed)."""
    return FAMILY_LABEL_VALUES.get((spec.name, label), LABEL_VALUES.get(label))

GPU_LABELS = ("gpu", "uuid")
# Per-process series (those with `pid`) get these on export, where the process's cgroup
# and the kubelet tell them (collectors/attribution/): its container's id (64 hex), its
# pod's UID, and with the kubelet's pod-resources socket the pod's namespace and name and
# the container's name. A process outside any container has none of them. An engine's
# series carry them too where the daemon knows its process (query_labels).
CONTAINER_ID_LABEL, POD_UID_LABEL = "container_id", "pod_uid"
POD_NAME_LABELS = ("namespace", "pod", "container")
ATTRIBUTION_LABELS = (CONTAINER_ID_LABEL, POD_UID_LABEL) + POD_NAME_LABELS


def _gpu(name, typ, help_text, unit, labels=GPU_LABELS):
    return MetricSpec(name, typ, help_text, labels, "nvml", unit)


GPU_UTILIZATION = _gpu("ac_gpu_utilization_ratio", GAUGE, "GPU busy fraction (NVML).", "ratio")
GPU_MEMORY_USED = _gpu("ac_gpu_memory_used_bytes", GAUGE, "Device memory in use.", "bytes")
GPU_MEMORY_TOTAL = _gpu("ac_gpu_memory_total_bytes", GAUGE, "Device memory installed.", "bytes")
GPU_POWER = _gpu("ac_gpu_power_watts", GAUGE, "Board power draw.", "watts")
GPU_TEMPERATURE = _gpu("ac_gpu_temperature_celsius", GAUGE, "GPU die temperature.", "celsius")
GPU_SM_CLOCK = _gpu("ac_gpu_sm_clock_hertz", GAUGE, "SM clock.", "hertz")
# A MIG device: its GPU instance and compute instance, on a process's series there too
# (`uuid` stays the physical GPU's; ac_gpu_mig_device_info names the MIG device's UUID).
MIG_LABELS = ("gpu_instance", "compute_instance")
GPU_MIG_DEVICE = _gpu("ac_gpu_mig_device_info", GAUGE, "1 for each MIG device of a GPU in "
                      "MIG mode, by GPU instance and compute instance.", "",
                      GPU_LABELS + ("mig_uuid",) + MIG_LABELS)
GPU_PROCESS_MEMORY = _gpu("ac_gpu_process_memory_bytes", GAUGE,
                          "Device memory used by a process (on a MIG device: with its GPU "
                          "and compute instance).", "bytes", GPU_LABELS + ("pid",) + MIG_LABELS)
# nvmlDeviceGetProcessUtilization: each process's share of the GPU over NVML's last
# sampling period, by engine (SM, memory controller, encoder, decoder).
GPU_PROCESS_UTILIZATION = tuple(
    _gpu(f"ac_gpu_process_{unit}_utilization_ratio", GAUGE,
         f"Fraction of the last NVML sample period the process kept the GPU's {what} busy.",
         "ratio", GPU_LABELS + ("pid",))
    for unit, what in (("sm", "SMs"), ("memory", "memory controller"),
                       ("encoder", "video encoder"), ("decoder", "video decoder")))
GPU_SM_OCCUPANCY = _gpu("ac_gpu_sm_occupancy_ratio", GAUGE, "SM occupancy (GPM).", "ratio")
GPU_SM_ACTIVE = _gpu("ac_gpu_sm_active_ratio", GAUGE, "SM active (GPM).", "ratio")
GPU_TENSOR_ACTIVE = _gpu("ac_gpu_tensor_active_ratio", GAUGE, "Tensor core active (GPM).",
                         "ratio")
GPU_DRAM_ACTIVE = _gpu("ac_gpu_dram_active_ratio", GAUGE, "DRAM active (GPM).", "ratio")
GPU_XID_ERRORS = _gpu("ac_gpu_xid_errors_total", COUNTER,
                      "XID errors seen since the daemon started, by XID code (a GPU with none "
                      "has no series).", "errors", GPU_LABELS + ("xid",))

NVML_METRICS = (
    GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_POWER, GPU_TEMPERATURE,
    GPU_SM_CLOCK, GPU_PROCESS_MEMORY, GPU_SM_OCCUPANCY, GPU_SM_ACTIVE, GPU_TENSOR_ACTIVE,
    GPU_DRAM_ACTIVE, GPU_XID_ERRORS, *GPU_PROCESS_UTILIZATION, GPU_MIG_DEVICE,
)
GPU_PROCESS_FAMILIES = {spec.family for spec in (GPU_PROCESS_MEMORY, *GPU_PROCESS_UTILIZATION)}

PROC_LABELS = ("pid", "comm")


def _ebpf(name, typ, help_text, labels, unit, buckets=()):
    return MetricSpec(name, typ, help_text, PROC_LABELS + labels, "ebpf", unit, buckets)


CUDA_KERNEL_LAUNCHES = _ebpf("ac_cuda_kernel_launches_total", COUNTER, "CUDA kernel launches.",
                             ("stream",), "launches")
CUDA_GRAPH_LAUNCHES = _ebpf("ac_cuda_graph_launches_total", COUNTER, "CUDA graph launches.",
                            (), "launches")
CUDA_LAUNCH_CALL = _ebpf("ac_cuda_launch_call_seconds", HISTOGRAM,
                         "Host time inside a kernel or graph launch call.", (), "seconds",
                         LOG2_BUCKETS_SECONDS)
CUDA_SYNC_WAIT = _ebpf("ac_cuda_sync_wait_seconds", HISTOGRAM,
                       "Host time blocked in a CUDA stream, event or device synchronisation.",
                       ("api",), "seconds", LOG2_BUCKETS_SECONDS)
CUDA_MEMCPY_BYTES = _ebpf("ac_cuda_memcpy_bytes_total", COUNTER,
                          "Bytes copied by cuMemcpy*/cudaMemcpy* by direction.",
                          ("direction",), "bytes")

EBPF_MAP_ENTRIES = _ebpf("ac_ebpf_map_entries", GAUGE,
                         "Entries the eBPF collector's BPF maps hold for the process (its "
                         "counts, histogram slots and sums, calls in flight), read from the "
                         "kernel after the entries of exited processes are deleted.", (),
                         "entries")

EBPF_METRICS = (CUDA_KERNEL_LAUNCHES, CUDA_GRAPH_LAUNCHES, CUDA_LAUNCH_CALL, CUDA_SYNC_WAIT,
                CUDA_MEMCPY_BYTES, EBPF_MAP_ENTRIES)


def _daemon(name, typ, help_text, labels, unit=""):
    return MetricSpec(name, typ, help_text, labels, "daemon", unit)


STREAM_UTILIZATION = _daemon("ac_cuda_stream_utilization", GAUGE,
                             "Busy fraction of the lane's stream over the last collection "
                             "interval.", STREAM_LABELS + ("kind",), "ratio")
COLLECTOR_UP = _daemon("ac_collector_up", GAUGE, "1 when the collector's last run succeeded.",
                       ("collector",))
COLLECTOR_DURATION = _daemon("ac_collector_duration_seconds", GAUGE,
                             "Duration of the collector's last run.", ("collector",), "seconds")
COLLECTOR_ERRORS = _daemon("ac_collector_errors_total", COUNTER, "Failed collector runs.",
                           ("collector",), "errors")
ALERTS_FIRING = _daemon("ac_alerts_firing", GAUGE, "Drift alerts firing.", ("rule", "severity"),
                        "alerts")
WEBHOOK_DELIVERIES = _daemon("ac_webhook_deliveries_total", COUNTER,
                             "Webhook delivery attempts by outcome (delivered, retried, "
                             "failed: given up at max age, disabled: the receiver said 410) "
                             "since the daemon started.", ("receiver", "outcome"),
                             "deliveries")
WEBHOOK_QUEUE_DEPTH = _daemon("ac_webhook_queue_depth", GAUGE,
                              "Deliveries waiting in the webhook outbox.", ("receiver",),
                              "deliveries")
WEBHOOK_OLDEST_PENDING = _daemon("ac_webhook_oldest_pending_seconds", GAUGE,
                                 "Age of the oldest delivery waiting in the outbox.",
                                 ("receiver",), "seconds")
BUILD_INFO = _daemon("ac_build_info", GAUGE, "ac-observe build.", ("version",))
ENGINE_RESTARTS = _daemon("ac_engine_restarts_total", COUNTER,
                          "A new engine process taking over an engine's telemetry directory, "
                          "as the daemon saw it.", ("engine", "kind"), "restarts")
ENGINE_UP = _daemon("ac_engine_up", GAUGE,
                    "1 while the engine's heartbeat is fresh, 0 once it is stale; a gone "
                    "engine stays at 0 for an hour after its last heartbeat; a scraped "
                    "one (vLLM, SGLang) is 1 while its /metrics answers.",
                    ("engine", "model", "kind"))
# The join table for per-process series: a discovered server's own pid and its
# descendants' (vLLM V1 runs the model in EngineCore and worker processes, SGLang in its
# scheduler), so NVML's and eBPF's series, which carry the GPU process's pid, find it.
ENGINE_PROCESS = _daemon("ac_engine_process", GAUGE,
                         "1 for each process of a discovered vLLM or SGLang server: the "
                         "server's (role server) and its descendants' (role child), by pid.",
                         ("engine", "kind", "pid", "role"))
# As Prometheus and Alertmanager name theirs: 1 at start and after each reload of the
# alerting file that took (SIGHUP, POST /-/reload), 0 after one that did not.
CONFIG_RELOAD_SUCCESSFUL = _daemon("ac_config_last_reload_successful", GAUGE,
                                   "1 if the last reload of the configuration (the alerting "
                                   "file, the token file) took, 0 if it kept the previous "
                                   "one.", ())
CONFIG_RELOAD_SUCCESS_TIME = _daemon("ac_config_last_reload_success_timestamp_seconds", GAUGE,
                                     "When the configuration was last loaded successfully "
                                     "(Unix time).", (), "seconds")
SERIES = _daemon("ac_daemon_series", GAUGE,
                 "Series the collectors returned that the daemon exports and keeps in its "
                 "windows (at most --max-series).", (), "series")
SERIES_REFUSED = _daemon("ac_daemon_series_refused_total", COUNTER,
                         "New series refused past --max-series (neither exported nor "
                         "windowed); one refused for many cycles in a row counts once.", (),
                         "series")

# The daemon's HTTP server (daemon/http_server.py, daemon/http_api.py): reasons
# tls_handshake, plain_http_on_tls, client_cert_name, missing_credentials, bad_credentials.
HTTP_REFUSED = _daemon("ac_http_refused_total", COUNTER,
                       "Connections and requests the daemon's HTTP server refused, by reason "
                       "(a failed TLS handshake, plain HTTP on the TLS port, a client "
                       "certificate name not allowed, missing or wrong credentials).",
                       ("reason",), "refusals")

DAEMON_METRICS = (STREAM_UTILIZATION, COLLECTOR_UP, COLLECTOR_DURATION, COLLECTOR_ERRORS,
                  ALERTS_FIRING, WEBHOOK_DELIVERIES, WEBHOOK_QUEUE_DEPTH,
                  WEBHOOK_OLDEST_PENDING, BUILD_INFO,
                  ENGINE_RESTARTS, ENGINE_UP, ENGINE_PROCESS,
                  CONFIG_RELOAD_SUCCESSFUL, CONFIG_RELOAD_SUCCESS_TIME, SERIES,
                  SERIES_REFUSED, HTTP_REFUSED)

ALL_METRICS = ENGINE_METRICS + NVML_METRICS + EBPF_METRICS + DAEMON_METRICS
BY_NAME = {spec.name: spec for spec in ALL_METRICS}
BY_FAMILY = {spec.family: spec for spec in ALL_METRICS}


def exposed_labels(spec: MetricSpec) -> tuple[str, ...]:
    """The labels a family's series carry on export: the daemon's `node` first, then its
    own, an engine family's `kind` (the daemon adds both; every engine series of every
    kind has `kind`), and a per-process family's container and pod (ATTRIBUTION_LABELS,
    where the process has them)."""
    own = (NODE_LABEL,) + spec.labels
    labels = own + (KIND_LABEL,) if spec.source == "engine" else own
    return labels + ATTRIBUTION_LABELS if PID_LABEL in labels else labels
