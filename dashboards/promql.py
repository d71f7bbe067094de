"""The daemon's statistics as PromQL, and its drift rules as Prometheus alert rules.

One source, two evaluators: `ac-observe rules export --format prometheus` turns the rules
the daemon evaluates (the shipped defaults, or an alerting file's) into a Prometheus rule group,
so users who route through Alertmanager get the same rules from Prometheus. What each
statistic means is the daemon's (daemon/query.py):

- a histogram's p50/p95/p99: `histogram_quantile` over the window's bucket increases;
  its mean: Σ sum / Σ count; its rate: observations per second; `share_below:<v>`: the
  share (in %) of observations at or below v, interpolated linearly inside the bucket
  that holds v, as the daemon does, on the contract's edges; on an engine's own edges
  (vLLM's, SGLang's), the share at its nearest edge at or below v;
- quantiles sum buckets within one engine and kind (one layout) only;
- a gauge's mean/min/max/last/p50...: `avg_over_time`, `min_over_time`, ...;
- a rate's mean: `rate()`; a ratio's mean: Σ increases over Σ increases, summed over the
  ratio's `summed` labels unless the rule matches on one.

Every value is scaled to the friendly name's unit (ns, ms, %), so thresholds are the
ones the daemon's rules carry. Baselines: `static` and above/below compare with the
threshold; `trailing:<d>` is the statistic over the d before the window (`offset`);
`same_hour_yesterday` is the statistic over the hour around the window's middle a day
back, `or` the trailing fallback for the label sets yesterday lacks. (Prometheus has no
coverage figure: any data yesterday counts, where the daemon asks for 75 % of the hour, and
a trailing span with any samples is a baseline, where the daemon asks for the rule's
`baseline_min_coverage` of it.) A latency rule also carries the daemon's `explanation`
annotation as far as PromQL computes it: the means of the metric and of its parts over
the window and the baseline span (`explanation`).

NOTE: Prometheus adds `job` and `instance`; every expression aggregates `by` the
family's exported labels (`node` first, the daemon's), so a series here is a series in the
daemon's answers, and no expression merges two nodes.
"""
from __future__ import annotations

import math
import re

from ac_observe.daemon.alerting.rules import (
    DEFAULT_BASELINE_SECONDS,
    SAME_HOUR_SPAN_SECONDS,
    TEMPLATE,
)
from ac_observe.dashboards.edges import le_at_or_below
from ac_observe.friendly import FRIENDLY, LATENCY_PARTS, TITLES, Friendly
from ac_observe.metrics import MetricSpec, exposed_labels

# The daemon resolves an alert at the second evaluation in a row without its condition (one
# odd sample never resolves it); Prometheus at the first, unless told to keep firing.
# Prometheus starts that clock at the first miss and resolves once it has run at least
# keep_firing_for: 1 s resolves at the second miss at any evaluation interval of 1 s or
# more, the daemon's rule. (Prometheus >= 2.42; prometheus-operator's PrometheusRule must
# know the field.)
KEEP_FIRING_SECONDS = 1.0
# Prometheus' target label: an alert rule keeps it, so each node's daemon is its own series
# (as each daemon evaluates its own), where the dashboards sum over nodes.
INSTANCE = "instance"
# The labels that tell one bucket layout from another: a quantile sums buckets within one
# engine of one kind on one node only (two nodes' `engine-8000` may be two servers).
LAYOUT_LABELS = ("node", "engine", "kind")


def number(value: float) -> str:
    """A threshold in PromQL, every digit kept."""
    return repr(float(value))


def duration(seconds: float) -> str:
    """A PromQL duration in the largest unit that divides it: whole milliseconds at least
    (Prometheus' finest unit)."""
    ms = int(round(seconds * 1000))
    if ms <= 0 or abs(ms - seconds * 1000) > 1e-6:
        raise ValueError(f"{seconds} s is not a whole number of milliseconds, as PromQL "
                         "needs")
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def go_float(value: float) -> str:
    """A bucket bound as the `le` label carries it (prometheus_client's floatToGoString)."""
    from prometheus_client.utils import floatToGoString
    return floatToGoString(value)


