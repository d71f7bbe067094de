"""The ac-observe dashboards' boards (Overview, KV cache & prompts, GPU & CUDA, Drift &
alerts): which panels, which queries, in the panel model of grafana.py. The Fleet board
is fleet.py's."""
from __future__ import annotations

from ac_observe import metrics as m
from ac_observe.dashboards import promql
from ac_observe.dashboards.grafana import (
    ENGINE,
    HOME_UID,
    RANGE,
    SPARSE,
    Board,
    Panel,
    gauge_by,
    heatmap_panel,
    hit_rate_by_basis,
    quantiles,
    rate_by,
    sel,
    stat,
    with_not_exported,
)
from ac_observe.friendly import FRIENDLY

LANE = ("engine", "stream")
ENGINE_KIND = ("engine", "kind")
# A per-process (eBPF) series' engine: the discovered server its pid belongs to.
BY_ENGINE_PROCESS = (f'on (node, pid) group_left (engine, kind) '
                     f'{m.ENGINE_PROCESS.name}{{node=~"$node", engine=~"$engine"}}')
GPU = ("gpu",)
POD = ("namespace", "pod", "pod_uid")  # a pod by name where the kubelet told it, else by UID


def overview() -> Board:
    return Board(HOME_UID, "ac-observe / Engine overview",
                 "Latency (time to first token from the engine's own timers, inter-token, "
                 "end to end), throughput, the queue and the two lanes, per engine.", [
        ("Now", [
            # The headline figures of the selected nodes together (Fleet tells them apart).
            Panel("Engines up, across nodes", [(f"sum({sel(m.ENGINE_UP)})", "up")], "short",
                  "stat", width=6, height=4),
            Panel("Requests / s, across nodes",
                  [(f"sum({rate_by(m.REQUESTS, ('engine',))})", "req/s")],
                  "reqps", "stat", width=6, height=4),
            Panel("TTFT p95 (worst engine across nodes)",
                  [(promql.statistic_expr(FRIENDLY["inference_latency_ns"], "p95", RANGE,
                                          by=(), regex=ENGINE), "p95")], "ns",
                  "stat", width=6, height=4),
            # Each engine on its basis (blocks, tokens, its gauge), the lowest shown, as
            # the TTFT stat shows the worst engine's.
            Panel("KV hit rate (lowest engine across nodes)",
                  [(f"min({hit_rate_by_basis(ENGINE_KIND)})", "hit rate")], "percent", "stat",
                  description="The lowest of the engines' prefix-cache hit rates, each on "
                              "its own basis: blocks where it counts them, else tokens, "
                              "else its own gauge (the KV board's legend says which).",
                  width=6, height=4),
        ]),
        ("Latency", [
            Panel("Time to first token (p50 / p95 / p99)",
                  quantiles("inference_latency_ns", LANE, "{{engine}} {{stream}}"), "ns",
                  description=m.INFERENCE_LATENCY.help),
            Panel("Inter-token latency (p50 / p95 / p99)",
                  quantiles("inter_token_latency_ms", LANE, "{{engine}} {{stream}}"), "ms",
                  description=m.INTER_TOKEN_LATENCY.help),
            Panel("End to end (p50 / p95 / p99)",
                  quantiles("e2e_latency_ms", LANE, "{{engine}} {{stream}}"), "ms",
                  description=m.E2E_LATENCY.help),
            Panel("Where the first token's time goes (p95)", [
                (stat("frontend_ns", "p95", LANE), "frontend {{engine}} {{stream}}"),
                (stat("queue_time_ns", "p95", LANE), "queue {{engine}} {{stream}}"),
                (stat("prefill_gpu_ms", "p95", LANE) + " * 1e6",
                 "prefill step {{engine}} {{stream}}"),
                (stat("delivery_lag_ns", "p95", LANE), "delivery {{engine}} {{stream}}"),
            ], "ns", description="Frontend (HTTP, validation, tokenization), the engine's "
                                 "queue, the prefill step's device time, and delivery: "
                                 "first text ready to its bytes handed to the socket."),
            Panel("Time to first token: engine vs leaving the server (p95)", [
                (stat("inference_latency_ns", "p95", LANE), "engine {{engine}} {{stream}}"),
                (stat("first_token_sent_ns", "p95", LANE), "sent {{engine}} {{stream}}"),
                (stat("event_loop_lag_ms", "p95", ("engine",)) + " * 1e6",
                 "event loop lag {{engine}}"),
            ], "ns", description=m.FIRST_TOKEN_SENT.help + " Beside it the engine's own "
                                 "TTFT and the API server's event loop lag: a gap that "
                                 "grows with the lag is a saturated API server."),
            Panel("Time to first token: client side (gateway) vs the engines' own (p95)", [
                (stat("first_token_sent_ns", "p95", ("engine",), match={"kind": "gateway"}),
                 "client side via {{engine}}"),
                (stat("inference_latency_ns", "p95", ("engine", "kind")),
                 "{{engine}} ({{kind}})"),
            ], "ns", description="An `ac-observe gateway`'s time to first token as its "
                                 "clients see it (kind gateway), beside each engine's own "
                                 "figure: the gap to its upstream is the upstream's HTTP, "
                                 "tokenisation and queue time."),
        ]),
        ("Throughput and queue", [
            Panel("Tokens / s", [
                (stat("generation_tokens_per_second", "mean", ("engine",)),
                 "generated {{engine}}"),
                (stat("prompt_tokens_per_second", "mean", ("engine",)), "prompt {{engine}}"),
            ], "short"),
            Panel("Requests / s by outcome",
                  [(rate_by(m.REQUESTS, ("engine", "stream", "status")),
                    "{{engine}} {{stream}} {{status}}")], "reqps"),
            Panel("Gateway: requests its upstream failed / s, by reason",
                  [(rate_by(m.UPSTREAM_FAILURES, ("engine", "upstream", "reason")),
                    "{{engine}} -> {{upstream}} {{reason}}")], "reqps",
                  description=m.UPSTREAM_FAILURES.help + " Reasons: docs/gateway.md, "
                              "\"Limits and failures\"."),
            Panel("Running and waiting, per lane", [
                (gauge_by(m.REQUESTS_RUNNING, LANE), "running {{engine}} {{stream}}"),
                (gauge_by(m.REQUESTS_WAITING, LANE), "waiting {{engine}} {{stream}}"),
            ], "short"),
            Panel("Lane stream utilisation", [
                (gauge_by(m.STREAM_UTILIZATION, LANE, "max") + " * 100",
                 "{{engine}} {{stream}}")], "percent",
                  description=m.STREAM_UTILIZATION.help),
            Panel("Steps / s by phase", [
                (rate_by(m.ENGINE_STEPS, ("engine", "stream", "phase")),
                 "{{engine}} {{stream}} {{phase}}")], "short"),
            Panel("Sequences per step (mean), by phase", [
                (stat("batch_sequences", "mean", ("engine", "stream", "phase")),
                 "{{engine}} {{stream}} {{phase}}")], "short",
                  description=m.BATCH_SEQUENCES.help + " The bundled engine's: vLLM and "
                              "SGLang export no sequences-per-step figure."),
            Panel("Decode step device time (p50 / p95 / p99)",
                  quantiles("decode_step_gpu_ms", LANE, "{{engine}} {{stream}}"), "ms",
                  description=m.DECODE_STEP_GPU.help),
        ]),
    ])


