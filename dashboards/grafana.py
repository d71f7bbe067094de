"""The Grafana dashboards, built from the metric contract with Grafana's own SDK
(grafana-foundation-sdk), and their provisioning.

Every query is made by `promql.statistic_expr` from a friendly name (the same definitions
the daemon's answers and the drift rules use) or names a family through the contract's
MetricSpec, so a renamed family changes the dashboards when they are regenerated, and
`tests/test_dashboards.py` fails if the committed JSON differs or if a query names a
family the contract lacks. Dashboards refer to the Prometheus datasource by its pinned
uid (DATASOURCE_UID), never by an import placeholder.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ac_observe import metrics as m
from ac_observe.collectors.scrape.table import KIND_TITLES, TARGETS
from ac_observe.dashboards import promql
from ac_observe.friendly import FRIENDLY

DATASOURCE_UID = "ac-prometheus"
HOME_UID = "ac-overview"
RANGE = "$__rate_interval"
# Every family follows the node variable, and those with an engine label the engine one.
ENGINE = {m.NODE_LABEL: "$node", "engine": "$engine"}
NODE = m.NODE_LABEL
# A panel whose title names nodes goes across them (a headline sum, a ranking of nodes).
ACROSS_NODES = re.compile(r"\bnodes\b", re.IGNORECASE)


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]      # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"            # timeseries | stat | heatmap | table
    description: str = ""
    width: int = 12
    height: int = 8
    repeat: str = ""                    # a copy of the panel per value of this variable
    no_value: str = ""                  # said in place of "No data"


@dataclass
class Board:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)


# Families observed now and then (a sampled step, an eviction) are read over a longer
# window, so a quiet minute draws a line, not a gap of 0 / 0.
SPARSE = "5m"


def per_node(by: tuple[str, ...]) -> tuple[str, ...]:
    """`by` with `node` first: nodes are told apart wherever a query groups (GPU 0 of two
    nodes is two lines)."""
    return by if NODE in by else (NODE, *by)


def stat(name: str, statistic: str, by: tuple[str, ...] | None = None, window: str = RANGE,
         **kw) -> str:
    return promql.statistic_expr(FRIENDLY[name], statistic, window,
                                 by=None if by is None else per_node(by), regex=ENGINE, **kw)


def quantiles(name: str, by: tuple[str, ...], legend: str) -> list[tuple[str, str]]:
    return [(stat(name, q, by), f"{q} {legend}") for q in ("p50", "p95", "p99")]


def sel(spec: m.MetricSpec, suffix: str = "") -> str:
    """A family's selector under the dashboard's node and engine filters."""
    if "engine" in spec.labels:
        return f'{spec.name}{suffix}{{node=~"$node", engine=~"$engine"}}'
    return f'{spec.name}{suffix}{{node=~"$node"}}'


def gauge_by(spec: m.MetricSpec, by: tuple[str, ...], how: str = "sum") -> str:
    return f"{how} by ({', '.join(per_node(by))}) ({sel(spec)})"


def rate_by(spec: m.MetricSpec, by: tuple[str, ...], suffix: str = "") -> str:
    return f"sum by ({', '.join(per_node(by))}) (rate({sel(spec, suffix)}[{RANGE}]))"


def heatmap(spec: m.MetricSpec) -> str:
    """Buckets summed over the selected nodes within one engine and kind (one layout; the
    panel is repeated per engine), or, for a process's eBPF family, over the contract's
    one layout: a heatmap draws one distribution, its title says across nodes."""
    by = "engine, kind, le" if "engine" in spec.labels else "le"
    return f"sum by ({by}) (increase({sel(spec, '_bucket')}[{RANGE}]))"


def heatmap_panel(title: str, spec: m.MetricSpec, unit: str) -> Panel:
    per_engine = "engine" in spec.labels
    title = f"{title}, across nodes"
    return Panel(f"{title} ($engine)" if per_engine else title,
                 [(heatmap(spec), "{{le}}")], unit, "heatmap", description=spec.help,
                 repeat="engine" if per_engine else "")


def hit_rate_by_basis(by: tuple[str, ...], window: str = RANGE,
                      regex: dict | None = ENGINE) -> str:
    """kv_cache_hit_rate as the daemon answers it: from blocks where the engine counts
    them, else tokens (vLLM V1), else its own gauge (vLLM V0, SGLang), with `basis`
    saying which (the contract's names for them). The gauge only of the kinds that
    report one: another's (a zero the bundled engine's files hold) would stand in for
    its counters until their rate has two scrapes, a basis that flips."""
    friendly = FRIENDLY["kv_cache_hit_rate"]
    bases = ((friendly.source.unit, friendly.name), *friendly.fallbacks)
    by, gauge = per_node(by), FRIENDLY[bases[-1][1]].source.name
    on = ", ".join(b for b in by if b != "skeleton")
    reporting = {**(regex or {}), "kind": "|".join(sorted(
        kind for kind, names in TARGETS.items() if gauge in names))}
    means = [(basis, promql.statistic_expr(FRIENDLY[name], "mean", window, by=by,
                                           regex=reporting if basis == "gauge" else regex))
             for basis, name in bases]
    return f" or on ({on}) ".join(f'label_replace({mean}, "basis", "{basis}", "", "")'
                                  for basis, mean in means)


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


def boards(rules=None) -> list[Board]:
    if rules is None:
        from ac_observe.daemon.alerting.rules import default_rules
        rules = default_rules()
    return [with_not_exported(overview()), with_not_exported(kv_and_prompts()),
            with_not_exported(gpu_and_cuda()), drift_and_alerts(rules)]


# ----- figures a scraped engine does not export -------------------------------------------

def _engine_families(expr: str) -> set[str]:
    """The engine figures a query reads (ac_engine_up, which every kind has, aside)."""
    return {name for name in families_named(expr) if name in m.BY_NAME and
            name != m.ENGINE_UP.name and (m.BY_NAME[name].source == "engine" or
                                          name == m.STREAM_UTILIZATION.name)}


def _missing(panel: Panel, kind: str) -> list[str]:
    """The figures of a panel that servers of this kind never export (no row of its
    mapping table feeds any family the line reads): the panel's title when it is all
    of it, else `title: line` for each such line."""
    title = panel.title.replace(" ($engine)", "")  # a label value, not a variable
    lines = []
    for expr, legend in panel.targets:
        families = _engine_families(expr)
        if families and not families & TARGETS[kind]:
            lines.append(re.sub(r"\{\{[^}]*\}\}", "", legend).strip(" ()"))
    if len(lines) == len(panel.targets):
        return [title]
    return [f"{title}: {line}" if line else title for line in lines]


def with_not_exported(board: Board) -> Board:
    """Each panel a scraped kind cannot fill says so in place of "No data", and a table
    lists, per engine of that kind ($engine), the figures it does not export: the CLI's
    "not exported by vLLM", never an empty panel read as a zero."""
    figures: dict[str, list[str]] = {kind: [] for kind in TARGETS}
    for _, panels in board.rows:
        for panel in panels:
            empty_for = []  # the kinds for which every line of the panel is missing
            for kind in TARGETS:
                missing = _missing(panel, kind)
                figures[kind] += [f for f in missing if f not in figures[kind]]
                if missing == [panel.title.replace(" ($engine)", "")]:
                    empty_for.append(KIND_TITLES[kind])
            if empty_for:
                panel.no_value = f"No data: not exported by {' or '.join(empty_for)}"
    rows = list(board.rows)
    targets = []
    for kind, names in figures.items():
        if not names:
            continue
        up = f'{m.ENGINE_UP.name}{{node=~"$node", engine=~"$engine", kind="{kind}"}}'
        targets.append((f'label_replace(label_replace(group by (node, engine, kind) ({up}), '
                        f'"status", "not exported by {KIND_TITLES[kind]}", "", ""), '
                        f'"figures", "{"; ".join(names)}", "", "")', ""))
    if targets:
        rows.append(("Not exported", [Panel(
            "Figures these engines do not export", targets, "short", "table",
            description="Per vLLM or SGLang engine: the figures on this board that its "
                        "kind never exports (its /metrics has no family for them), so their "
                        "panels are empty for it by design, not at zero.",
            width=24, height=5)]))
    return Board(board.uid, board.title, board.description, rows)


# ----- the SDK's models ---------------------------------------------------------------------

def build(board: Board) -> dict:
    """The dashboard's JSON model (a dict), built with the SDK's typed builders."""
    from grafana_foundation_sdk.builders import heatmap as sdk_heatmap
    from grafana_foundation_sdk.builders import stat as sdk_stat
    from grafana_foundation_sdk.builders import table as sdk_table
    from grafana_foundation_sdk.builders import timeseries as sdk_timeseries
    from grafana_foundation_sdk.builders.dashboard import (
        AnnotationQuery,
        AnnotationTarget,
        Dashboard,
        QueryVariable,
        Row,
    )
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    source = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
    kinds = {"timeseries": sdk_timeseries.Panel, "stat": sdk_stat.Panel,
             "heatmap": sdk_heatmap.Panel, "table": sdk_table.Panel}
    node = (QueryVariable(NODE).label("Node").datasource(source)
            .query(f"label_values({m.BUILD_INFO.name}, {NODE})").multi(True)
            .include_all(True).all_value(".*").refresh(2).sort(1))
    engine = (QueryVariable("engine").label("Engine").datasource(source)
              .query(f'label_values({m.ENGINE_UP.name}{{node=~"$node"}}, engine)')
              .multi(True).include_all(True).all_value(".*").refresh(2).sort(1))
    dashboard = (Dashboard(board.title).uid(board.uid).description(board.description)
                 .tags(["ac-observe", "generated"]).refresh("10s").time("now-1h", "now")
                 .timezone("browser").editable().with_variable(node).with_variable(engine)
                 .annotations(annotation_queries(AnnotationQuery, AnnotationTarget)))
    y, next_id = 0, 1
    for title, panels in board.rows:
        dashboard = dashboard.with_row(Row(title).id(next_id).grid_pos(
            GridPos(h=1, w=24, x=0, y=y)))
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for panel in panels:
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            built = (kinds[panel.kind]().id(next_id).title(panel.title).datasource(source)
                     .grid_pos(GridPos(h=panel.height, w=panel.width, x=x, y=y)))
            if panel.kind == "heatmap":  # the buckets' unit is the y axis'; cells count
                built = (built.calculate(False).unit("short")
                         .y_axis(sdk_heatmap.YAxisConfig().unit(panel.unit)))
            else:
                built = built.unit(panel.unit)
            if panel.description:
                built = built.description(panel.description)
            if panel.repeat:
                built = built.repeat(panel.repeat).repeat_direction("h")
            if panel.no_value:
                built = built.no_value(panel.no_value)
            for i, (expr, legend) in enumerate(panel.targets):
                if legend and NODE not in legend and not ACROSS_NODES.search(panel.title):
                    legend = f"{{{{{NODE}}}}} {legend}"  # GPU 0 of two nodes: two names
                query = (Dataquery().ref_id(chr(ord("A") + i)).expr(expr)
                         .legend_format(legend).datasource(source))
                if panel.kind == "heatmap":
                    query = query.format(PromQueryFormat.HEATMAP)
                elif panel.kind == "table":
                    query = query.format(PromQueryFormat.TABLE).instant()
                built = built.with_target(query)
            dashboard = dashboard.with_panel(built)
            next_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return json.loads(JSONEncoder(sort_keys=True).encode(dashboard.build()))


# Grafana's own annotation store, where the daemon's `grafana` receiver writes.
GRAFANA_BUILTIN = {"type": "grafana", "uid": "-- Grafana --"}


def annotation_queries(query, target) -> list:
    """Grafana's built-in annotations, and the alert transitions the daemon marks (every
    annotation tagged `ac-observe`, from a receiver of format grafana or --grafana-url)."""
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    from ac_observe.metrics import GRAFANA_ANNOTATION_TAG
    builtin = DataSourceRef(type_val=GRAFANA_BUILTIN["type"], uid=GRAFANA_BUILTIN["uid"])
    return [
        query().name("Annotations & Alerts").datasource(builtin).enable(True).hide(True)
        .icon_color("rgba(0, 211, 255, 1)").type("dashboard").built_in(1),
        query().name("ac-observe alerts").datasource(builtin).enable(True).hide(False)
        .icon_color("red").target(target().type("tags").tags([GRAFANA_ANNOTATION_TAG])
                                  .match_any(False).limit(100)),
    ]


def queries(model: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target of a dashboard model."""
    out = []
    for panel in model.get("panels", []):
        for target in panel.get("targets") or []:
            out.append((panel["title"], target["expr"]))
    return out


_NAME = re.compile(r"\b(ac_[a-z0-9_]+)\b")


def families_named(expr: str) -> set[str]:
    """Contract families a query names (a histogram's _bucket/_sum/_count as the family)."""
    names = set()
    for name in _NAME.findall(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[:-len(suffix)] in m.BY_NAME:
                name = name[:-len(suffix)]
        names.add(name)
    return names


ON_SCRAPED = "eBPF on a discovered vLLM or SGLang"


def needs_hardware(expr: str) -> str | None:
    """'gpu' or 'ebpf' when a query reads only what a GPU (NVML) or the eBPF probes make;
    ON_SCRAPED when it joins the probes' series to a discovered server's processes."""
    named = families_named(expr)
    sources = {m.BY_NAME[name].source for name in named if name in m.BY_NAME}
    if "ebpf" in sources and m.ENGINE_PROCESS.name in named:
        return ON_SCRAPED
    if sources and sources <= {"nvml"}:
        return "gpu (NVML)"
    if sources and sources <= {"ebpf"}:
        return "eBPF (CUDA driver probes)"
    return None
