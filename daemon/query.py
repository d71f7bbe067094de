"""Answers `metric over a window` from the daemon's in-memory windows.

Per series: min / mean / p50 / p95 / p99 / max / last, in the friendly name's unit. Histograms
are answered from bucket increases over the window (Prometheus `histogram_quantile`
interpolation) and have no exact extremes: `min_bucket_le` / `max_bucket_le` bound them
instead. Counters follow `increase()` semantics (a drop is a reset).
"""
from __future__ import annotations

import math
import re
import time

from ac_observe.daemon.history import HistoryView
from ac_observe.daemon.windows import Windows, WindowView
from ac_observe.friendly import FRIENDLY, Friendly
from ac_observe.metrics import exposed_labels

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def parse_labels(text: str | None, known: tuple[str, ...] | None = None) -> dict[str, str]:
    """`k=v[,k=v]` -> {k: v}. Refused: a part without `=`, a name that is not a label name
    (or, with `known`, not one of the metric's labels: it would match nothing), an empty
    value, a label given twice."""
    labels = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"bad label filter {part[:100]!r}: use k=v[,k=v]")
        key, value = (p.strip() for p in part.split("=", 1))
        if not _LABEL_NAME.match(key):
            raise ValueError(f"bad label filter {part[:100]!r}: {key[:100]!r} is not a label "
                             "name")
        if known is not None and key not in known:
            raise ValueError(f"bad label filter {part[:100]!r}: its series have no label "
                             f"{key!r} (labels: {', '.join(known)})")
        if not value:
            raise ValueError(f"bad label filter {part[:100]!r}: give {key} a value")
        if key in labels:
            raise ValueError(f"bad label filter: {key!r} given twice (one value a label)")
        labels[key] = value
    return labels


def quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def summarize(values: list[float], mean: float | None = None) -> dict:
    ordered = sorted(values)
    return {"min": ordered[0], "mean": sum(values) / len(values) if mean is None else mean,
            "p50": quantile(ordered, 0.5), "p95": quantile(ordered, 0.95),
            "p99": quantile(ordered, 0.99), "max": ordered[-1],
            "last": values[-1], "samples": len(values)}


def increase(points: list[tuple[float, float]]) -> float:
    total = 0.0
    for (_, before), (_, after) in zip(points, points[1:], strict=False):
        total += after - before if after >= before else after
    return total


def bucket_quantile(q: float, buckets: list[tuple[float, float]], whole: bool = False) -> float:
    """`histogram_quantile` over cumulative (upper bound, count) pairs. Of whole numbers
    with a bucket each (`MetricSpec.whole`), the observed value the rank falls on: every
    depth 2 has a p50 of 2, not the 1.5 that interpolating inside (1, 2] makes of it."""
    total = buckets[-1][1]
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > previous_count:
            if math.isinf(bound):
                return previous_bound
            if whole:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


def share_below(bound: float, buckets: list[tuple[float, float]], whole: bool = False) -> float:
    """Share of a histogram's observations at or below `bound` (in the family's unit),
    interpolating linearly inside the bucket that holds it, as `bucket_quantile` does
    (exact when `bound` is a bucket edge; of whole numbers always exact). Observations past
    the last finite edge count as above any bound."""
    if whole:
        bound = math.floor(bound)  # at or below 2.5 is at or below 2: an edge
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    previous_bound, previous_count = 0.0, 0.0
    for edge, count in buckets:
        if math.isinf(edge):
            break
        if bound <= edge:
            if bound <= previous_bound:
                return previous_count / total
            inside = (bound - previous_bound) / (edge - previous_bound)
            return (previous_count + (count - previous_count) * inside) / total
        previous_bound, previous_count = edge, count
    return previous_count / total


def _series_coverage(series: list[dict], key_coverage: dict) -> None:
    """Each answered series' own coverage: the share of the span's points (minutes, or
    groups of them) in which the series it is made of (its buckets, the label sets it
    sums) held data; a series younger than the span covers less of it than the answer as
    a whole."""
    keys = [(frozenset(key[1]), share) for key, share in key_coverage.items()]
    for stats in series:
        labels = set(stats["labels"].items())
        stats["coverage"] = round(max((share for key_labels, share in keys
                                       if labels <= key_labels), default=0.0), 4)