def _select(name: str, spec: MetricSpec, match: dict, extra: str = "",
              regex: dict | None = None) -> str:
    labels = exposed_labels(spec)
    matchers = [f'{k}="{_escape(v)}"' for k, v in sorted(match.items()) if k in labels]
    matchers += [f'{k}=~"{_escape(v)}"' for k, v in sorted((regex or {}).items())
                 if k in labels and k not in match]
    if extra:
        matchers.append(extra)
    return f"{name}{{{','.join(matchers)}}}" if matchers else name


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def _range(window: str, offset: str) -> str:
    return f"[{window}]" + (f" offset {offset}" if offset else "")


def record_name(friendly: Friendly, statistic: str, window: str = "1m",
                by: tuple[str, ...] | None = None) -> str:
    """A recording rule's name, Prometheus' level:metric:operations: the labels it keeps
    (`node` first), the friendly name, the statistic and its window."""
    by = group_labels(friendly, {}) if by is None else by
    return f"{'_'.join(by)}:{friendly.name}:{statistic}_{window}"


def group_labels(friendly: Friendly, match: dict) -> tuple[str, ...]:
    """The labels a friendly name's series are told apart by."""
    labels = exposed_labels(friendly.source)
    return tuple(label for label in labels
                 if label not in friendly.summed or label in match)


def statistic_expr(  # noqa: C901 - the table of PromQL by kind and statistic
        friendly: Friendly, statistic: str, window: str, match: dict | None = None,
        offset: str = "", share_threshold: float = 0.0,
        by: tuple[str, ...] | None = None, regex: dict | None = None) -> str:
    """PromQL for one statistic of a friendly name over `window` ending `offset` ago, in the
    friendly unit, one series per label set (`by`: a coarser grouping; `regex`: label ->
    regular expression, for the families that carry the label, as dashboards filter)."""
    match = match or {}

    def _selector(name, spec, match, extra=""):
        return _select(name, spec, match, extra, regex)
    spec = friendly.source
    unknown = sorted(set(match) - set(exposed_labels(spec)))
    if unknown:  # the daemon matches no series on a label they lack: refuse, do not widen
        raise ValueError(f"{friendly.name}: its series have no label {unknown[0]!r} to match "
                         f"(labels: {', '.join(exposed_labels(spec))})")
    by = group_labels(friendly, match) if by is None else by
    group = ", ".join(by)
    scale = "" if friendly.scale == 1.0 else f" * {friendly.scale:g}"
    r = _range(window, offset)
    kind = friendly.kind
    if kind == "histogram":
        def summed(suffix, extra=""):
            return (f"sum by ({group}) (rate({_selector(spec.name + suffix, spec, match, extra)}"
                    f"{r}))")
        if statistic in ("p50", "p95", "p99"):
            q = int(statistic[1:]) / 100
            # Engines keep their own bucket edges (a vLLM's are not ours): buckets are
            # summed within one engine and kind only, and a coarser grouping takes the
            # worst engine's quantile, never one over a merged layout.
            layout = tuple(label for label in LAYOUT_LABELS
                           if label in exposed_labels(spec) and label not in by)
            inner = (f"sum by ({', '.join(('le',) + by + layout)}) "
                     f"(rate({_selector(spec.name + '_bucket', spec, match)}{r}))")
            quantile = f"histogram_quantile({q:g}, {inner})"
            if spec.whole:  # observed values, as the daemon answers (the edge it falls in)
                quantile = f"ceil({quantile})"
            if layout:
                quantile = f"max by ({group}) ({quantile})"
            return f"{quantile}{scale}"
        if statistic == "mean":
            return f"({summed('_sum')} / {summed('_count')}){scale}"
        if statistic == "rate":
            return summed("_count")
        if statistic.startswith("share_below"):
            bound = share_threshold / friendly.scale
            return (f"({_share_below(spec, bound, summed)}) or "
                    f"({_share_at_nearest_edge(spec, bound, summed, by, match, r, regex)})")
        raise ValueError(f"{friendly.name}: no PromQL for a histogram's {statistic!r}")
    if kind == "gauge":
        selector = _selector(spec.name, spec, match)
        over_time = {"mean": "avg_over_time", "min": "min_over_time", "max": "max_over_time",
                     "last": "last_over_time"}
        if statistic in over_time:
            return f"max by ({group}) ({over_time[statistic]}({selector}{r})){scale}"
        if statistic in ("p50", "p95", "p99"):
            q = int(statistic[1:]) / 100
            return f"max by ({group}) (quantile_over_time({q:g}, {selector}{r})){scale}"
        raise ValueError(f"{friendly.name}: no PromQL for a gauge's {statistic!r}")
    if kind == "rate":
        if statistic in ("mean", "rate"):
            return f"sum by ({group}) (rate({_selector(spec.name, spec, match)}{r})){scale}"
        raise ValueError(f"{friendly.name}: no PromQL for a rate's {statistic!r}")
    if kind == "ratio":
        if statistic != "mean":
            raise ValueError(f"{friendly.name}: no PromQL for a ratio's {statistic!r} "
                             "(only its mean, Σ over Σ)")
        den = friendly.denominator
        num = f"sum by ({group}) (rate({_selector(spec.name, spec, match)}{r}))"
        den_labels = exposed_labels(den)
        den_by = tuple(label for label in by if label in den_labels or label == INSTANCE)
        den_expr = (f"sum by ({', '.join(den_by)}) "
                    f"(rate({_selector(den.name, den, match)}{r}))")
        lacking = [label for label in by if label not in den_labels and label != INSTANCE]
        if lacking:
            return f"({num} / ignoring({', '.join(lacking)}) group_left {den_expr}){scale}"
        return f"({num} / {den_expr}){scale}"
    raise ValueError(f"{friendly.name}: unknown kind {kind}")


