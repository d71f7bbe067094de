"""The Grafana dashboards' model (Panel, Board and the query helpers the boards are
written in), built into Grafana's JSON with Grafana's own SDK (grafana-foundation-sdk).

Every query is made by `promql.statistic_expr` from a friendly name (the same definitions
the daemon's answers and the drift rules use) or names a family through the contract's
MetricSpec, so a renamed family changes the dashboards when they are regenerated, and
`tests/test_dashboards.py` fails if the committed JSON differs or if a query names a
family the contract lacks. Dashboards refer to the Prometheus datasource by its pinned
uid (DATASOURCE_UID), never by an import placeholder. The boards are boards.py's and
fleet.py's.
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