class QueryEngine:
    """NOTE: `answer` computes on a WindowView, a copy taken under the daemon's lock, so
    it runs without holding it; `query` takes the view itself (no lock: tests, tools)."""

    def __init__(self, windows: Windows, interval_seconds: float):
        self.windows = windows
        self.interval = interval_seconds

    def query(self, name: str, window_seconds: float, label_filter: dict[str, str],
              now: float) -> dict:
        friendly = _friendly(name)
        view = self.windows.view(friendly.sample_names(), now - window_seconds, now)
        return self.answer(view, friendly, window_seconds, now - window_seconds, label_filter)

    def answer(self, view: WindowView, friendly: Friendly, window_seconds: float,
               since: float, label_filter: dict[str, str],
               shares: dict[str, float] | None = None) -> dict:
        """`shares`: statistic name -> threshold in the friendly unit; a histogram's series
        then carry that name with the percentage of observations at or below it."""
        series = []
        if friendly.kind == "ratio":
            found = self._ratio(view, friendly, since, label_filter)
        else:
            found = {"gauge": self._gauge, "histogram": self._histogram,
                     "rate": self._rate}[friendly.kind](view, friendly, since)
        history = view if isinstance(view, HistoryView) else None  # None: in-memory windows
        coverage = history.coverage if history is not None else None
        for stats, events in found:
            buckets = stats.pop("_buckets", None)
            span = stats.pop("_span")
            if _matches(stats["labels"], label_filter):
                stats["trend"] = trend(events, since, window_seconds, friendly.scale)
                if coverage is None:
                    # The share of the window the daemon watched this series in (its
                    # points' span, and the interval that led to its first): less for a
                    # daemon or a series younger than the window.
                    stats["coverage"] = round(min(1.0, (span + self.interval)
                                                  / window_seconds), 4)
                if friendly.kind == "histogram":
                    # Observations per second over the span the count's points cover (the
                    # whole window once the daemon has watched it all; less for a daemon
                    # or a series younger than the window, which /window would dilute).
                    stats["rate"] = stats["samples"] / span if span > 0 else None
                    for name, threshold in (shares or {}).items():
                        stats[name] = 100.0 * share_below(threshold / friendly.scale,
                                                          buckets, friendly.source.whole)
                elif friendly.kind == "rate":
                    stats["rate"] = stats["mean"]
                series.append(stats)
        series.sort(key=lambda s: sorted(s["labels"].items()))
        # as_of: the newest cycle the answer reads. An answer asked at a time reads the
        # cycles up to it only, so the same question at the same time has the same answer
        # whatever cycles came since: `top` asks every figure of a screen at one as_of.
        # From history, whole minutes are read: as_of is the end of the last one (or its
        # latest cycle while it is in progress), but never later than now.
        as_of = view.times[-1] if len(view.times) else None
        if as_of is not None and coverage is not None:
            as_of = min(as_of, time.time())  # a minute turned, its first cycle not yet in
        answer = {"metric": friendly.name, "unit": friendly.unit, "kind": friendly.kind,
                  "source": friendly.source.name, "window_seconds": window_seconds,
                  "as_of": as_of, "series": series}
        if history is not None:  # answered from the store's per-minute history
            answer.update(history=True, resolution_seconds=history.resolution_seconds,
                          coverage=round(history.coverage, 4))
            _series_coverage(series, history.key_coverage)
        return answer

    def _points(self, view: WindowView, key, since: float):
        """Points in the window; a series born inside the window starts from zero."""
        points = view.points(key)
        if points and self._born_inside(view, key, since):
            points.insert(0, (points[0][0] - self.interval, 0.0))
        return points

    def _born_inside(self, view: WindowView, key, since: float) -> bool:
        """First seen after the window opened, while the daemon was already watching."""
        first_seen = view.first_seen[key]
        return first_seen > since and first_seen > view.earliest_time + 0.5 * self.interval

    def _gauge(self, view: WindowView, friendly: Friendly, since: float):
        exact = getattr(view, "gauges", None)  # history: per-minute points, exact extremes
        scale = friendly.scale
        for key in view.keys(friendly.source.name):
            points = view.points(key)
            if not points:
                continue
            stats = summarize([v * scale for _, v in points])
            stats["_span"] = points[-1][0] - points[0][0]
            events = [(t, v, 1.0) for t, v in points]
            if exact is not None and key in exact:
                n, total, low, high, last, events = exact[key]
                stats.update(min=scale * low, max=scale * high, mean=scale * total / n,
                             last=scale * last, samples=n)
            yield {"labels": dict(key[1]), **stats}, events

    def _rate(self, view: WindowView, friendly: Friendly, since: float):
        for key in view.keys(friendly.source.name):
            points = self._points(view, key, since)
            rates = [(b - a if b >= a else b) / (tb - ta)
                     for (ta, a), (tb, b) in zip(points, points[1:], strict=False) if tb > ta]
            if rates:
                span = points[-1][0] - points[0][0]
                mean = increase(points) / span if span > 0 else None
                events = [(tb, b - a if b >= a else b, tb - ta)
                          for (ta, a), (tb, b) in zip(points, points[1:], strict=False) if tb > ta]
                yield ({"labels": dict(key[1]), "_span": span,
                        **summarize([r * friendly.scale for r in rates],
                                    None if mean is None else mean * friendly.scale)}, events)

    def _ratio(self, view: WindowView, friendly: Friendly, since: float,
               label_filter: dict[str, str]):
        """Per interval: Σ numerator increase / Σ denominator increase over the series
        summed together; the mean is the ratio of the sums over the window."""
        summed = set(friendly.summed) - set(label_filter)
        groups: dict[tuple, list] = {}
        for key in view.keys(friendly.source.name):
            labels = tuple(item for item in key[1] if item[0] not in summed)
            groups.setdefault(labels, []).append(key)
        denominator = friendly.denominator
        assert denominator is not None  # a ratio has one (Friendly checks)
        den_labels = set(exposed_labels(denominator))
        den_keys = list(view.keys(denominator.name))
        for labels, keys in groups.items():
            wanted = {k: v for k, v in labels if k in den_labels}
            num, _ = self._summed_increases(view, keys, since)
            den, span = self._summed_increases(
                view, [key for key in den_keys if _matches(dict(key[1]), wanted)], since)
            ratios, events = [], []
            for t, d in sorted(den.items()):
                n = num.get(t)
                if n is not None and d > 0:
                    ratios.append(friendly.scale * n / d)
                    events.append((t, n, d))
            if ratios:
                total_num = sum(n for t, n in num.items() if t in den)
                total_den = sum(den.values())
                yield ({"labels": dict(labels), "_span": span,
                        **summarize(ratios, friendly.scale * total_num / total_den)}, events)

    def _summed_increases(self, view: WindowView, keys,
                          since: float) -> tuple[dict[float, float], float]:
        """(Σ over the series of each interval's increase, by the interval's end time (the
        daemon samples every series of a collection at one time; a reset counts from 0),
        the span their points cover)."""
        total: dict[float, float] = {}
        first, last = math.inf, -math.inf
        for key in keys:
            points = self._points(view, key, since)
            if points:
                first, last = min(first, points[0][0]), max(last, points[-1][0])
            for (_, before), (t, after) in zip(points, points[1:], strict=False):
                total[t] = total.get(t, 0.0) + (after - before if after >= before else after)
        return total, max(0.0, last - first)

    def _histogram(self, view: WindowView, friendly: Friendly, since: float):
        groups: dict[tuple, list] = {}
        family = friendly.source.family
        for key in view.keys(family + "_bucket"):
            labels = tuple(item for item in key[1] if item[0] != "le")
            bound = float(dict(key[1])["le"])
            groups.setdefault(labels, []).append((bound, key))
        for labels, bucket_keys in groups.items():
            bucket_keys.sort()
            buckets = [(bound, increase(self._points(view, key, since)))
                       for bound, key in bucket_keys]
            count = buckets[-1][1]
            if count <= 0:
                continue
            sum_points = self._points(view, (family + "_sum", labels), since)
            count_points = self._points(view, (family + "_count", labels), since)
            means = _interval_means(sum_points, count_points)  # the last one is "last"
            scale = friendly.scale
            first = next(i for i, (_, c) in enumerate(buckets) if c > 0)
            last = next(i for i, (_, c) in enumerate(buckets) if c >= count)
            yield ({"labels": dict(labels),
                    # A histogram keeps no extremes: what it knows is the upper edge of the
                    # lowest and of the highest occupied bucket (min <= the one, max <= the
                    # other; +Inf past the last finite bucket).
                    "min": None, "max": None,
                    "min_bucket_le": scale * buckets[first][0],
                    "max_bucket_le": scale * buckets[last][0],
                    "mean": scale * increase(sum_points) / count,
                    **{name: scale * bucket_quantile(q, buckets, friendly.source.whole)
                       for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
                    "last": scale * means[-1][1] / means[-1][2] if means else None,
                    "samples": int(count), "_buckets": buckets,
                    "_span": (count_points[-1][0] - count_points[0][0]
                              if len(count_points) > 1 else 0.0)}, means)


TREND_SLOTS = 24


def trend(events, since: float, window_seconds: float, scale: float) -> list:
    """The window cut into TREND_SLOTS equal slots, oldest first: Σ numerator / Σ
    denominator of the events (time, numerator, denominator) ending in each slot, scaled
    (None where none did). A gauge's events are (t, value, 1): its mean per slot; a rate's
    (t, increase, seconds); a ratio's (t, Δhits, Δlookups); a histogram's (t, Δsum, Δcount)."""
    num, den = [0.0] * TREND_SLOTS, [0.0] * TREND_SLOTS
    for t, numerator, denominator in events:
        if t < since:
            continue
        slot = min(TREND_SLOTS - 1, int((t - since) / window_seconds * TREND_SLOTS))
        num[slot] += numerator
        den[slot] += denominator
    return [scale * n / d if d > 0 else None for n, d in zip(num, den, strict=False)]


def _interval_means(sum_points, count_points) -> list[tuple[float, float, float]]:
    """(time, Δsum, Δcount) of every interval in which a histogram had observations."""
    sums = dict(sum_points)
    pairs = [(t, sums[t], c) for t, c in count_points if t in sums]
    return [(t1, s1 - s0, c1 - c0)
            for (_, s0, c0), (t1, s1, c1) in zip(pairs, pairs[1:], strict=False) if c1 > c0]


def _friendly(name: str) -> Friendly:
    friendly = FRIENDLY.get(name)
    if friendly is None:
        raise KeyError(name)
    return friendly


def describe_friendly() -> list[dict]:
    """The friendly names as the API and `--list` show them."""
    return [{"name": f.name, "unit": f.unit, "kind": f.kind, "source": f.source.name,
             "help": f.help} for f in FRIENDLY.values()]


def _matches(labels: dict, wanted: dict) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())
