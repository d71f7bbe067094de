"""Drift rules: the alerting file's `rules:` as a checked model, and what a rule means.

A rule reads one statistic of a friendly metric (mean, p50, p95, p99, last, min, max,
rate, share_below:<v> as the metric's kind allows) over `window` for each of its series
(label sets, narrowed by `match`) and compares it with a baseline: `trailing:<d>` (the
same statistic over the `d` before the window), `static:<v>`, or `same_hour_yesterday`
(the statistic over the hour around the window's middle a day back, from the store's
per-minute history, falling back to `trailing:<fallback>` (1h) per series until its
history covers that hour). Comparisons: relative_increase / relative_decrease (a share
of the baseline: 0.15 is 15 %), absolute_increase / absolute_decrease (in the metric's
unit), above / below (the value against the threshold; the baseline is not read).

`RuleSpec` is the rule as the file writes it (pydantic: its JSON Schema serves editors,
`ac-observe alerts schema`); `Rule` is what the evaluator and the Prometheus export read.
A bad rule raises AlertConfigError naming the file, the rule and the field.

NOTE: the dashboards package imports this module and nothing else of the daemon.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar

import yaml
from pydantic import Field, field_validator, model_validator

from ac_observe.daemon.alerting.spec import (
    FieldError,
    NamedSpec,
    checked_duration,
    checked_entries,
    finite_number,
    non_empty_text,
    one_of,
    string_map,
)
from ac_observe.durations import parse_duration
from ac_observe.friendly import FRIENDLY, Friendly, query_labels

STATISTICS = ("mean", "p50", "p95", "p99", "last", "max", "min", "rate", "share_below:<v>")
# What each kind of metric can answer (a histogram keeps no exact extremes; a rate of a
# gauge or a ratio means nothing; shares come from a histogram's buckets).
KIND_STATISTICS = {
    "histogram": ("mean", "p50", "p95", "p99", "last", "rate", "share_below"),
    "gauge": ("mean", "p50", "p95", "p99", "last", "max", "min"),
    "rate": ("mean", "p50", "p95", "p99", "last", "max", "min", "rate"),
    "ratio": ("mean", "p50", "p95", "p99", "last", "max", "min"),
}
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
SHARE = re.compile(r"^share_below:\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(ns|us|ms|s)?$")
# same_hour_yesterday reads the hour around the window's middle, a day back.
SAME_HOUR_SPAN_SECONDS = 3600.0
# An alert of a rule that reads no baseline (static, above, below) is explained against
# the span this long before its window.
DEFAULT_BASELINE_SECONDS = 3600.0
# same_hour_yesterday is used once the store holds data for this share of that hour.
SAME_HOUR_MIN_COVERAGE = 0.75
# A trailing baseline is used once its series was watched for this share of its span (a
# rule's `baseline_min_coverage`): a few seconds of a young engine are no baseline.
BASELINE_MIN_COVERAGE = 0.5
COMPARISONS = ("relative_increase", "relative_decrease", "absolute_increase",
               "absolute_decrease", "above", "below")
THRESHOLD_COMPARISONS = ("above", "below")  # against the threshold: no baseline read
SEVERITIES = ("info", "warning", "critical")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"
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
        return self.baseline != "static" and self.comparison not in THRESHOLD_COMPARISONS


def figure(value: float) -> str:
    """A figure as alerts print it: four significant digits."""
    return f"{value:.4g}"


def alert_labels(rule: Rule, series_labels: dict) -> dict:
    """The labels a notification carries (and its fingerprint is taken over): the series'
    own, the rule's, alertname and severity."""
    return {**series_labels, **rule.labels, "alertname": rule.name, "severity": rule.severity}


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


# ----- the file's form, checked ------------------------------------------------------------

