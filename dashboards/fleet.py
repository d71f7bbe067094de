"""The Fleet dashboard: many nodes side by side, each daemon's node apart (`node`).

Where the other boards draw the selected nodes' engines and GPUs, this one ranks the nodes:
which report, how many engines each has up, the worst ten by time to first token and by
prefix-cache hit rate, GPUs busy and idle, alerts firing and series held per node. Every
query groups by `node` (a ranking across nodes says so in its title), so a node that
stops reporting drops out of a line, never into someone else's.
"""
from __future__ import annotations

from ac_observe import metrics as m
from ac_observe.dashboards import promql
from ac_observe.dashboards.grafana import Board, Panel, gauge_by, sel
from ac_observe.friendly import FRIENDLY

FLEET_UID = "ac-fleet"
# A GPU counts as busy while NVML's utilisation is above this (a sampling driver reads a
# few % on an idle GPU now and then).
GPU_BUSY_RATIO = 0.05
WORST = 10  # nodes in each ranking


# The board reads the recording rules (dashboards/prometheus/rules/recording.rules.yml), a
# few series per engine, so it draws the same on a global Prometheus that federates only
# them (docs/fleet.md) as on the one that scrapes the daemons.
TTFT_P95_RECORD = promql.record_name(FRIENDLY["inference_latency_ns"], "p95")
HIT_RATE_BY = (m.NODE_LABEL, "engine", "kind")
HIT_RATE_RECORD = promql.record_name(FRIENDLY["kv_cache_hit_rate"], "mean_by_basis",
                                     by=HIT_RATE_BY)


def recorded(name: str) -> str:
    return f'{name}{{node=~"$node", engine=~"$engine"}}'


def ttft_p95_per_node() -> str:
    """Each node's worst engine's TTFT p95 over the last minute (each recorded per engine
    and lane: quantiles never cross layouts)."""
    return f"max by (node) ({recorded(TTFT_P95_RECORD)})"


def hit_rate_per_node() -> str:
    """Each node's lowest engine's prefix-cache hit rate, each on its own basis."""
    return f"min by (node) ({recorded(HIT_RATE_RECORD)})"


def fleet() -> Board:
    gpu = sel(m.GPU_UTILIZATION)
    return Board(FLEET_UID, "ac-observe / Fleet",
                 "Every node's daemon side by side: nodes reporting, engines up, the worst "
                 "nodes by time to first token and by prefix-cache hit rate, GPUs busy and "
                 "idle, alerts firing and series held, per node.", [
        ("Nodes", [
            Panel("Nodes reporting", [
                (f"count(count by (node) ({sel(m.BUILD_INFO)}))", "nodes")], "short",
                  "stat", description="Nodes whose daemon Prometheus scraped last "
                                      "(ac_build_info, which every daemon exports).",
                  width=6, height=4),
            Panel("Engines up across nodes", [(f"sum({sel(m.ENGINE_UP)})", "engines")],
                  "short", "stat", width=6, height=4),
            Panel("Alerts firing across nodes", [
                (f"sum({sel(m.ALERTS_FIRING)}) or vector(0)", "alerts")], "short", "stat",
                  width=6, height=4),
            Panel("Series held across nodes", [(f"sum({sel(m.SERIES)})", "series")],
                  "short", "stat", width=6, height=4),
            Panel("Engines up per node", [
                (gauge_by(m.ENGINE_UP, ()), "{{node}}")], "short",
                  description=m.ENGINE_UP.help),
            Panel("Series per node", [(gauge_by(m.SERIES, ()), "{{node}}")], "short",
                  description=m.SERIES.help + " Past --max-series new ones are refused."),
        ]),
        ("Worst nodes", [
            Panel(f"Worst {WORST} nodes by TTFT p95", [
                (f"topk({WORST}, {ttft_p95_per_node()})", "{{node}}")], "ns", "table",
                  description="Each node's worst engine's time to first token, p95 over "
                              "the last minute (recorded per engine and lane: buckets "
                              "summed within one layout)."),
            Panel(f"Worst {WORST} nodes by KV hit rate", [
                (f"bottomk({WORST}, {hit_rate_per_node()})", "{{node}}")], "percent",
                  "table", description="Each node's lowest engine's prefix-cache hit "
                                       "rate, each engine on its own basis (blocks, "
                                       "tokens, its gauge)."),
            Panel("TTFT p95 per node (worst engine)", [(ttft_p95_per_node(), "{{node}}")],
                  "ns"),
            Panel("KV hit rate per node (lowest engine)", [(hit_rate_per_node(), "{{node}}")],
                  "percent"),
        ]),
        ("GPUs and alerts", [
            Panel("GPUs busy and idle per node", [
                (f"sum by (node) ({gpu} > bool {GPU_BUSY_RATIO:g})", "busy {{node}}"),
                (f"sum by (node) ({gpu} <= bool {GPU_BUSY_RATIO:g})", "idle {{node}}"),
            ], "short", description=f"GPUs whose NVML utilisation is above "
                                    f"{GPU_BUSY_RATIO:.0%} (busy) or not (idle)."),
            Panel("Alerts firing per node", [
                (gauge_by(m.ALERTS_FIRING, ("severity",)), "{{node}} {{severity}}")],
                  "short", description=m.ALERTS_FIRING.help + " (the daemon's own rules)"),
        ]),
    ])
