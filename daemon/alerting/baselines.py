"""What a rule compares with: each series' statistic over its window, and its baseline
(same hour yesterday, or trailing), read through the daemon's series (`SeriesSource`).

same_hour_yesterday is the statistic over the hour around the window's middle a day back,
from the store's per-minute history, taken per series: one whose own history covers less
than SAME_HOUR_MIN_COVERAGE of that hour (an engine started today, beside one that ran
yesterday) falls back to the trailing baseline, and its source says so. History moves a
minute at a time, so it is read once a minute per rule.
"""
from __future__ import annotations

import math
import time
from typing import Protocol

from ac_observe.daemon.alerting.rules import (
    SAME_HOUR_MIN_COVERAGE,
    SAME_HOUR_SPAN_SECONDS,
    Rule,
    figure,
)

LabelSet = tuple[tuple[str, str], ...]  # a series' labels, sorted: one series of a rule
Baseline = tuple[float | None, str]      # (the baseline, or None while it has none; whence)


class SeriesSource(Protocol):
    """What the alerting reads of the daemon: its answers, and how far they reach."""

    @property
    def interval_seconds(self) -> float:
        """The collection cycle."""

    @property
    def window_seconds(self) -> float:
        """How far back the in-memory windows reach."""

    @property
    def has_history(self) -> bool:
        """Whether longer spans can be read from the store's per-minute history."""

    @property
    def windows_began(self) -> float:
        """The time of the windows' first cycle."""

    def query(self, metric: str, window_seconds: float, labels: dict[str, str],
              now: float | None = None, shares: dict[str, float] | None = None,
              source: str = "auto") -> dict: ...


def coverage(answer: dict) -> dict[LabelSet, float]:
    """label set -> the share of the answer's span its series was watched in."""
    return {tuple(sorted(s["labels"].items())): s.get("coverage", answer.get("coverage", 0.0))
            for s in answer["series"]}


def _clock(t: float) -> str:
    return time.strftime("%H:%M", time.gmtime(t))


class HistoryRead:
    """Statistics read from the store's history for one span of whole minutes, per rule,
    kept until the span moves on (the history changes a minute at a time)."""
    __slots__ = ("span", "values", "coverage")

    def __init__(self, span: int | tuple[float, float] | None, values: dict, covered: dict):
        """span: the minute a same-hour read ends in, a trailing read's (first, last)
        whole-minute times, or None for a same-hour read that failed."""
        self.span, self.values, self.coverage = span, values, covered


class BaselineReader:
    def __init__(self, series: SeriesSource):
        self.series = series
        # rule -> its same-hour-yesterday read, keyed by the minute that span ends in
        self._same_hour: dict[str, HistoryRead] = {}
        # rule -> its read of the whole minutes of a trailing span from history, for series
        # whose windows cover too little of it
        self._trailing_history: dict[str, HistoryRead] = {}

    def statistic(self, rule: Rule, window: float, until: float,
                  source: str = "auto") -> tuple[dict[LabelSet, float], dict]:
        """(label set -> the rule's statistic, the query's answer)."""
        shares = ({rule.statistic: rule.share_threshold}
                  if rule.statistic.startswith("share_below") else None)
        answer = self.series.query(rule.metric, window, rule.match, now=until, shares=shares,
                                   source=source)
        out = {}
        for series in answer["series"]:
            value = series.get(rule.statistic)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[tuple(sorted(series["labels"].items()))] = float(value)
        return out, answer

    def read(self, rule: Rule, now: float, keys: list) -> dict[LabelSet, Baseline]:
        """label set -> (baseline, where it came from), for the label sets in `keys`."""
        same: dict = {}
        if rule.baseline == "same_hour_yesterday":
            # The hour around this window's middle, a day back (or the window, if longer).
            span = max(rule.window_seconds, SAME_HOUR_SPAN_SECONDS)
            end = now - 86400.0 - rule.window_seconds / 2 + span / 2
            cached = self._same_hour.get(rule.name)
            if cached is None or cached.span != int(end // 60):
                try:
                    values, answer = self.statistic(rule, span, end)
                    cached = self._same_hour[rule.name] = HistoryRead(
                        int(end // 60), values, coverage(answer))
                except (RuntimeError, ValueError):  # the store cannot be read, or the hour
                    cached = HistoryRead(None, {}, {})  # is past the retention: fall back
            text = f"same hour yesterday ({_clock(end - span)}-{_clock(end)} UTC)"
            same = {key: (cached.values[key], text) for key in keys
                    if key in cached.values
                    and cached.coverage.get(key, 0.0) >= SAME_HOUR_MIN_COVERAGE}
            if len(same) == len(keys):
                return same
        trailing = self.trailing(rule, now, [key for key in keys if key not in same])
        if rule.baseline == "same_hour_yesterday":
            trailing = {key: (value, source + " (no history for the same hour yesterday yet)")
                        for key, (value, source) in trailing.items()}
        return {**trailing, **same}

    def trailing(self, rule: Rule, now: float, keys: list) -> dict[LabelSet, Baseline]:
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
        text = f"trailing {figure(span)} s before the window"
        values: dict = {}
        covered: dict = {}
        longer = span > self.series.window_seconds  # all of it from history
        if not longer:
            values, answer = self.statistic(rule, span, end, source="windows")
            covered = coverage(answer)
        sources = dict.fromkeys(values, text)
        for key, (value, share, whence) in self._from_history(rule, now, end, span, longer,
                                                              keys, covered).items():
            values[key] = value
            covered[key] = share
            sources[key] = text + whence
        out: dict = {}
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

    def _from_history(self, rule: Rule, now: float, end: float, span: float, longer: bool,
                      keys: list, covered: dict) -> dict[LabelSet, tuple[float, float, str]]:
        """label set -> (baseline, coverage, whence) from the history's whole minutes of
        the span (before the windows begin, unless all of it comes from history), for
        the series in `keys` whose windows cover too little of it."""
        began = self.series.windows_began
        first = math.ceil((end - span) / 60.0) * 60.0
        last = math.floor((end if longer else min(end, began)) / 60.0) * 60.0
        short = [key for key in keys if covered.get(key, 0.0) < rule.baseline_min_coverage]
        if not short or not self.series.has_history or last - first < 60.0:
            return {}
        if not longer:  # only series the windows have watched since they began
            watched = now - began
            _, answer = self.statistic(rule, watched, now, source="windows")
            present = coverage(answer)
            interval = self.series.interval_seconds
            short = [key for key in short
                     if present.get(key, 0.0) * watched >= watched - 2.0 * interval]
        cached = self._trailing_history.get(rule.name)
        if short and (cached is None or cached.span != (first, last)):
            try:
                past, answer = self.statistic(rule, last - first, last, source="history")
                cached = HistoryRead((first, last), past, coverage(answer))
            except (RuntimeError, ValueError):  # the store cannot be read
                cached = HistoryRead((first, last), {}, {})
            self._trailing_history[rule.name] = cached
        whence = (" (from the history's minutes)" if longer
                  else " (its minutes before the daemon's windows begin, from the history)")
        return {key: (cached.values[key],
                      min(1.0, covered.get(key, 0.0)
                          + cached.coverage.get(key, 0.0) * (last - first) / span), whence)
                for key in short if cached is not None and key in cached.values}
