"""Drift alerts: rules from the alerting file, evaluated on the daemon's windows against a
baseline, with states per rule and label set, persisted with their webhook deliveries.

A rule reads one statistic of a friendly metric (mean, p50, p95, p99, last, min, max,
rate, share_below:<v> as the metric's kind allows) over `window` for each of its series
(label sets, narrowed by `match`) and compares it with a baseline: `trailing:<d>` (the
same statistic over the `d` before the window), `static:<v>`, or `same_hour_yesterday`
(the statistic over the hour around the window's middle a day back, from the store's
per-minute history; until a series' own history covers 75 % of that hour it falls back to
`trailing:<fallback>` (1h), and the alert's `baseline_source` annotation says which). Comparisons: relative_increase /
relative_decrease (a share of the baseline: 0.15 is 15 %), absolute_increase /
absolute_decrease (in the metric's unit), above / below (the value against the threshold;
the baseline is not read).

States: inactive -> pending (the condition holds) -> firing (it held for `for`) ->
resolved (it failed on two evaluations in a row, so one odd sample never resolves an
alert) -> inactive. The baseline is frozen while pending or firing (and stored, so kept
across a restart). A series with no value or no baseline is "no data": it changes no
state (a firing alert stays firing, and is listed as no data). Each transition to firing
or resolved is written to the store with its webhook deliveries in one transaction.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field

from ac_observe.daemon.query import parse_duration
from ac_observe.daemon.webhooks import Alert, AlertConfigError, fingerprint
from ac_observe.metrics import FRIENDLY

log = logging.getLogger("ac_observe.daemon.alerts")

STATISTICS = ("mean", "p50", "p95", "p99", "last", "max", "min", "rate", "share_below:<v>")
# What each kind of metric can answer (a histogram keeps no exact extremes; a rate of a
# gauge or a ratio means nothing; shares come from a histogram's buckets).
_KIND_STATISTICS = {
    "histogram": ("mean", "p50", "p95", "p99", "last", "rate", "share_below"),
    "gauge": ("mean", "p50", "p95", "p99", "last", "max", "min"),
    "rate": ("mean", "p50", "p95", "p99", "last", "max", "min", "rate"),
    "ratio": ("mean", "p50", "p95", "p99", "last", "max", "min"),
}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_SHARE = re.compile(r"^share_below:\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(ns|us|ms|s)?$")
SAME_HOUR_SPAN_SECONDS = 3600.0
# An instance without data this long is resolved (firing) or dropped (pending).
NO_DATA_RESOLVE_SECONDS = 3600.0
# same_hour_yesterday is used once the store holds data for this share of that hour.
SAME_HOUR_MIN_COVERAGE = 0.75
# A trailing baseline is used once its series was watched for this share of its span (a
# rule's `baseline_min_coverage`): a few seconds of a young engine are no baseline.
BASELINE_MIN_COVERAGE = 0.5
COMPARISONS = ("relative_increase", "relative_decrease", "absolute_increase",
               "absolute_decrease", "above", "below")
SEVERITIES = ("info", "warning", "critical")
INACTIVE, PENDING, FIRING, RESOLVED = "inactive", "pending", "firing", "resolved"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
TEMPLATE = re.compile(r"\{\{\s*(\w+)\s*\}\}")  # {{ field }} in annotations
TEMPLATE_FIELDS = {"value", "baseline", "delta", "delta_percent", "unit", "labels", "rule",
                    "baseline_source"}


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    metric: str
    statistic: str
    window_seconds: float
    baseline: str                  # trailing | static | same_hour_yesterday
    baseline_seconds: float = 0.0  # trailing (and the fallback of same_hour_yesterday)
    baseline_value: float = 0.0    # static
    # trailing: the share of its span the series must have been watched in (else no data)
    baseline_min_coverage: float = BASELINE_MIN_COVERAGE
    share_threshold: float = 0.0   # share_below:<v>, in the metric's unit
    comparison: str = "relative_increase"
    threshold: float = 0.0
    for_seconds: float = 0.0
    severity: str = "warning"
    match: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)

    @property
    def reads_baseline(self) -> bool:
        """Compares with a baseline read from the data (trailing, or same hour yesterday
        with its trailing fallback), not with a number."""
        return self.baseline != "static" and self.comparison not in ("above", "below")


def _field(entry: dict, key: str, where: str, kind, default=None, required=False):
    if key not in entry:
        if required:
            raise AlertConfigError(f"{where}.{key}: required")
        return default
    value = entry[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise AlertConfigError(f"{where}.{key}: a number is required, not {value!r}")
        return float(value)
    if kind is dict:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise AlertConfigError(f"{where}.{key}: a mapping of strings to strings")
        return dict(value)
    if not isinstance(value, str) or not value.strip():
        raise AlertConfigError(f"{where}.{key}: a non-empty string is required")
    return value.strip()


def _choice(entry: dict, key: str, where: str, choices: tuple, default: str) -> str:
    value = _field(entry, key, where, str, default)
    if value not in choices:
        raise AlertConfigError(f"{where}.{key}: {value!r} is not one of {list(choices)}")
    return value


def _statistic(entry: dict, where: str, friendly) -> tuple[str, float]:
    """(statistic, share threshold in the metric's unit); share_below takes a number in
    the metric's unit, or a time with its unit (200ms) for a time metric."""
    text = _field(entry, "statistic", where, str, "mean")
    allowed = _KIND_STATISTICS[friendly.kind]
    if text.startswith("share_below") and "share_below" not in allowed:
        raise AlertConfigError(f"{where}.statistic: 'share_below' does not apply to "
                               f"{friendly.name} (a {friendly.kind}); use one of "
                               f"{list(allowed)}")
    if text.startswith("share_below"):
        match = _SHARE.match(text)
        if not match:
            raise AlertConfigError(f"{where}.statistic: {text[:40]!r}: use share_below:<v> "
                                   "(e.g. share_below:200ms)")
        value, unit = float(match.group(1)), match.group(2)
        if unit is not None:
            if friendly.unit not in _TIME_UNITS:
                raise AlertConfigError(f"{where}.statistic: {friendly.name} is in "
                                       f"{friendly.unit!r}, not a time: give a plain number")
            value *= _TIME_UNITS[unit] / _TIME_UNITS[friendly.unit]
        kind_word = "share_below"
    else:
        kind_word = text
        if text not in STATISTICS:
            raise AlertConfigError(f"{where}.statistic: {text!r} is not one of "
                                   f"{list(STATISTICS)}")
        value = 0.0
    if kind_word not in allowed:
        raise AlertConfigError(f"{where}.statistic: {kind_word!r} does not apply to "
                               f"{friendly.name} (a {friendly.kind}); use one of "
                               f"{list(allowed)}")
    return text, value


def _match(entry: dict, where: str, friendly) -> dict[str, str]:
    """The rule's label filter: labels its metric's series carry, each with a value
    (a label they lack would match nothing: the rule would never fire)."""
    match = _field(entry, "match", where, dict, {})
    for key, value in match.items():
        if key not in friendly.source.labels:
            raise AlertConfigError(f"{where}.match: {friendly.name}'s series have no label "
                                   f"{str(key)[:40]!r} (labels: "
                                   f"{', '.join(friendly.source.labels)})")
        if not value:
            raise AlertConfigError(f"{where}.match.{key}: give a label value")
    return match


def _duration(entry: dict, key: str, where: str, default: str | None = None,
              zero_ok: bool = False) -> float:
    text = _field(entry, key, where, str, default, required=default is None)
    if zero_ok and text in ("0", "0s"):
        return 0.0
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise AlertConfigError(f"{where}.{key}: {exc}") from None


def parse_rules(raw, source: str) -> list[Rule]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise AlertConfigError(f"{source}: rules: must be a list")
    rules, names = [], set()
    for i, entry in enumerate(raw):
        where = f"{source}: rules[{i}]"
        if not isinstance(entry, dict):
            raise AlertConfigError(f"{where}: must be a mapping")
        unknown = set(entry) - {"name", "metric", "statistic", "window", "baseline",
                                "comparison", "threshold", "for", "severity", "match",
                                "labels", "annotations", "baseline_min_coverage"}
        if unknown:
            raise AlertConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        name = _field(entry, "name", where, str, required=True)
        if not _NAME.match(name):
            raise AlertConfigError(f"{where}.name: {name[:40]!r} is not a metric-style name "
                                   "(letters, digits, _)")
        where = f"{source}: rules[{i}] ({name})"
        if name in names:
            raise AlertConfigError(f"{where}.name: {name!r} is used twice")
        names.add(name)
        metric = _field(entry, "metric", where, str, required=True)
        if metric not in FRIENDLY:
            raise AlertConfigError(f"{where}.metric: {metric!r} is not a metric name "
                                   "(ac-observe --list)")
        statistic, share_threshold = _statistic(entry, where, FRIENDLY[metric])
        comparison = _choice(entry, "comparison", where, COMPARISONS, "relative_increase")
        baseline_text = _field(entry, "baseline", where, str,
                               "static:0" if comparison in ("above", "below") else None,
                               required=comparison not in ("above", "below"))
        kind, _, argument = baseline_text.partition(":")
        baseline_seconds = baseline_value = 0.0
        if kind in ("trailing", "same_hour_yesterday"):
            try:  # same_hour_yesterday's argument: its trailing fallback (1h)
                baseline_seconds = parse_duration(
                    argument or ("1h" if kind == "same_hour_yesterday" else ""))
            except ValueError as exc:
                raise AlertConfigError(f"{where}.baseline: {exc}") from None
        elif kind == "static":
            try:
                baseline_value = float(argument)
            except ValueError:
                raise AlertConfigError(f"{where}.baseline: static needs a number, "
                                       f"not {argument!r}") from None
        else:
            raise AlertConfigError(f"{where}.baseline: {baseline_text!r}: use trailing:<d>, "
                                   "static:<v> or same_hour_yesterday[:<fallback>]")
        min_coverage = _field(entry, "baseline_min_coverage", where, float,
                              BASELINE_MIN_COVERAGE)
        if "baseline_min_coverage" in entry and (
                kind == "static" or comparison in ("above", "below")):
            raise AlertConfigError(f"{where}.baseline_min_coverage: applies to a trailing or "
                                   "same_hour_yesterday baseline only")
        if not 0.0 <= min_coverage <= 1.0:
            raise AlertConfigError(f"{where}.baseline_min_coverage: a share from 0 to 1 "
                                   f"(0.5 is half the baseline's span), not {min_coverage:g}")
        severity = _choice(entry, "severity", where, SEVERITIES, "warning")
        annotations = _field(entry, "annotations", where, dict, {})
        for key, text in annotations.items():
            for used in TEMPLATE.findall(text):
                if used not in TEMPLATE_FIELDS:
                    raise AlertConfigError(f"{where}.annotations.{key}: unknown field "
                                           f"{{{{ {used} }}}}; use "
                                           f"{', '.join(sorted(TEMPLATE_FIELDS))}")
        labels = _field(entry, "labels", where, dict, {})
        reserved = {"alertname", "severity"} & set(labels)
        if reserved:
            raise AlertConfigError(f"{where}.labels: {sorted(reserved)[0]!r} is set by the "
                                   "rule itself")
        rules.append(Rule(
            name=name, metric=metric, statistic=statistic,
            window_seconds=_duration(entry, "window", where),
            baseline=kind, baseline_seconds=baseline_seconds, baseline_value=baseline_value,
            baseline_min_coverage=min_coverage, share_threshold=share_threshold,
            comparison=comparison, threshold=_field(entry, "threshold", where, float,
                                                    required=True),
            for_seconds=_duration(entry, "for", where, "0s", zero_ok=True),
            severity=severity, match=_match(entry, where, FRIENDLY[metric]),
            labels=labels, annotations=annotations))
    return rules


# The shipped rules (`rules: defaults` in an alerting file; `ac-observe alerts defaults`
# prints them to copy and edit).
DEFAULT_RULES = """\
- name: InferenceLatencyDrift
  metric: inference_latency_ns
  statistic: p95
  window: 5m
  baseline: same_hour_yesterday:1h
  comparison: relative_increase
  threshold: 0.15
  for: 5m
  annotations:
    summary: "TTFT p95 {{ value }} ns is {{ delta_percent }} % over its baseline ({{ baseline_source }})"
- name: KvCacheHitRateDrop
  metric: kv_cache_hit_rate
  statistic: mean
  window: 10m
  baseline: same_hour_yesterday:1h
  comparison: absolute_decrease
  threshold: 5
  for: 5m
  annotations:
    summary: "KV block hit rate {{ value }} % is {{ delta }} points off its baseline; kv_cache_miss_reasons says why"
- name: KvCacheHitRateLow
  metric: kv_cache_hit_rate
  statistic: mean
  window: 5m
  comparison: below
  threshold: 85
  for: 5m
- name: CudaStreamSaturated
  metric: cuda_stream_utilization
  statistic: mean
  window: 10s
  comparison: above
  threshold: 95
  for: 10s
- name: SkeletonComplexityDrift
  metric: skeleton_complexity
  statistic: mean
  window: 15m
  baseline: same_hour_yesterday:1h
  comparison: relative_increase
  threshold: 0.3
  for: 10m
  severity: info
- name: FastRequestsShareDrop
  metric: inference_latency_ns
  statistic: share_below:200ms
  window: 10m
  baseline: same_hour_yesterday:1h
  comparison: absolute_decrease
  threshold: 1
  for: 5m
  annotations:
    summary: "{{ value }} % of requests got their first token within 200 ms, {{ delta }} points off ({{ baseline_source }})"
- name: CollectorDown
  metric: collector_up
  statistic: max
  window: 1m
  comparison: below
  threshold: 1
  for: 1m
- name: EngineGone
  metric: engine_up
  statistic: last
  window: 30s
  comparison: below
  threshold: 1
  for: 1m
  severity: critical
  annotations:
    summary: "engine {{ labels }} has sent no heartbeat for over a minute"
"""


def default_rules() -> list[Rule]:
    import yaml
    return parse_rules(yaml.safe_load(DEFAULT_RULES), "the shipped defaults")


def alert_labels(rule: Rule, series_labels: dict) -> dict:
    """The labels a notification carries (and its fingerprint is taken over): the series'
    own, the rule's, alertname and severity."""
    return {**series_labels, **rule.labels, "alertname": rule.name, "severity": rule.severity}


def load_alerting_config(path) -> tuple[dict, list[Rule]]:
    """(receivers, rules) of an alerting file; AlertConfigError names what to fix.
    `rules: defaults` stands for the shipped rules (DEFAULT_RULES)."""
    import yaml

    from ac_observe.daemon.webhooks import parse_receivers, read_alerting
    document = read_alerting(path)
    rules = document.get("rules")
    source = str(path)
    if rules == "defaults":
        rules, source = yaml.safe_load(DEFAULT_RULES), f"{path} (the shipped defaults)"
    return (parse_receivers(document.get("receivers"), str(path)),
            parse_rules(rules, source))


def breached(rule: Rule, value: float, baseline: float) -> bool:
    c, t = rule.comparison, rule.threshold
    if c == "above":
        return value > t
    if c == "below":
        return value < t
    if c == "absolute_increase":
        return value - baseline >= t
    if c == "absolute_decrease":
        return baseline - value >= t
    if baseline == 0:
        return False  # a relative change of nothing: undefined, never an alert
    change = (value - baseline) / abs(baseline)
    return change >= t if c == "relative_increase" else -change >= t


def _render(template: str, fields: dict) -> str:
    return TEMPLATE.sub(lambda m: str(fields.get(m.group(1), "")), template)


def _coverage(answer: dict) -> dict:
    """label set -> the share of the answer's span its series was watched in."""
    return {tuple(sorted(s["labels"].items())): s.get("coverage", answer.get("coverage", 0.0))
            for s in answer["series"]}


def _clock(t: float) -> str:
    import time as _time
    return _time.strftime("%H:%M", _time.gmtime(t))


def _number(value: float) -> str:
    return f"{value:.4g}"


@dataclass(slots=True)
class Instance:
    rule: str
    labels: dict
    state: str = INACTIVE
    active_since: float | None = None
    firing_since: float | None = None
    value: float | None = None
    baseline: float | None = None
    baseline_source: str = ""
    no_data: bool = False
    misses: int = 0  # evaluations in a row with the condition false while firing
    no_data_since: float | None = None
    resolved_because: str = ""
    waiting_for: str = ""  # why an inactive one cannot be evaluated (no baseline yet)


class Evaluator:
    """Evaluates every rule on the daemon's windows (`evaluate`, called by the daemon's
    cycle every `interval_seconds`), keeps instances, writes transitions and deliveries."""

    def __init__(self, daemon, rules: list[Rule], store, sender, interval_seconds: float = 5.0):
        self.daemon = daemon
        self.rules = {rule.name: rule for rule in rules}
        self.store = store
        self.sender = sender
        self.interval_seconds = interval_seconds
        self.instances: dict[tuple[str, str], Instance] = {}
        self._last = -math.inf
        self._lock = threading.Lock()
        self._orphans: list[dict] = []
        # rule -> (the minute its same-hour-yesterday span ended in, values, {label set:
        # its coverage}):
        # that baseline moves a minute at a time, so history is read once a minute.
        self._same_hour: dict[str, tuple[int, dict, dict]] = {}
        # rule -> ((first, last) of the whole minutes read, values, coverage) from history,
        # for series whose windows cover too little of their trailing span:
        self._trailing_history: dict[str, tuple[tuple, dict, dict]] = {}
        # (rule, severity) -> firing instances, as the last evaluation left them: the
        # cycle reads it without waiting on an evaluation in progress.
        self.firing_counts: dict[tuple[str, str], int] = {
            (rule.name, rule.severity): 0 for rule in rules}
        self._warn_unreachable()
        self._load()
        self._publish()

    def _warn_unreachable(self) -> None:
        """Without the history, a trailing baseline is what the in-memory windows hold: a
        rule whose window and the needed share of its baseline span do not fit in them
        never gets one, and is said so at start rather than waiting in silence."""
        config = self.daemon.config
        if self.daemon.history is not None:
            return
        for rule in self.rules.values():
            if not rule.reads_baseline:
                continue
            needed = rule.window_seconds + rule.baseline_min_coverage * rule.baseline_seconds
            if needed > config.window_seconds:
                log.warning("alert rule %s: its trailing baseline needs %s s of the in-memory "
                            "windows, which hold %s s (daemon --window), and the history is "
                            "off: it will never have one (lower baseline_min_coverage or the "
                            "baseline, or keep the history)", rule.name, _number(needed),
                            _number(config.window_seconds))

    def _load(self) -> None:
        """Pending and firing alerts survive a restart: no second firing delivery. An
        instance whose rule is gone from the file, or whose rule now gives its series
        another label set (labels or severity edited), is retired: a firing one gets its
        resolved notification, so no receiver keeps an alert that nothing will resolve."""
        import sqlalchemy as sa

        from ac_observe.daemon.store import alert_instances
        with self.store.engine.connect() as connection:
            rows = [dict(r) for r in connection.execute(sa.select(alert_instances)).mappings()]
        for row in rows:
            rule = self.rules.get(row["rule"])
            labels = json.loads(row["labels"])
            if rule is None or fingerprint(alert_labels(rule, labels)) != row["fingerprint"]:
                self._orphans.append(row)
                continue
            self.instances[row["rule"], row["fingerprint"]] = Instance(
                row["rule"], labels, row["state"], row["active_since"],
                row["firing_since"], row["value"], row["baseline"])

    def _retire_orphans(self, now: float) -> None:
        from ac_observe.daemon.store import alert_instances, alert_transitions
        for row in list(self._orphans):
            labels = json.loads(row["labels"])
            notified = json.loads(row["alert_labels"]) if row.get("alert_labels") else \
                {**labels, "alertname": row["rule"]}
            alert = None
            if row["state"] == FIRING:
                annotations = json.loads(row["annotations"]) if row.get("annotations") else {}
                annotations["resolved_because"] = "its rule was removed or changed"
                alert = Alert(labels=notified, annotations=annotations, status=RESOLVED,
                              starts_at=row["firing_since"] or now, ends_at=now)
            try:
                with self.store.engine.begin() as connection:
                    connection.execute(alert_transitions.insert().values(
                        rule=row["rule"], fingerprint=row["fingerprint"], labels=row["labels"],
                        from_state=row["state"], to_state=RESOLVED if alert else INACTIVE,
                        at=now, value=row["value"], baseline=row["baseline"],
                        summary="retired: its rule was removed or changed"))
                    connection.execute(alert_instances.delete().where(
                        alert_instances.c.rule == row["rule"],
                        alert_instances.c.fingerprint == row["fingerprint"]))
                    if alert is not None and self.sender is not None:
                        self.sender.enqueue([alert], RESOLVED, connection=connection)
            except Exception:
                log.exception("alert %s %s: retiring it failed; retried next evaluation",
                              row["rule"], row["fingerprint"])
                continue
            self._orphans.remove(row)
            log.info("alert %s %s retired (its rule was removed or changed)", row["rule"],
                     row["fingerprint"])

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval_seconds

    def evaluate(self, now: float, stop: threading.Event | None = None) -> None:
        """Every rule once at `now`; a set `stop` (the daemon closing) ends it between rules,
        so nothing is written after the store is closed."""
        self._last = now
        if self._orphans:
            self._retire_orphans(now)
        for rule in self.rules.values():
            if stop is not None and stop.is_set():
                return
            try:
                values, baselines = self._inputs(rule, now)  # reads: no lock held
                with self._lock:  # the HTTP threads read the instances
                    self._evaluate_rule(rule, values, baselines, now)
            except Exception:  # one bad rule (or a store outage) never stops the others
                log.exception("rule %s failed to evaluate", rule.name)
        self._publish()

    def _publish(self) -> None:
        counts = {(rule.name, rule.severity): 0 for rule in self.rules.values()}
        with self._lock:
            for (name, _fp), instance in self.instances.items():
                if instance.state == FIRING:
                    counts[name, self.rules[name].severity] += 1
        self.firing_counts = counts

    def _statistic(self, rule: Rule, window: float, until: float,
                   source: str = "auto") -> tuple[dict, dict]:
        """(label set -> the rule's statistic, the query's answer)."""
        shares = ({rule.statistic: rule.share_threshold}
                  if rule.statistic.startswith("share_below") else None)
        answer = self.daemon.query(rule.metric, window, rule.match, now=until, shares=shares,
                                   source=source)
        out = {}
        for series in answer["series"]:
            value = series.get(rule.statistic)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[tuple(sorted(series["labels"].items()))] = float(value)
        return out, answer

    def _trailing(self, rule: Rule, now: float, keys) -> dict:
        """label set -> (the trailing baseline or None, where it came from).

        A series watched for less than `baseline_min_coverage` of the span has none yet
        (no data: a young engine's first seconds are no baseline). A span the in-memory
        windows can hold is read from them; where it begins before they do (a daemon
        restarted), a series they have watched since they began is read from the store's
        whole minutes of the span before that (once a minute per rule): each counts
        towards its coverage by its cycles in it, with what the windows watched, and its
        baseline is their statistic; a series born since is never filled in. A span
        longer than the windows is read from the whole minutes that end by the window.
        No minute is read past the span's end: the window's own data is no baseline."""
        end = now - rule.window_seconds
        span = rule.baseline_seconds
        text = f"trailing {_number(span)} s before the window"
        values: dict = {}
        covered: dict = {}
        interval = self.daemon.config.interval_seconds
        longer = span > self.daemon.config.window_seconds  # all of it from history
        if not longer:
            values, answer = self._statistic(rule, span, end, source="windows")
            covered = _coverage(answer)
        began = self.daemon.windows.earliest_time
        sources = dict.fromkeys(values, text)
        # The span's whole minutes (before the windows begin, unless all from history):
        first = math.ceil((end - span) / 60.0) * 60.0
        last = math.floor((end if longer else min(end, began)) / 60.0) * 60.0
        short = [key for key in keys if covered.get(key, 0.0) < rule.baseline_min_coverage]
        if short and self.daemon.history is not None and last - first >= 60.0:
            if not longer:  # only series the windows have watched since they began
                watched = now - began
                _, answer = self._statistic(rule, watched, now, source="windows")
                present = _coverage(answer)
                short = [key for key in short
                         if present.get(key, 0.0) * watched >= watched - 2.0 * interval]
            cached = self._trailing_history.get(rule.name)
            if short and (cached is None or cached[0] != (first, last)):
                try:
                    past, answer = self._statistic(rule, last - first, last, source="history")
                    cached = ((first, last), past, _coverage(answer))
                except (RuntimeError, ValueError):  # the store cannot be read
                    cached = ((first, last), {}, {})
                self._trailing_history[rule.name] = cached
            for key in short:
                if key in cached[1]:
                    values[key] = cached[1][key]
                    covered[key] = min(1.0, covered.get(key, 0.0)
                                       + cached[2].get(key, 0.0) * (last - first) / span)
                    sources[key] = text + (" (from the history's minutes)" if longer
                                           else " (its minutes before the daemon's windows "
                                                "begin, from the history)")
        out = {}
        for key in keys:
            share = covered.get(key, 0.0)
            if key not in values:
                out[key] = (None, f"{text}: no value in it yet")
            elif share >= rule.baseline_min_coverage:
                out[key] = (values[key], sources[key])
            else:
                out[key] = (None, f"{text}: still building ({100 * share:.0f} % of it "
                                  f"watched, {100 * rule.baseline_min_coverage:.0f} % needed)")
        return out

    def _baselines(self, rule: Rule, now: float, keys) -> dict:
        """label set -> (baseline, where it came from), for the label sets in `keys`.

        same_hour_yesterday is taken per series: one whose own history covers less than
        SAME_HOUR_MIN_COVERAGE of that hour (an engine started today, beside one that ran
        yesterday) falls back to the trailing baseline, and its annotation says so."""
        same: dict = {}
        if rule.baseline == "same_hour_yesterday":
            # The hour around this window's middle, a day back (or the window, if longer).
            span = max(rule.window_seconds, SAME_HOUR_SPAN_SECONDS)
            end = now - 86400.0 - rule.window_seconds / 2 + span / 2
            cached = self._same_hour.get(rule.name)
            if cached is not None and cached[0] == int(end // 60):
                values, coverage = cached[1], cached[2]
            else:
                try:
                    values, answer = self._statistic(rule, span, end)
                    coverage = _coverage(answer)
                    self._same_hour[rule.name] = (int(end // 60), values, coverage)
                except (RuntimeError, ValueError):  # the store cannot be read, or the hour
                    values, coverage = {}, {}       # is past the retention: fall back below
            text = f"same hour yesterday ({_clock(end - span)}-{_clock(end)} UTC)"
            same = {key: (values[key], text) for key in keys
                    if key in values and coverage.get(key, 0.0) >= SAME_HOUR_MIN_COVERAGE}
            if len(same) == len(keys):
                return same
        trailing = self._trailing(rule, now, [key for key in keys if key not in same])
        if rule.baseline == "same_hour_yesterday":
            trailing = {key: (value, source + " (no history for the same hour yesterday yet)")
                        for key, (value, source) in trailing.items()}
        return {**trailing, **same}

    def _inputs(self, rule: Rule, now: float) -> tuple[dict, dict]:
        """(label set -> the window's statistic, label set -> (baseline, its source))."""
        values, _ = self._statistic(rule, rule.window_seconds, now)
        if not rule.reads_baseline:
            return values, {key: (rule.baseline_value, "static") for key in values}
        return values, self._baselines(rule, now, list(values))

    def _evaluate_rule(self, rule: Rule, values: dict, baselines: dict, now: float) -> None:
        seen = set()
        for key, value in values.items():
            labels = dict(key)
            fp = fingerprint(alert_labels(rule, labels))  # as the notification carries it
            seen.add(fp)
            baseline, source = baselines[key]
            self._step(rule, fp, labels, value, baseline, source, now)
        for (name, fp), instance in list(self.instances.items()):
            if name == rule.name and fp not in seen:
                instance.waiting_for = ""  # no value: nothing to evaluate, nor to wait for
                self._no_data(rule, instance, fp, now)  # its series left the window

    def _step(self, rule: Rule, fp: str, labels: dict, value: float,
              baseline: float | None, source: str, now: float) -> None:
        instance = self.instances.get((rule.name, fp))
        if instance is None:
            instance = self.instances[rule.name, fp] = Instance(rule.name, labels)
        if instance.state in (PENDING, FIRING) and instance.baseline is not None:
            # Frozen while active (and across a restart): a trailing baseline that caught up
            # with the new level must not resolve an alert whose problem is still there.
            baseline = instance.baseline
            instance.baseline_source = (instance.baseline_source
                                        or "as it was when it went pending (before a restart)")
        else:
            instance.baseline_source = source
        instance.waiting_for = "" if baseline is not None else f"no baseline: {source}"
        if baseline is None:
            instance.value = value  # for the waiting list; inactive, so never notified
            self._no_data(rule, instance, fp, now)
            return
        instance.no_data, instance.no_data_since = False, None
        instance.value, instance.baseline = value, baseline
        bad = breached(rule, value, baseline)
        state = instance.state
        if state in (INACTIVE, RESOLVED):
            if bad:
                instance.active_since = now
                if not self._move(rule, instance, fp, PENDING, now):
                    return
                state = PENDING
            elif state == RESOLVED:
                instance.state = INACTIVE
                instance.baseline = None
        if state == PENDING:
            if not bad:
                self._move(rule, instance, fp, INACTIVE, now)
                instance.baseline = None
            elif now - instance.active_since >= rule.for_seconds:
                instance.firing_since = now
                instance.misses = 0
                self._move(rule, instance, fp, FIRING, now)
        elif state == FIRING:
            instance.misses = 0 if bad else instance.misses + 1
            if instance.misses >= 2:
                self._move(rule, instance, fp, RESOLVED, now)

    def _no_data(self, rule: Rule, instance: Instance, fp: str, now: float) -> None:
        """No data changes nothing, for a while: an instance without data for
        NO_DATA_RESOLVE_SECONDS (its series is gone: an engine removed, a label changed)
        is resolved, saying why, rather than firing forever."""
        instance.no_data = True
        if instance.no_data_since is None:
            instance.no_data_since = now
        if now - instance.no_data_since < NO_DATA_RESOLVE_SECONDS:
            return
        if instance.state == FIRING and instance.value is not None \
                and instance.baseline is not None:
            instance.resolved_because = (f"no data for {_number(NO_DATA_RESOLVE_SECONDS)} s: "
                                         "its series is gone")
            self._move(rule, instance, fp, RESOLVED, now)
        elif instance.state == PENDING:
            self._move(rule, instance, fp, INACTIVE, now)
        if instance.state in (INACTIVE, RESOLVED):
            del self.instances[rule.name, fp]

    def _alert(self, rule: Rule, instance: Instance, status: str, now: float) -> Alert:
        value, baseline = instance.value, instance.baseline
        delta = value - baseline
        fields = {"value": _number(value), "baseline": _number(baseline),
                  "delta": _number(delta),
                  "unit": FRIENDLY[rule.metric].statistic_unit(rule.statistic),
                  "delta_percent": _number(100 * delta / abs(baseline)) if baseline else "n/a",
                  "labels": ", ".join(f"{k}={v}" for k, v in sorted(instance.labels.items())),
                  "rule": rule.name, "baseline_source": instance.baseline_source}
        annotations = {k: _render(t, fields) for k, t in rule.annotations.items()}
        against = (f"{rule.comparison} {_number(rule.threshold)}"
                   if rule.comparison in ("above", "below")
                   else f"vs baseline {fields['baseline']}")
        annotations.setdefault("summary", f"{rule.metric} {rule.statistic} {fields['value']} "
                                          f"{fields['unit']} {against}")
        annotations.update(value=fields["value"], baseline=fields["baseline"],
                           baseline_source=instance.baseline_source)
        if status == RESOLVED and instance.resolved_because:
            annotations["resolved_because"] = instance.resolved_because
        return Alert(labels=alert_labels(rule, instance.labels), annotations=annotations,
                     status=status,
                     starts_at=instance.firing_since or now,
                     ends_at=now if status == RESOLVED else None)

    def _move(self, rule: Rule, instance: Instance, fp: str, to: str, now: float) -> bool:
        """Write the transition (and its deliveries) in one transaction; only once it has
        committed does the instance take the new state. False: the store refused it, the
        state stays and the next evaluation tries again."""
        from ac_observe.daemon.store import alert_instances, alert_transitions
        before = instance.state
        alert = self._alert(rule, instance, to, now) if to in (FIRING, RESOLVED) else None
        labels_json = json.dumps(instance.labels, sort_keys=True)
        try:
            self._write(rule, instance, fp, before, to, now, alert, labels_json,
                        alert_instances, alert_transitions)
        except Exception:
            log.exception("alert %s: the store refused %s -> %s; retried next evaluation",
                          rule.name, before, to)
            return False
        instance.state = to
        if alert is not None and self.sender is not None:
            self.sender.wake()  # committed now: deliver without waiting for the next poll
        log.info("alert %s %s: %s -> %s", rule.name, fp, before, to)
        return True

    def _write(self, rule, instance, fp, before, to, now, alert, labels_json,
               alert_instances, alert_transitions) -> None:
        with self.store.engine.begin() as connection:
            connection.execute(alert_transitions.insert().values(
                rule=rule.name, fingerprint=fp, labels=labels_json, from_state=before,
                to_state=to, at=now, value=instance.value, baseline=instance.baseline,
                summary=alert.annotations["summary"] if alert else None))
            connection.execute(alert_instances.delete().where(
                alert_instances.c.rule == rule.name, alert_instances.c.fingerprint == fp))
            if to in (PENDING, FIRING):
                connection.execute(alert_instances.insert().values(
                    rule=rule.name, fingerprint=fp, labels=labels_json, state=to,
                    active_since=instance.active_since, firing_since=instance.firing_since,
                    value=instance.value, baseline=instance.baseline, updated_at=now,
                    alert_labels=json.dumps(alert_labels(rule, instance.labels),
                                            sort_keys=True),
                    annotations=json.dumps(alert.annotations, sort_keys=True)
                    if alert else None))
            if alert is not None and self.sender is not None:
                self.sender.enqueue([alert], to, connection=connection)

    def active(self) -> list[dict]:
        out = []
        with self._lock:
            instances = sorted(self.instances.items())
        for (name, fp), i in instances:
            if i.state in (PENDING, FIRING):
                rule = self.rules[name]
                out.append({"rule": name, "fingerprint": fp, "state": i.state,
                            "labels": i.labels, "severity": rule.severity,
                            "metric": rule.metric, "statistic": rule.statistic,
                            "value": i.value, "baseline": i.baseline,
                            "baseline_source": i.baseline_source, "no_data": i.no_data,
                            "active_since": i.active_since, "firing_since": i.firing_since})
        return out

    def waiting(self) -> list[dict]:
        """Inactive instances whose series has a value but no baseline, and why (a trailing
        baseline still building): a rule that cannot fire yet says so instead of looking
        calm."""
        with self._lock:
            instances = sorted(self.instances.items())
        return [{"rule": name, "labels": i.labels, "value": i.value, "waiting_for": i.waiting_for}
                for (name, _), i in instances
                if i.state in (INACTIVE, RESOLVED) and i.no_data and i.waiting_for]

    def history(self, limit: int = 100) -> list[dict]:
        import sqlalchemy as sa

        from ac_observe.daemon.store import alert_transitions
        with self.store.engine.connect() as connection:
            rows = connection.execute(sa.select(alert_transitions)
                                      .order_by(alert_transitions.c.id.desc()).limit(limit))
            out = [{**dict(r), "labels": json.loads(r["labels"])} for r in rows.mappings()]
        for entry in out:  # what its value and baseline measure, while the rule is loaded
            rule = self.rules.get(entry["rule"])
            entry.update(metric=rule.metric if rule else "",
                         statistic=rule.statistic if rule else "")
        return out
