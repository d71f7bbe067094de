"""The keys of an engine's `.db` files, checked against the metric contract.

A key is exported only as a series of the contract: a family it declares, one of that
family's samples, exactly its labels, values allowed for them (engine.json's engine and
model where those are labels) and, for a histogram's bucket, one of its bounds spelt as
the writer spells it. Anything else is skipped with the reason, so a bad file cannot
inject series.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from ac_observe.metrics import (
    COUNTER,
    ENGINE_METRICS,
    HISTOGRAM,
    KIND_AC_OBSERVE,
    KIND_LABEL,
    UPSTREAM_LABEL,
    MetricSpec,
    label_values,
)
from ac_observe.telemetry_format import parse_sample_key

MAX_LABEL_VALUE_CHARS = 256
SPECS = {spec.family: spec for spec in ENGINE_METRICS}
_ALLOWED_VALUES = {(spec.family, label): frozenset(values) for spec in ENGINE_METRICS
                   for label in spec.labels if (values := label_values(spec, label))}

# A series' key in the daemon's windows (daemon.windows.SeriesKey): (sample name,
# ((label, value), ...)) with the labels in the exposition's order. A plain tuple.
SeriesKey = tuple


@dataclass(frozen=True, slots=True)
class CheckedKey:
    """One key that is a series of the contract: where its value goes in the exposition,
    built once per key so a cycle only adds values (NOTE: the label dicts are shared;
    nobody mutates them)."""
    family: str
    sample: str
    labels: tuple              # ((label, value), ...) in the contract's order, then kind;
    # without le
    le: float | None
    sample_labels: dict        # the sample's labels, le included for a bucket
    count_labels: dict         # a bucket's `_count` labels (its labels without le)
    series_key: SeriesKey      # its key in the daemon's windows (one per series)


def _bound_texts(spec) -> frozenset[str]:
    """The `le` values the writer puts in a histogram's keys, exactly as it spells them."""
    return frozenset([repr(float(b)) for b in spec.buckets] + ["+Inf"])


_LE_TEXTS = {spec.family: _bound_texts(spec) for spec in ENGINE_METRICS
             if spec.type == HISTOGRAM}


def _labels_problem(family: str, spec: MetricSpec, labels: dict[str, str],
                    expected: dict[str, str]) -> str | None:
    """Why a key's labels are not its family's (their names, engine.json's values, the
    closed sets, a bounded length), or None when they are."""
    if set(labels) != set(spec.labels):
        return f"{family}: labels {sorted(labels)[:8]} are not {list(spec.labels)}"
    for label, value in labels.items():
        allowed = _ALLOWED_VALUES.get((spec.family, label))
        if label in expected and value != expected[label]:
            return f"{family}: {label}={value[:40]!r}, engine.json says {expected[label]!r}"
        if (allowed is not None and value not in allowed) or \
                not 0 < len(value) <= MAX_LABEL_VALUE_CHARS:
            return f"{family}: {label}={value[:40]!r} is not allowed"
    return None


def exported_labels(expected: dict[str, str]) -> tuple:
    """The labels the daemon adds from engine.json: `kind` (the bundled engine's unless
    engine.json names another), and a gateway's `upstream`."""
    kind = ((KIND_LABEL, expected.get(KIND_LABEL, KIND_AC_OBSERVE)),)
    if UPSTREAM_LABEL in expected:
        return kind + ((UPSTREAM_LABEL, expected[UPSTREAM_LABEL]),)
    return kind


def check_key(key: str, expected: dict[str, str]) -> CheckedKey | str:
    """The series a key stands for if it is one of the contract, else why not.
    `expected`: the label values engine.json gives (engine, model; a gateway's kind and
    upstream)."""
    try:
        family, sample, labels, _ = parse_sample_key(key)
    except ValueError as exc:
        return str(exc)
    spec = SPECS.get(family)
    if spec is None:
        return f"{family[:80]!r} is not an engine family"
    le_text = labels.pop("le", None)
    le: float | None = None
    if spec.type == HISTOGRAM:
        if sample == f"{family}_bucket" and le_text is not None:
            if le_text not in _LE_TEXTS[family]:  # one spelling per bound: no duplicate buckets
                return f"{family}: le={le_text[:20]!r} is not one of its buckets"
            le = float(le_text)
        elif sample != f"{family}_sum" or le_text is not None:
            return f"{sample[:80]!r} is not a sample of {family}"
    elif le_text is not None or sample != (spec.name if spec.type == COUNTER else family):
        return f"{sample[:80]!r} is not a sample of {family}"
    problem = _labels_problem(family, spec, labels, expected)
    if problem is not None:
        return problem
    # The daemon's `kind` after the file's own labels (the file never holds it: checked
    # above), as on every engine series of every kind; a gateway's `upstream` after it.
    ordered = tuple((label, labels[label]) for label in spec.labels) + exported_labels(expected)
    sample_labels = dict(ordered)
    if le is not None:
        sample_labels["le"] = floatToGoString(le)
    return CheckedKey(family, sample, ordered, le, sample_labels, dict(ordered),
                      (sample, tuple(sample_labels.items())))