def kv_and_prompts() -> Board:
    return Board("ac-kv-cache", "ac-observe / KV cache & prompts",
                 "Prefix-cache hits and why blocks missed, KV usage, evictions and "
                 "preemptions; prompt skeleton complexity and the busiest skeletons.", [
        ("Prefix cache", [
            Panel("Prefix-cache hit rate (basis: blocks, tokens or the engine's gauge)", [
                (hit_rate_by_basis(ENGINE_KIND), "{{engine}} ({{basis}})"),
                # An engine that counts blocks counts tokens too: both, told apart.
                (f"{stat('kv_cache_token_hit_rate', 'mean', ENGINE_KIND)} and on "
                 f"(node, engine, kind) {stat('kv_cache_hit_rate', 'mean', ENGINE_KIND)}",
                 "{{engine}} (tokens)"),
            ], "percent", description=FRIENDLY["kv_cache_hit_rate"].help + " The legend "
                  "names each line's basis: blocks where the engine counts them (the "
                  "bundled engine), else tokens (vLLM V1), else the engine's own hit-rate "
                  "gauge (vLLM V0, SGLang)."),
            Panel("Why looked-up blocks missed (share of lookups)",
                  [(stat("kv_cache_miss_reasons", "mean", ("engine", "reason")),
                    "{{engine}} {{reason}}")], "percent",
                  description=m.KV_MISS_BLOCKS.help),
            Panel("KV usage", [(gauge_by(m.KV_USAGE, ("engine",), "max") + " * 100",
                                "{{engine}}")], "percent"),
            Panel("Evictions and preemptions / s", [
                (rate_by(m.KV_EVICTIONS, ("engine",)), "evicted blocks {{engine}}"),
                (rate_by(m.PREEMPTIONS, ("engine",)), "preempted requests {{engine}}"),
            ], "short"),
            Panel("Unused age of evicted blocks (p50 / p95)", [
                (stat("kv_cache_eviction_age_s", "p50", ("engine",), SPARSE), "p50 {{engine}}"),
                (stat("kv_cache_eviction_age_s", "p95", ("engine",), SPARSE), "p95 {{engine}}"),
            ], "s", description=m.KV_EVICTION_AGE.help),
            # The ten skeletons with the most block lookups, not the ten best hit rates.
            Panel("Hit rate of the busiest skeletons", [
                (f"{stat('kv_cache_hit_rate', 'mean', ('engine', 'skeleton'))} and on "
                 f"(node, engine, skeleton) topk by (node) (10, "
                 f"{rate_by(m.KV_QUERY_BLOCKS, ('engine', 'skeleton'))} > 0)",
                 "{{engine}} {{skeleton}}")], "percent"),
        ]),
        ("Prompts", [
            heatmap_panel("Skeleton complexity", m.SKELETON_COMPLEXITY, "short"),
            Panel("Mean skeleton complexity", [
                (stat("skeleton_complexity", "mean", ("engine",)), "{{engine}}")], "short"),
            Panel("Top skeletons (requests / s)", [
                (f"topk by (node) (10, "
                 f"{rate_by(m.SKELETON_REQUESTS, ('engine', 'skeleton'))})",
                 "{{engine}} {{skeleton}}")], "reqps", "table", width=24,
                  description=m.SKELETON_REQUESTS.help),
        ]),
    ])