def _share_below(spec: MetricSpec, bound: float, summed) -> str:
    """% of observations at or below `bound`, interpolated inside its bucket (of whole
    numbers, at or below the whole number under it: an edge, as the daemon reads it)."""
    if spec.whole:
        bound = math.floor(bound)
    edges = [b for b in spec.buckets if not math.isinf(b)]
    count = summed("_count")
    if bound >= edges[-1]:
        top_rate = summed("_bucket", f'le="{go_float(edges[-1])}"')
        return f"100 * {top_rate} / {count}"
    index = next(i for i, edge in enumerate(edges) if bound <= edge)
    upper = edges[index]
    upper_rate = summed("_bucket", f'le="{go_float(upper)}"')
    if bound == upper:
        return f"100 * {upper_rate} / {count}"
    lower = edges[index - 1] if index > 0 else 0.0
    inside = (bound - lower) / (upper - lower)
    if index == 0:
        return f"100 * ({upper_rate} * {inside:.12g}) / {count}"
    lower_rate = summed("_bucket", f'le="{go_float(lower)}"')
    return (f"100 * ({lower_rate} + ({upper_rate} - {lower_rate}) * {inside:.12g}) "
            f"/ {count}")


def _share_at_nearest_edge(spec: MetricSpec, bound: float, summed, by: tuple[str, ...],
                           match: dict, r: str, regex: dict | None) -> str:
    """% of observations at or below the nearest edge at or below `bound`, on any layout
    (an engine's own edges, which the rule cannot list): buckets are cumulative, so the
    largest of those whose `le` is at or below the bound is that edge's count. A lower
    bound of the share the daemon interpolates inside the bucket holding `bound`; a drift
    compares it with its baseline read the same way. (Prometheus 2.42 has no
    histogram_fraction for classic histograms.)"""
    selector = _select(spec.name + "_bucket", spec, match,
                       f'le=~"{_escape(le_at_or_below(bound))}"', regex)
    below = (f"max by ({', '.join(by)}) "
             f"(sum by ({', '.join(by + ('le',))}) (rate({selector}{r})))")
    return f"100 * {below} / {summed('_count')}"