class RuleSpec(NamedSpec):
    """One drift rule as an alerting file writes it. Fields are checked in this order."""
    name: str = Field(description="Metric-style name: letters, digits, _ (the alertname).",
                      json_schema_extra={"pattern": NAME.pattern})
    metric: str = Field(description="A friendly metric name (ac-observe --list).",
                        # a list display: pydantic types a schema's lists list[JsonValue]
                        json_schema_extra={"enum": [*sorted(FRIENDLY)]})
    statistic: str = Field("mean", description="mean, p50, p95, p99, last, max, min, rate "
                           "or share_below:<v> (e.g. share_below:200ms), as the metric's "
                           "kind allows.",
                           json_schema_extra={"pattern": r"^(mean|p50|p95|p99|last|max|min|"
                                                         r"rate|share_below:.+)$"})
    comparison: str = Field("relative_increase", json_schema_extra={"enum": list(COMPARISONS)},
                            description="relative_* take a share of the baseline (0.15 is "
                                        "15 %), absolute_* the metric's unit; above and "
                                        "below compare with the threshold alone.")
    baseline: str | None = Field(None, description="trailing:<d>, static:<v> or "
                                 "same_hour_yesterday[:<fallback>]; required unless the "
                                 "comparison is above or below.",
                                 json_schema_extra={"pattern": r"^(trailing:.+|static:.+|"
                                                               r"same_hour_yesterday(:.+)?)$"})
    baseline_min_coverage: float | None = Field(
        None, description="Share of a trailing baseline's span its series must have been "
        f"watched in (default {BASELINE_MIN_COVERAGE}).",
        json_schema_extra={"minimum": 0, "maximum": 1})
    severity: str = Field("warning", json_schema_extra={"enum": list(SEVERITIES)})
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Texts with {{ field }} of "
        f"{', '.join(sorted(TEMPLATE_FIELDS))}.")
    labels: dict[str, str] = Field(default_factory=dict,
                                   description="Added to the alert's labels.")
    window: str = Field(description="The window the statistic is read over: 30s, 5m, 1h.",
                        json_schema_extra={"pattern": DURATION_PATTERN})
    threshold: float
    for_: str = Field("0s", alias="for", description="How long the condition holds before "
                      "the alert fires.", json_schema_extra={"pattern": DURATION_PATTERN})
    match: dict[str, str] = Field(default_factory=dict, description="Label filter: only "
                                  "series with these label values.")

    _texts: ClassVar = ("name", "metric", "statistic", "comparison", "baseline", "severity",
                        "window", "for_")

    @field_validator(*_texts, mode="before")
    @classmethod
    def _non_empty(cls, value: Any) -> str:
        return non_empty_text(value)

    @field_validator("threshold", "baseline_min_coverage", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> float:
        return finite_number(value)

    @field_validator("annotations", "labels", "match", mode="before")
    @classmethod
    def _strings(cls, value: Any) -> dict[str, str]:
        return string_map(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError(f"{value[:40]!r} is not a metric-style name (letters, digits, _)")
        return value

    @field_validator("metric")
    @classmethod
    def _metric(cls, value: str) -> str:
        if value not in FRIENDLY:
            raise ValueError(f"{value!r} is not a metric name (ac-observe --list)")
        return value

    @field_validator("statistic")
    @classmethod
    def _statistic(cls, value: str, info) -> str:
        if "metric" in info.data:
            statistic_threshold(value, FRIENDLY[info.data["metric"]])
        return value

    @field_validator("comparison")
    @classmethod
    def _comparison(cls, value: str) -> str:
        return one_of(value, COMPARISONS)

    @field_validator("severity")
    @classmethod
    def _severity(cls, value: str) -> str:
        return one_of(value, SEVERITIES)

    @field_validator("baseline_min_coverage", mode="after")
    @classmethod
    def _share(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"a share from 0 to 1 (0.5 is half the baseline's span), "
                             f"not {value:g}")
        return value

    @field_validator("annotations")
    @classmethod
    def _templates(cls, value: dict[str, str]) -> dict[str, str]:
        for key, template in value.items():
            for used in TEMPLATE.findall(template):
                if used not in TEMPLATE_FIELDS:
                    raise FieldError(f"unknown field {{{{ {used} }}}}; use "
                                     f"{', '.join(sorted(TEMPLATE_FIELDS))}", key)
        return value

    @field_validator("labels")
    @classmethod
    def _own_labels(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = {"alertname", "severity"} & set(value)
        if reserved:
            raise ValueError(f"{sorted(reserved)[0]!r} is set by the rule itself")
        return value

    @field_validator("window", "for_")
    @classmethod
    def _duration(cls, value: str, info) -> str:
        if info.field_name == "for_" and value in ("0", "0s"):
            return value
        return checked_duration(value)

    @field_validator("match")
    @classmethod
    def _match(cls, value: dict[str, str], info) -> dict[str, str]:
        """Labels the metric's series carry, each with a value (a label they lack would
        match nothing: the rule would never fire)."""
        if "metric" not in info.data:
            return value
        friendly = FRIENDLY[info.data["metric"]]
        for key, wanted in value.items():
            labels = query_labels(friendly)
            if key not in labels:
                raise ValueError(f"{friendly.name}'s series have no label {str(key)[:40]!r} "
                                 f"(labels: {', '.join(labels)})")
            if not wanted:
                raise FieldError("give a label value", key)
        return value

    @model_validator(mode="after")
    def _baseline(self) -> RuleSpec:
        against_threshold = self.comparison in THRESHOLD_COMPARISONS
        if self.baseline is None and not against_threshold:
            raise FieldError("required", "baseline")
        baseline_of(self.baseline or "static:0")
        if self.baseline_min_coverage is not None and (
                against_threshold or (self.baseline or "static").startswith("static")):
            raise FieldError("applies to a trailing or same_hour_yesterday baseline only",
                             "baseline_min_coverage")
        return self

    def rule(self) -> Rule:
        kind, seconds, value = baseline_of(self.baseline or "static:0")
        return Rule(
            name=self.name, metric=self.metric, statistic=self.statistic,
            window_seconds=parse_duration(self.window), baseline=kind,
            baseline_seconds=seconds, baseline_value=value,
            baseline_min_coverage=(BASELINE_MIN_COVERAGE if self.baseline_min_coverage is None
                                   else self.baseline_min_coverage),
            share_threshold=statistic_threshold(self.statistic, FRIENDLY[self.metric]),
            comparison=self.comparison, threshold=self.threshold,
            for_seconds=0.0 if self.for_ in ("0", "0s") else parse_duration(self.for_),
            severity=self.severity, match=dict(self.match), labels=dict(self.labels),
            annotations=dict(self.annotations))


def baseline_of(baseline: str) -> tuple[str, float, float]:
    """(kind, seconds of a trailing span or same_hour_yesterday's fallback, static value)."""
    kind, _, argument = baseline.partition(":")
    if kind in ("trailing", "same_hour_yesterday"):
        try:  # same_hour_yesterday's argument: its trailing fallback (1h)
            seconds = parse_duration(argument or ("1h" if kind == "same_hour_yesterday"
                                                  else ""))
        except ValueError as exc:
            raise FieldError(str(exc), "baseline") from None
        return kind, seconds, 0.0
    if kind == "static":
        try:
            return kind, 0.0, float(argument)
        except ValueError:
            raise FieldError(f"static needs a number, not {argument!r}", "baseline") from None
    raise FieldError(f"{baseline!r}: use trailing:<d>, static:<v> or "
                     "same_hour_yesterday[:<fallback>]", "baseline")


def statistic_threshold(statistic: str, friendly: Friendly) -> float:
    """share_below's bound in the metric's unit (0 for any other statistic), once the
    statistic is known to apply to the metric's kind. share_below takes a number in the
    metric's unit, or a time with its unit (200ms) for a time metric."""
    allowed = KIND_STATISTICS[friendly.kind]
    kind_word = "share_below" if statistic.startswith("share_below") else statistic
    if kind_word == "share_below" and kind_word in allowed:
        match = SHARE.match(statistic)
        if not match:
            raise ValueError(f"{statistic[:40]!r}: use share_below:<v> "
                             "(e.g. share_below:200ms)")
        value, unit = float(match.group(1)), match.group(2)
        if unit is not None:
            if friendly.unit not in TIME_UNITS:
                raise ValueError(f"{friendly.name} is in {friendly.unit!r}, not a time: "
                                 "give a plain number")
            value *= TIME_UNITS[unit] / TIME_UNITS[friendly.unit]
        return value
    if kind_word != "share_below" and statistic not in STATISTICS:
        raise ValueError(f"{statistic!r} is not one of {list(STATISTICS)}")
    if kind_word not in allowed:
        raise ValueError(f"{kind_word!r} does not apply to {friendly.name} (a "
                         f"{friendly.kind}); use one of {list(allowed)}")
    return 0.0


def parse_rules(raw: Any, source: str) -> list[Rule]:
    """`rules:` of an alerting file (already parsed), checked field by field."""
    return [spec.rule() for _, spec in checked_entries(raw, source, "rules", RuleSpec)]


def default_rules_text() -> str:
    """The shipped rules (`rules: defaults` in an alerting file), as YAML, without the
    file's header comment."""
    text = resources.files(__package__).joinpath("defaults.yaml").read_text()
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("#"))


def default_rules() -> list[Rule]:
    return parse_rules(yaml.safe_load(default_rules_text()), "the shipped defaults")