def gpu_and_cuda() -> Board:
    return Board("ac-gpu-cuda", "ac-observe / GPU & CUDA",
                 "NVML and GPM state per GPU, the lanes' stream utilisation, sampled "
                 "kernel time, and CUDA driver activity from eBPF probes (launches per "
                 "stream, synchronisation waits, copies).", [
        ("GPU (NVML)", [
            Panel("GPU utilisation", [(gauge_by(m.GPU_UTILIZATION, GPU, "max") + " * 100",
                                       "gpu {{gpu}}")], "percent"),
            Panel("Memory used / installed", [
                (gauge_by(m.GPU_MEMORY_USED, GPU, "max"), "used gpu {{gpu}}"),
                (gauge_by(m.GPU_MEMORY_TOTAL, GPU, "max"), "installed gpu {{gpu}}"),
            ], "bytes"),
            Panel("Power and temperature", [
                (gauge_by(m.GPU_POWER, GPU, "max"), "W gpu {{gpu}}"),
                (gauge_by(m.GPU_TEMPERATURE, GPU, "max"), "°C gpu {{gpu}}"),
            ], "short"),
            Panel("SM clock", [(gauge_by(m.GPU_SM_CLOCK, GPU, "max"), "gpu {{gpu}}")],
                  "hertz"),
            Panel("Memory per process", [
                (gauge_by(m.GPU_PROCESS_MEMORY, ("gpu", "pid"), "max"),
                 "gpu {{gpu}} pid {{pid}}")], "bytes"),
            Panel("SM and memory-controller use per pod", [
                (gauge_by(m.GPU_PROCESS_UTILIZATION[0], POD, "sum") + " * 100",
                 "SM {{namespace}}/{{pod}} {{pod_uid}}"),
                (gauge_by(m.GPU_PROCESS_UTILIZATION[1], POD, "sum") + " * 100",
                 "memory {{namespace}}/{{pod}} {{pod_uid}}"),
            ], "percent", description="Each pod's processes' share of the GPU's SMs and memory "
                  "controller over NVML's last sample period (nvmlDeviceGetProcessUtilization), "
                  "summed per pod; a pod named by the kubelet's socket shows its namespace and "
                  "name, else its UID; processes outside any pod show as one blank entry."),
            Panel("Device memory per pod", [
                (gauge_by(m.GPU_PROCESS_MEMORY, POD, "sum"),
                 "{{namespace}}/{{pod}} {{pod_uid}}")], "bytes"),
            Panel("GPM: SM occupancy, SM / tensor / DRAM active", [
                (gauge_by(m.GPU_SM_OCCUPANCY, GPU, "max") + " * 100", "occupancy {{gpu}}"),
                (gauge_by(m.GPU_SM_ACTIVE, GPU, "max") + " * 100", "SM active {{gpu}}"),
                (gauge_by(m.GPU_TENSOR_ACTIVE, GPU, "max") + " * 100", "tensor {{gpu}}"),
                (gauge_by(m.GPU_DRAM_ACTIVE, GPU, "max") + " * 100", "DRAM {{gpu}}"),
            ], "percent", description="GPU performance metrics (Hopper and later)."),
        ]),
        ("Engine streams and kernels", [
            Panel("Lane stream utilisation", [
                (gauge_by(m.STREAM_UTILIZATION, LANE, "max") + " * 100",
                 "{{engine}} {{stream}}")], "percent"),
            Panel("Kernel time by class (p95 of a sampled step)", [
                (stat("kernel_time_ms", "p95", ("engine", "phase", "class"), SPARSE),
                 "{{engine}} {{phase}} {{class}}")], "ms",
                  description=m.KERNEL_SECONDS.help),
            Panel("Prefill and decode step device time (p95)", [
                (stat("prefill_gpu_ms", "p95", LANE), "prefill {{engine}} {{stream}}"),
                (stat("decode_step_gpu_ms", "p95", LANE), "decode {{engine}} {{stream}}"),
            ], "ms"),
            Panel("Sampled share of steps", [
                (stat("kernel_sampled_fraction", "mean", ("engine", "stream")),
                 "{{engine}} {{stream}}")], "percent",
                  description=m.KERNEL_SAMPLED_STEPS.help),
        ]),
        ("CUDA driver (eBPF)", [
            Panel("Kernel launches / s per stream", [
                (rate_by(m.CUDA_KERNEL_LAUNCHES, ("pid", "comm", "stream")),
                 "{{comm}} {{pid}} {{stream}}")], "short"),
            Panel("Graph launches / s", [
                (rate_by(m.CUDA_GRAPH_LAUNCHES, ("pid", "comm")), "{{comm}} {{pid}}")],
                  "short"),
            heatmap_panel("Synchronisation waits", m.CUDA_SYNC_WAIT, "s"),
            Panel("Sync wait p95 by API, launch call p95", [
                (stat("sync_wait_ns", "p95", ("pid", "comm", "api")),
                 "wait {{comm}} {{pid}} {{api}}"),
                (f"histogram_quantile(0.95, sum by (le, node, pid, comm) "
                 f"(rate({sel(m.CUDA_LAUNCH_CALL, '_bucket')}[{RANGE}]))) * 1e9",
                 "launch call {{comm}} {{pid}}"),
            ], "ns"),
            Panel("Copies / s by direction", [
                (rate_by(m.CUDA_MEMCPY_BYTES, ("pid", "comm", "direction")),
                 "{{comm}} {{pid}} {{direction}}")], "Bps"),
            # What stands in for a vLLM's or SGLang's missing stream utilisation: the
            # probes' view of its processes (server and children), by engine.
            Panel("vLLM / SGLang processes: kernel launches / s per stream", [
                (f"sum by (node, engine, kind, stream) (rate("
                 f"{sel(m.CUDA_KERNEL_LAUNCHES)}[{RANGE}]) * {BY_ENGINE_PROCESS})",
                 "{{engine}} {{stream}}")], "short",
                  description="eBPF's launches of every process of a discovered vLLM or "
                              "SGLang server (ac_engine_process), summed per engine."),
            Panel("vLLM / SGLang processes: sync wait p95", [
                (f"histogram_quantile(0.95, sum by (le, node, engine, kind, api) "
                 f"(rate({sel(m.CUDA_SYNC_WAIT, '_bucket')}[{RANGE}]) * {BY_ENGINE_PROCESS}))"
                 f" * 1e9", "{{engine}} {{api}}")], "ns",
                  description="Host time blocked in CUDA synchronisation by the processes "
                              "of a discovered vLLM or SGLang server (ac_engine_process)."),
        ]),
    ])