def baseline_expr(rule, regex: dict | None = None) -> str:
    """The baseline a relative or absolute rule compares with, as PromQL."""
    friendly = FRIENDLY[rule.metric]
    window = duration(rule.window_seconds)

    by = None if regex else group_labels(friendly, rule.match) + (INSTANCE,)

    def stat(win: str, offset: str = "") -> str:
        return statistic_expr(friendly, rule.statistic, win, rule.match, offset,
                              rule.share_threshold, by=by, regex=regex)

    if rule.baseline == "static":  # a constant, on the value's own label sets
        return f"({stat(window)} * 0 + {number(rule.baseline_value)})"
    trailing = stat(duration(rule.baseline_seconds), window)
    if rule.baseline == "same_hour_yesterday":
        span = max(rule.window_seconds, SAME_HOUR_SPAN_SECONDS)
        back = 86400.0 + rule.window_seconds / 2 - span / 2
        return f"(({stat(duration(span), duration(back))}) or ({trailing}))"
    return f"({trailing})"


def rule_expr(rule) -> str:
    """A daemon rule (daemon/alerting/rules.py Rule) as one PromQL alert expression."""
    friendly = FRIENDLY[rule.metric]
    current = statistic_expr(friendly, rule.statistic, duration(rule.window_seconds),
                             rule.match, share_threshold=rule.share_threshold,
                             by=group_labels(friendly, rule.match) + (INSTANCE,))
    t = number(rule.threshold)
    if rule.comparison == "above":
        return f"{current} > {t}"
    if rule.comparison == "below":
        return f"{current} < {t}"
    baseline = baseline_expr(rule)
    if rule.comparison == "absolute_increase":
        return f"({current}) - {baseline} >= {t}"
    if rule.comparison == "absolute_decrease":
        return f"{baseline} - ({current}) >= {t}"
    nonzero = f"abs({baseline} != 0)"
    if rule.comparison == "relative_increase":
        return f"(({current}) - {baseline}) / {nonzero} >= {t}"
    return f"({baseline} - ({current})) / {nonzero} >= {t}"


def unit(rule) -> str:
    """The unit of a rule's statistic: a share is in %, a rate per second."""
    if rule.statistic.startswith("share_below"):
        return "%"
    if rule.statistic == "rate":
        return "1/s"
    return FRIENDLY[rule.metric].unit


def describe(rule) -> str:
    if rule.comparison in ("above", "below"):
        return f"{rule.comparison} {rule.threshold:g} {unit(rule)}".rstrip()
    if rule.baseline == "same_hour_yesterday":
        base = (f"the same hour yesterday (else the trailing "
                f"{duration(rule.baseline_seconds)})")
    elif rule.baseline == "trailing":
        base = f"the trailing {duration(rule.baseline_seconds)}"
    else:
        base = f"{rule.baseline_value:g}"
    if rule.comparison.startswith("relative"):
        amount = f"{rule.threshold * 100:g} %"
    else:
        amount = f"{rule.threshold:g} {'points' if unit(rule) == '%' else unit(rule)}".rstrip()
    return f"{rule.comparison.replace('_', ' ')} of {amount} against {base}"


def _series_value(expr: str, labels: tuple[str, ...]) -> str:
    """A Prometheus template printing `expr`'s value for the alert's own series (the one
    whose `labels` equal the alert's) as the daemon prints a number (%.4g); n/a where it
    has none (a baseline of 0 has no percentage)."""
    if "`" in expr:
        raise ValueError("a PromQL expression with a backquote cannot go in a template")
    same = " ".join(f"(eq .Labels.{label} $labels.{label})" for label in labels)
    return (f'{{{{ $acv := "n/a" }}}}{{{{ range query `{expr}` }}}}{{{{ if and {same} }}}}'
            f'{{{{ $acv = printf "%.4g" .Value }}}}{{{{ end }}}}{{{{ end }}}}{{{{ $acv }}}}')


