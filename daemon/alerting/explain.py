"""Why an alert fired: the change of its series' window against its baseline span, split
into the additive parts of a request's time, with the causes that move them.

Means are additive, quantiles are not: a request's TTFT is front-end + queue + prefill
phase (first scheduled to first token), and its end-to-end time that + decode phase (first
token to finish), so the MEAN of the window (a histogram's sum over its count, both as
increases over the span) is the sum of the parts' means, and the change of the mean the
sum of the parts' changes. Each part's share is its change over the mean's change (not
over the new total). What the parts leave out (a part that is missing, delivery after the
first token, populations that differ at a span's edges) is the `unexplained` part. The
rule's own statistic (p95, say) is reported beside, never split.

For a KV hit-rate rule the fall of the rate splits the same way into the rise of the
share of lookups that missed for each reason (evicted, cold, diverged: together with the
hits they are every lookup), with each skeleton's hit rate beside.

Every figure is read through `SeriesSource.query`, as the evaluator's values and
baselines are (windows for recent spans, the store's history for older ones). A figure
without data is None, shown "missing", never 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ac_observe.daemon.alerting.baselines import SeriesSource
from ac_observe.daemon.alerting.rules import (
    DEFAULT_BASELINE_SECONDS,
    SAME_HOUR_SPAN_SECONDS,
    Rule,
    figure,
)
from ac_observe.friendly import FRIENDLY, LATENCY_PARTS, TITLES, query_labels
from ac_observe.metrics import KIND_GATEWAY, MISS_REASONS, NO_SKELETON, PHASES, UPSTREAM_LABEL

# Labels that name an alert's series (its engine and lane): a figure is read for those of
# them its series carry; a device figure (NVML, eBPF) carries none and is node-wide.
SERIES_KEYS = ("engine", "model", "kind", "stream", "pid", "upstream")
MISSING = "missing"
HIT_RATE_METRICS = ("kv_cache_hit_rate", "kv_cache_token_hit_rate")
# A cause is named in the verdict once it moved at least this much (ratio, either way).
NOTABLE_RATIO = 1.25


@dataclass(frozen=True, slots=True)
class Cause:
    group: str      # load, kv, prompts, kernels, device, engine
    name: str       # as the table and the verdict say it
    metric: str     # a friendly name
    combine: str    # its series into one figure: mean (a histogram's, by count), sum, avg
    scale: float = 1.0  # the friendly unit into the one shown
    unit: str = ""
    fixed: tuple = ()   # extra label filter (a reason, a phase)
    worse: int = 1      # which way it moves to slow requests down: +1 up, -1 down


CAUSES = (
    Cause("load", "requests/s", "requests_per_second", "sum", unit="req/s"),
    Cause("load", "prompt tokens/s", "prompt_tokens_per_second", "sum", unit="tok/s"),
    Cause("load", "running", "requests_running", "avg"),
    Cause("load", "waiting", "requests_waiting", "avg"),
    # Sequences per step (the bundled engine's; vLLM and SGLang export none: missing):
    # a bigger batch makes each step, so each request's every token, slower.
    *[Cause("load", f"{phase} batch", "batch_sequences", "mean", unit="seqs",
            fixed=(("phase", phase),)) for phase in PHASES],
    Cause("kv", "hit rate", "kv_cache_hit_rate", "avg", unit="%", worse=-1),
    Cause("kv", "token hit rate", "kv_cache_token_hit_rate", "avg", unit="%", worse=-1),
    *[Cause("kv", f"misses {reason}", "kv_cache_miss_reasons", "avg", unit="%",
            fixed=(("reason", reason),)) for reason in MISS_REASONS],
    Cause("kv", "evictions/s", "kv_cache_eviction_rate", "sum", unit="blocks/s"),
    Cause("kv", "preemptions/s", "preemptions_per_second", "sum", unit="1/s"),
    Cause("prompts", "skeleton depth", "skeleton_complexity", "mean", unit="levels"),
    *[Cause("kernels", f"{phase} kernels ms/step", "kernel_time_ms", "sum",
            unit="ms", fixed=(("phase", phase),)) for phase in PHASES],
    Cause("device", "sync wait", "sync_wait_ns", "mean", 1e-6, "ms"),
    Cause("device", "GPU util", "gpu_utilization", "avg", unit="%"),
    Cause("device", "SM clock", "gpu_sm_clock_hertz", "avg", 1e-6, "MHz", worse=-1),
    Cause("device", "power", "gpu_power_watts", "avg", unit="W"),
    Cause("device", "XID errors/s", "gpu_xid_error_rate", "sum", unit="1/s"),
    Cause("engine", "restarts/s", "engine_restart_rate", "sum", unit="1/s"),
    # How fast the lane's steps come as its requests see them: a slower engine (its
    # queue waits on slower steps too) shows here when its load did not grow.
    Cause("engine", "inter-token", "inter_token_latency_ms", "mean", unit="ms"),
)
# Which causes move which part: the verdict names the ones that moved most among them.
RELATED = {"queue": ("load", "engine"), "front-end": ("load",),
           "prefill": ("kv", "prompts", "kernels", "load", "device", "engine"),
           "decode": ("load", "kernels", "device", "engine"),
           "decode step": ("load", "kernels", "device", "engine"),
           "delivery": ("load",), "unexplained": ("load", "device", "engine"),
           "evicted": ("kv", "load"), "cold": ("prompts", "load", "kv"),
           "diverged": ("prompts", "kv")}


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def spans(rule: Rule, alert: dict, now: float,
          held_seconds: float = math.inf) -> tuple[Span, Span, str]:
    """(the window, the baseline span, where it is): the span the alert's baseline was
    read over when it went pending (it stays frozen while the alert is active); for a
    rule that reads none, the hour before the window, or what the in-memory windows
    (`held_seconds`) hold of it."""
    window = Span(now - rule.window_seconds, now)
    anchor = alert.get("active_since") or now
    source = alert.get("baseline_source") or ""
    if source.startswith("same hour yesterday"):
        span = max(rule.window_seconds, SAME_HOUR_SPAN_SECONDS)
        end = anchor - 86400.0 - rule.window_seconds / 2 + span / 2
        return window, Span(end - span, end), source
    seconds = rule.baseline_seconds if rule.reads_baseline else max(
        rule.window_seconds, min(DEFAULT_BASELINE_SECONDS, held_seconds - rule.window_seconds))
    end = anchor - rule.window_seconds
    whence = (source or f"trailing {figure(seconds)} s before the window") \
        if rule.reads_baseline else f"the {figure(seconds)} s before the window (the rule " \
                                    "reads no baseline)"
    return window, Span(end - seconds, end), whence


class Reader:
    """One explanation's reads: a friendly name's series over a span, filtered by the
    alert's series labels that the name's series carry."""

    def __init__(self, series: SeriesSource, labels: dict):
        self.series, self.labels = series, labels

    def answer(self, metric: str, span: Span, extra: dict | None = None) -> list[dict]:
        own = query_labels(FRIENDLY[metric])
        wanted = {k: v for k, v in self.labels.items() if k in SERIES_KEYS and k in own}
        wanted.update(extra or {})
        try:
            return self.series.query(metric, span.seconds, wanted, now=span.end)["series"]
        except (RuntimeError, ValueError, KeyError):  # the store unreachable, too far back
            return []

    def value(self, metric: str, span: Span, combine: str, extra: dict | None = None):
        """One figure of the name over the span, or None (no series, no observations)."""
        found = self._finite(metric, span, extra)
        if not found:
            return None
        if combine == "mean":  # a histogram: by its observations
            return _by_observations(found)[0]
        means = [s["mean"] for s in found]
        if combine == "sum":  # rates of several series (statuses, GPUs); a step's
            return sum(means)  # kernel classes, whose times add up
        return sum(means) / len(means)

    def histogram(self, metric: str, span: Span) -> tuple[float | None, int]:
        """(the mean in seconds, observations) of a time histogram over the span."""
        mean, count = _by_observations(self._finite(metric, span))
        return (None, 0) if mean is None else (mean / FRIENDLY[metric].scale, count)

    def arrivals(self, metric: str, span: Span) -> float | None:
        """A histogram's observations a second: each series' own rate over the time it
        was watched in the span (the query's `rate`), summed; or None."""
        rates = [s["rate"] for s in self._finite(metric, span) if _finite(s.get("rate"))]
        return sum(rates) if rates else None

    def _finite(self, metric: str, span: Span, extra: dict | None = None) -> list[dict]:
        return [s for s in self.answer(metric, span, extra) if _finite(s.get("mean"))]


def _by_observations(series: list[dict]) -> tuple[float | None, int]:
    """(the series' means weighted by their observations, the observations); (None, 0)
    when none were made."""
    count = sum(s.get("samples") or 0 for s in series)
    if not count:
        return None, 0
    return sum(s["mean"] * (s.get("samples") or 0) for s in series) / count, count


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _change(baseline, now):
    return None if baseline is None or now is None else now - baseline


def explain(rule: Rule, alert: dict, series: SeriesSource, now: float) -> dict:
    """The explanation of one active alert (a dict as `active()` lists it: rule,
    fingerprint, labels, value, baseline, baseline_source, active_since)."""
    window, base, whence = spans(rule, alert, now, series.window_seconds)
    reader = Reader(series, alert["labels"])
    upstream = _upstream(series, alert["labels"], window)
    # A gateway's parts and causes are its upstream engine's (it has no queue or KV of its
    # own), means over all that engine's clients: the residual is its hop and the rest.
    source = upstream or reader
    value, baseline = alert.get("value"), alert.get("baseline")
    if not rule.reads_baseline:  # compared with its threshold: no baseline of its own
        baseline = None
    out = {"rule": rule.name, "fingerprint": alert.get("fingerprint", ""),
           "metric": rule.metric, "labels": alert["labels"],
           "window": {"start": window.start, "end": window.end},
           "baseline_span": {"start": base.start, "end": base.end, "source": whence},
           "statistic": {"name": rule.statistic, "comparison": rule.comparison,
                         "threshold": rule.threshold,
                         "unit": FRIENDLY[rule.metric].statistic_unit(rule.statistic),
                         "baseline": baseline, "now": value,
                         "change_percent": (100.0 * (value - baseline) / abs(baseline)
                                            if value is not None and baseline else None)}}
    if upstream is not None:
        out["parts_from"] = alert["labels"][UPSTREAM_LABEL]
    if rule.metric in LATENCY_PARTS:
        out.update(_latency_split(rule.metric, reader, window, base, source))
    elif rule.metric in HIT_RATE_METRICS:
        out.update(_hit_rate_split(rule.metric, reader, window, base))
    else:
        out.update(split=None, parts=[], note=f"no split of {rule.metric}: causes only")
    out["causes"] = causes = [_cause(cause, source, window, base) for cause in CAUSES]
    by_name = {c["name"]: c for c in causes}
    # The bundled engine counts prompt tokens as a request is first scheduled, when its
    # queue time is observed: per request admitted then (requests/s counts those finished,
    # fewer than admitted while a burst fills the queue); vLLM observes the queue time at
    # the finish; per request finished where no queue time is.
    tokens, requests = by_name["prompt tokens/s"], by_name["requests/s"]
    admitted = {"baseline": source.arrivals("queue_time_ns", base),
                "now": source.arrivals("queue_time_ns", window)}
    per_request = {key: tokens[key] / (admitted[key] or requests[key])
                   if tokens[key] is not None and (admitted[key] or requests[key]) else None
                   for key in ("baseline", "now")}
    causes.append({"group": "prompts", "name": "prompt tokens/request", "metric": "",
                   "unit": "tok", **per_request})
    # The offered load: requests that reached the engine's queue (its front-end's
    # observations) a second; requests/s counts those finished, which an overloaded
    # engine may finish fewer of.
    causes.append({"group": "load", "name": "arrivals/s", "metric": "", "unit": "req/s",
                   "baseline": source.arrivals("frontend_ns", base),
                   "now": source.arrivals("frontend_ns", window)})
    hits = by_name["token hit rate"]
    causes.append({"group": "kv", "name": "cached tokens/request", "metric": "", "unit": "tok",
                   "worse": -1, **{key: per_request[key] * hits[key] / 100.0
                                   if per_request[key] is not None and hits[key] is not None
                                   else None for key in ("baseline", "now")}})
    out["verdict"] = verdict(out)
    return out


def _upstream(series: SeriesSource, labels: dict, window: Span) -> Reader | None:
    """A gateway's upstream engine (its lane), when the daemon reads it: it has requests
    in the window. None for anything else, or an upstream known by its address only."""
    name = labels.get(UPSTREAM_LABEL)
    if labels.get("kind") != KIND_GATEWAY or not name:
        return None
    lane = {"stream": labels["stream"]} if "stream" in labels else {}
    reader = Reader(series, {"engine": name, **lane})
    return reader if reader.histogram("inference_latency_ns", window)[1] else None


def _latency_split(metric: str, reader: Reader, window: Span, base: Span,
                   parts_reader: Reader | None = None) -> dict:
    """The mean's change (ms) split into the parts' changes (read by `parts_reader`: a
    gateway's upstream's) and the residual."""
    parts_reader = parts_reader or reader
    total_b, _ = reader.histogram(metric, base)
    total_n, count_n = reader.histogram(metric, window)
    parts, missing = [], []
    for part in LATENCY_PARTS[metric]:
        b, _ = parts_reader.histogram(part.metric, base)
        n, _ = parts_reader.histogram(part.metric, window)
        if b is None or n is None:
            missing.append(part.name)
        parts.append({"name": part.name, "metric": part.metric, "baseline_ms": _ms(b),
                      "now_ms": _ms(n)})
    if metric == "e2e_latency_ms":
        _decode_detail(parts[-1], parts_reader, window, base)
    change = _change(total_b, total_n)
    known = [p for p in parts if p["name"] not in missing]
    residual = {"name": "unexplained", "metric": "",
                "baseline_ms": None if total_b is None else
                1e3 * total_b - sum(p["baseline_ms"] for p in known),
                "now_ms": None if total_n is None else
                1e3 * total_n - sum(p["now_ms"] for p in known)}
    if missing:
        residual["includes_missing"] = missing
    parts.append(residual)
    for p in parts:
        p["change_ms"] = _change(p["baseline_ms"], p["now_ms"])
        p["share"] = (p["change_ms"] / (1e3 * change)
                      if p["change_ms"] is not None and change else None)
    return {"split": "mean", "unit": "ms",
            "mean": {"baseline_ms": _ms(total_b), "now_ms": _ms(total_n),
                     "change_ms": _ms(change), "observations": count_n},
            "parts": parts}


def _decode_detail(part: dict, reader: Reader, window: Span, base: Span) -> None:
    """A decode phase is its gaps between tokens: per output token (the inter-token mean)
    × the gaps per request (inter-token observations over decode observations)."""
    for key, span in (("baseline", base), ("now", window)):
        per_token, gaps = reader.histogram("inter_token_latency_ms", span)
        _, requests = reader.histogram("request_decode_ms", span)
        part[f"{key}_per_token_ms"] = _ms(per_token)
        part[f"{key}_tokens_per_request"] = 1 + gaps / requests if requests else None


def _hit_rate_split(metric: str, reader: Reader, window: Span, base: Span) -> dict:
    """The hit rate's fall (points) split into each miss reason's rise; per skeleton the
    hit rate over each span."""
    rate_b = reader.value(metric, base, "avg")
    rate_n = reader.value(metric, window, "avg")
    parts = []
    for reason in MISS_REASONS:
        b = reader.value("kv_cache_miss_reasons", base, "avg", {"reason": reason})
        n = reader.value("kv_cache_miss_reasons", window, "avg", {"reason": reason})
        if (b is None) != (n is None) and (rate_b is not None and rate_n is not None):
            # a reason with no lookups in one span: none missed for it there
            b, n = b or 0.0, n or 0.0
        parts.append({"name": reason, "metric": "kv_cache_miss_reasons",
                      "baseline": b, "now": n})
    fall = _change(rate_n, rate_b)  # points lost
    known = [p for p in parts if p["baseline"] is not None and p["now"] is not None]
    residual = {"name": "unexplained", "metric": "", "baseline": None, "now": None}
    if rate_b is not None and rate_n is not None and known:
        # hits + misses = lookups: 100 - rate - the reasons' shares is what they leave out
        residual.update(baseline=100.0 - rate_b - sum(p["baseline"] for p in known),
                        now=100.0 - rate_n - sum(p["now"] for p in known))
    parts.append(residual)
    for p in parts:
        p["change"] = _change(p["baseline"], p["now"])
        p["share"] = p["change"] / fall if p["change"] is not None and fall else None
    skeletons = []
    for skeleton in _skeletons(reader, window, base):
        b = reader.value(metric, base, "avg", {"skeleton": skeleton})
        n = reader.value(metric, window, "avg", {"skeleton": skeleton})
        if b is not None or n is not None:
            skeletons.append({"skeleton": skeleton, "baseline": b, "now": n,
                              "change": _change(b, n)})
    skeletons.sort(key=lambda s: s["change"] if s["change"] is not None else math.inf)
    return {"split": "hit rate", "unit": "points",
            "mean": {"baseline": rate_b, "now": rate_n, "change": _change(rate_b, rate_n)},
            "parts": parts, "skeletons": skeletons}


def _skeletons(reader: Reader, window: Span, base: Span) -> list[str]:
    found = {NO_SKELETON}
    for span in (base, window):
        found |= {s["labels"].get("skeleton") for s in
                  reader.answer("skeleton_request_rate", span)} - {None}
    return sorted(found)


def _cause(cause: Cause, reader: Reader, window: Span, base: Span) -> dict:
    extra = dict(cause.fixed)
    b = reader.value(cause.metric, base, cause.combine, extra)
    n = reader.value(cause.metric, window, cause.combine, extra)
    b = None if b is None else b * cause.scale
    n = None if n is None else n * cause.scale
    return {"group": cause.group, "name": cause.name, "metric": cause.metric,
            "unit": cause.unit, "worse": cause.worse, "baseline": b, "now": n}


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


# ----- the verdict ---------------------------------------------------------------------------

def show(value, unit: str = "") -> str:
    """A figure as the table and the verdict print it, "missing" when there is none."""
    if value is None:
        return MISSING
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip() if unit else text


def signed(value, unit: str) -> str:
    if value is None:
        return MISSING
    return ("+" if value >= 0 else "-") + show(abs(value), unit)


def moved(cause: dict, rising: bool = True) -> float:
    """How far a cause moved the way that makes requests slower when the figure split
    rose (`rising`; faster when it fell), as a factor (1: not at all, or the other way;
    0: missing in a span). From or to 0 the factor is 1 + the other figure: waiting
    0 -> 14 moved, 0 -> 0.02 did not."""
    b, n = cause["baseline"], cause["now"]
    if b is None or n is None:
        return 0.0
    if (n - b) * cause.get("worse", 1) * (1 if rising else -1) < 0:
        return 1.0  # moved the other way: no cause of this change
    if b == n:
        return 1.0
    if min(abs(b), abs(n)) == 0:
        return 1.0 + max(abs(b), abs(n))
    return max(abs(n / b), abs(b / n))


def cause_text(cause: dict) -> str:
    b, n = cause["baseline"], cause["now"]
    if b and n and b > 0 and n / b >= 2:
        return f"{cause['name']} {n / b:.1f}x baseline"
    return f"{cause['name']} {show(b)} -> {show(n)}"


def verdict(out: dict) -> str:
    """One line, the part with the largest share first, and the causes that moved most
    among those that move that part."""
    stat = out["statistic"]
    head = f"{TITLES.get(out['metric'], out['metric'])} {stat['name']}"

    def as_shown(value):  # nanoseconds read as milliseconds
        return show(value / 1e6, "ms") if stat["unit"] == "ns" else show(value, stat["unit"])

    if stat["change_percent"] is not None and stat["comparison"].startswith("relative"):
        head += f" {stat['change_percent']:+.0f} %"
    elif stat["baseline"] is not None and stat["now"] is not None:
        head += f" {as_shown(stat['baseline'])} -> {as_shown(stat['now'])}"
    elif stat["now"] is not None:  # against a threshold
        head += f" {as_shown(stat['now'])} ({stat['comparison']} " \
                f"{as_shown(stat['threshold'])})"
    ranked = sorted((p for p in out["parts"] if p["share"] is not None),
                    key=lambda p: -p["share"])
    if not ranked:
        why = "the parts are missing" if out["parts"] else out.get("note", "")
        return f"{head}: no split ({why})"
    top = ranked[0]
    if out["split"] == "mean":
        upstream = out.get("parts_from")
        name = f"{top['name']} time" if not upstream else \
            "the gateway's own time and the rest" if top["name"] == "unexplained" else \
            f"{upstream}'s {top['name']} time"
        what = f"{name} {signed(top['change_ms'], 'ms')} is " \
               f"{100 * top['share']:.0f} % of the mean's change"
    else:
        what = f"{top['name']} misses {signed(top['change'], 'points')} is " \
               f"{100 * top['share']:.0f} % of the fall"
    related = RELATED.get(top["name"], ())
    # not said twice (the residual's "" is no figure: a derived cause has none either)
    split = ({out["metric"]} | {p["metric"] for p in out["parts"]}) - {""}
    # A latency that rose is slowed by causes that moved their worse way; a hit rate's
    # fall by those that moved the way that loses hits (its misses up: the same way).
    rising = out["split"] != "mean" or (out["mean"]["change_ms"] or 0) >= 0
    ordered = sorted((c for c in out["causes"] if c["group"] in related
                      and c["metric"] not in split and moved(c, rising) >= NOTABLE_RATIO),
                     key=lambda c: -moved(c, rising))[:2]
    lead = _prefill_work(out["causes"], top) if top["name"] == "prefill" else \
        _more_arrivals(out["causes"], rising) if top["name"] == "queue" else None
    if lead is not None:
        ordered = [lead, *[c for c in ordered if c is not lead]][:2]
    if ordered:
        what += " (" + ", ".join(cause_text(c) for c in ordered) + ")"
    return f"{head}: {what}"


def _more_arrivals(causes: list[dict], rising: bool) -> dict | None:
    """A queue that grew as more requests arrived: the arrivals lead the verdict's causes
    (the steps slow down under a bigger batch too, but the load came first). None when
    they did not rise notably (a slower engine's closed-loop clients send fewer), or when
    the steps slowed more than the arrivals rose with a decode batch no bigger: the
    engine slowed by itself, and that leads."""
    by_name = {c["name"]: c for c in causes}
    arrivals = by_name.get("arrivals/s")
    if not (arrivals and rising and moved(arrivals) >= NOTABLE_RATIO):
        return None
    step, batch = by_name.get("inter-token"), by_name.get("decode batch")
    if step is not None and batch is not None and None not in (batch["baseline"],
                                                                batch["now"]) \
            and moved(batch) < NOTABLE_RATIO and moved(step) > moved(arrivals):
        return None
    return arrivals


def _prefill_work(causes: list[dict], prefill: dict) -> dict | None:
    """A prefill phase computes the prompt's tokens less those the prefix cache served.
    When those computed per request grew about as much as the prefill time did (the work,
    not its speed, moved: by at least the square root of the time's factor, as attention
    makes a long prompt's prefill grow faster than its tokens), the one of the two that
    added more of them leads the verdict's causes: longer prompts (prompt
    tokens/request), or fewer tokens served from the cache (cached tokens/request; a
    cache flushed, its prefixes evicted). None otherwise: a slower engine computes the
    same tokens in more time."""
    by_name = {c["name"]: c for c in causes}
    prompt, cached = by_name["prompt tokens/request"], by_name["cached tokens/request"]
    figures = (prompt["baseline"], prompt["now"], cached["baseline"], cached["now"],
               prefill["baseline_ms"], prefill["now_ms"])
    if any(f is None for f in figures) or not prefill["baseline_ms"] > 0:
        return None
    work_b, work_n = prompt["baseline"] - cached["baseline"], prompt["now"] - cached["now"]
    if work_b <= 0 or work_n / work_b < max(
            NOTABLE_RATIO, math.sqrt(max(0.0, prefill["now_ms"] / prefill["baseline_ms"]))):
        return None
    added_by_prompts = prompt["now"] - prompt["baseline"]
    added_by_cache = cached["baseline"] - cached["now"]
    return prompt if added_by_prompts >= added_by_cache else cached