def drift_and_alerts(rules) -> Board:
    panels = []
    for rule in rules:
        friendly = FRIENDLY[rule.metric]
        window = promql.duration(rule.window_seconds)
        current = promql.statistic_expr(friendly, rule.statistic, window, rule.match,
                                        share_threshold=rule.share_threshold, regex=ENGINE)
        targets = [(current, f"{rule.statistic} {{{{engine}}}}")]
        if rule.comparison in ("above", "below"):
            targets.append((f"{current} * 0 + {promql.number(rule.threshold)}", "threshold"))
        else:
            targets.append((promql.baseline_expr(rule, regex=ENGINE), "baseline {{engine}}"))
        unit = {"ns": "ns", "ms": "ms", "s": "s", "%": "percent"}.get(promql.unit(rule),
                                                                       "short")
        panels.append(Panel(f"{rule.name}: {rule.metric} {rule.statistic} ({window})",
                            targets, unit, description=promql.describe(rule)))
    return Board("ac-drift", "ac-observe / Drift & alerts",
                 "Each shipped drift rule's statistic against its baseline, the alerts "
                 "firing (the daemon's and Prometheus'), and webhook delivery health.", [
        ("Drift rules", panels),
        ("Alerts and deliveries", [
            Panel("Alerts firing (daemon)", [
                (f"sum by (node, rule, severity) ({sel(m.ALERTS_FIRING)})",
                 "{{rule}} {{severity}}")], "short"),
            Panel("Alerts firing (Prometheus rules)", [
                ("count by (node, alertname, severity) (ALERTS{alertstate=\"firing\", "
                 f"node=~\"$node\", "
                 f"alertname=~\"{'|'.join(rule.name for rule in rules)}\"}})",
                 "{{alertname}} {{severity}}")], "short",
                  description="The same rules exported to Prometheus "
                              "(`ac-observe rules export`)."),
            Panel("Webhook deliveries / s by outcome", [
                (rate_by(m.WEBHOOK_DELIVERIES, ("receiver", "outcome")),
                 "{{receiver}} {{outcome}}")], "short"),
            Panel("Webhook outbox: depth and oldest pending", [
                (gauge_by(m.WEBHOOK_QUEUE_DEPTH, ("receiver",), "max"), "depth {{receiver}}"),
                (gauge_by(m.WEBHOOK_OLDEST_PENDING, ("receiver",), "max"),
                 "oldest s {{receiver}}"),
            ], "short"),
            Panel("Collectors up", [(gauge_by(m.COLLECTOR_UP, ("collector",), "max"),
                                     "{{node}} {{collector}}")], "short"),
            Panel("Engines up", [(gauge_by(m.ENGINE_UP, ("engine", "model"), "max"),
                                  "{{node}} {{engine}} {{model}}")], "short"),
        ]),
    ])


def engine_boards(rules=None) -> list[Board]:
    if rules is None:
        from ac_observe.daemon.alerting.rules import default_rules
        rules = default_rules()
    return [with_not_exported(overview()), with_not_exported(kv_and_prompts()),
            with_not_exported(gpu_and_cuda()), drift_and_alerts(rules)]