def template_fields(rule) -> dict[str, str]:
    """The daemon's annotation fields ({{ value }}, {{ baseline }}, ...) as Prometheus
    templates: the same figures, queried at the alert's evaluation for its series, so an
    alerting file's annotations read alike from both evaluators (daemon/alerting/evaluator.py
    `Evaluator._alert`)."""
    friendly = FRIENDLY[rule.metric]
    by = group_labels(friendly, rule.match) + (INSTANCE,)
    current = statistic_expr(friendly, rule.statistic, duration(rule.window_seconds),
                             rule.match, share_threshold=rule.share_threshold, by=by)
    if rule.comparison in ("above", "below"):
        # Against a threshold the daemon's baseline is the static value, whatever else
        # the file says (0 unless given): a constant here too.
        fixed = rule.baseline_value
        value, source = '{{ $value | printf "%.4g" }}', "static"
        baseline, baseline_expr_ = f"{fixed:.4g}", number(fixed)
        percent = "n/a" if not fixed else _series_value(
            f"100 * (({current}) - {number(fixed)}) / {number(abs(fixed))}", by)
    else:
        baseline_expr_ = baseline_expr(rule)
        value, baseline = _series_value(current, by), _series_value(baseline_expr_, by)
        percent = _series_value(
            f"100 * (({current}) - {baseline_expr_}) / abs({baseline_expr_} != 0)", by)
        if rule.baseline == "static":
            source = "static"
        elif rule.baseline == "trailing":
            source = f"trailing {duration(rule.baseline_seconds)} before the window"
        else:
            source = (f"same hour yesterday, else the trailing "
                      f"{duration(rule.baseline_seconds)}")
    return {"value": value, "baseline": baseline,
            "delta": _series_value(f"({current}) - {baseline_expr_}", by),
            "delta_percent": percent,
            "unit": friendly.statistic_unit(rule.statistic),
            "labels": ("{{ $first := true }}{{ range $k, $v := $labels }}{{ if not $first }}, "
                       "{{ end }}{{ $k }}={{ $v }}{{ $first = false }}{{ end }}"),
            "rule": rule.name, "baseline_source": source}


def _mean_ms(friendly: Friendly, window: str, match: dict, offset: str,
             by: tuple[str, ...]) -> str:
    """A time histogram's mean in ms over `window` ending `offset` ago, per label set `by`
    (Σ sum over Σ count, never a mean of means); none for a label set without
    observations there (as the daemon's figure is missing, never 0)."""
    spec = friendly.source
    if spec.unit != "seconds":
        raise ValueError(f"{friendly.name}: a part of a latency is a time, not {spec.unit}")
    group, r = ", ".join(by), _range(window, offset)
    own = {k: v for k, v in match.items() if k in exposed_labels(spec)}

    def summed(suffix: str) -> str:
        return f"sum by ({group}) (rate({_select(spec.name + suffix, spec, own)}{r}))"
    return f"({summed('_sum')} / ({summed('_count')} > 0)) * 1000"


def _baseline_span(rule) -> tuple[str, str]:
    """(the span a rule's alert is explained against, as PromQL: `[d] offset o`'s d and
    o) for a trailing baseline, or a rule that reads none: the daemon's (explain.spans),
    the hour before the window."""
    window = duration(rule.window_seconds)
    if rule.reads_baseline:
        return duration(rule.baseline_seconds), window
    return duration(DEFAULT_BASELINE_SECONDS), window


def explanation(rule) -> str | None:
    """The daemon's explanation of a latency alert as far as PromQL computes it, as a
    Prometheus template: the means of the metric and of each of its parts (the contract's
    LATENCY_PARTS, which daemon/alerting/explain.py splits by too) over the window and
    over the baseline span, in ms, for the alert's own series; n/a where a part has no
    data. None for a metric without parts. The baseline span is the rule's own: same hour
    yesterday where the metric has data then (as baseline_expr's `or`, for every part
    alike), else its trailing span; the hour before the window for a rule that reads no
    baseline."""
    parts = LATENCY_PARTS.get(rule.metric)
    if not parts:
        return None
    friendly = FRIENDLY[rule.metric]
    rule_by = group_labels(friendly, rule.match) + (INSTANCE,)
    window = duration(rule.window_seconds)
    span, offset = _baseline_span(rule)
    yesterday = None
    if rule.reads_baseline and rule.baseline == "same_hour_yesterday":
        whole = max(rule.window_seconds, SAME_HOUR_SPAN_SECONDS)
        yesterday = (duration(whole), duration(86400.0 + rule.window_seconds / 2 - whole / 2))
        # the label sets whose baseline is yesterday's: the metric's series had samples
        # then (its statistic's `or` in baseline_expr takes yesterday's where it exists)
        spec = friendly.source
        had = (f"sum by ({', '.join(rule_by)}) (rate("
               f"{_select(spec.name + '_count', spec, rule.match)}{_range(*yesterday)}))")
        where = (f"the same hour yesterday, else the trailing "
                 f"{duration(rule.baseline_seconds)}")
    elif rule.reads_baseline:
        where = f"the trailing {span}"
    else:
        where = f"the {span} before it, as the rule reads no baseline"

    def both(name: str) -> tuple[str, str]:
        """'baseline -> now' of one name's mean, for the alert's series."""
        part = FRIENDLY[name]
        by = tuple(label for label in rule_by
                   if label in exposed_labels(part.source) or label == INSTANCE)
        now = _mean_ms(part, window, rule.match, "", by)
        base = _mean_ms(part, span, rule.match, offset, by)
        if yesterday is not None:
            then, on = _mean_ms(part, yesterday[0], rule.match, yesterday[1], by), ", ".join(by)
            base = f"(({then}) and on({on}) {had}) or (({base}) unless on({on}) {had})"
        return _series_value(base, by), _series_value(now, by)

    total_base, total_now = both(rule.metric)
    split = ", ".join(f"{part.name} {' -> '.join(both(part.metric))} ms" for part in parts)
    return (f"mean {TITLES.get(rule.metric, rule.metric)} {total_now} ms (baseline "
            f"{total_base} ms): {split} (means over the {window} window and {where}; "
            "the daemon ranks them: ac-observe alerts explain)")


def alert_rule(rule) -> dict:
    value = ("the change" if rule.comparison.startswith("relative")
             else "the difference" if rule.comparison.startswith("absolute") else "the value")
    entry = {"alert": rule.name, "expr": rule_expr(rule)}
    if rule.for_seconds:
        entry["for"] = duration(rule.for_seconds)
    entry["keep_firing_for"] = duration(KEEP_FIRING_SECONDS)
    entry["labels"] = {**rule.labels, "severity": rule.severity}
    measure = ("a share of the baseline" if rule.comparison.startswith("relative")
               else f"in {unit(rule)}" if unit(rule) else "")
    entry["annotations"] = {
        "summary": (f"{rule.metric} {rule.statistic} over {duration(rule.window_seconds)}: "
                    f"{describe(rule)}"),
        "description": (f"{value}: {{{{ $value | printf \"%.4g\" }}}}"
                        f"{f' ({measure})' if measure else ''}; series: {{{{ $labels }}}}"),
    }
    if rule.annotations:  # the file's own, in Prometheus' templates: one source
        fields = template_fields(rule)
        entry["annotations"].update({key: _translate(text, fields, TEMPLATE)
                                     for key, text in rule.annotations.items()})
    why = explanation(rule)
    if why is not None:  # as the daemon's firing notifications carry its explanation
        entry["annotations"]["explanation"] = why
    return entry


_BRACES = re.compile(r"[{}]+")


def _translate(text: str, fields: dict[str, str], template) -> str:
    """An annotation of the daemon's as a Prometheus template: each {{ field }} becomes
    its template, and any other braces are printed as they are, never run."""
    def literal(part: str) -> str:
        # Every run of braces is printed by an action: no '{' of the text meets a '{{'.
        return _BRACES.sub(lambda m: '{{ "' + m.group(0) + '" }}', part)
    out, at = [], 0
    for match in template.finditer(text):
        out += [literal(text[at:match.start()]), fields[match.group(1)]]
        at = match.end()
    return "".join(out + [literal(text[at:])])


def alert_groups(rules) -> dict:
    """A Prometheus rule file (as a dict) holding every rule."""
    return {"groups": [{"name": "ac-observe-drift", "rules": [alert_rule(rule) for rule in rules]}]}
