"""The daemon: a collection cycle every interval, the latest snapshot, windows, queries.

A cycle starts every collector at once, gathers what each returns within its timeout,
adds the daemon's own series (collector health, stream utilisation, build info) and
publishes the snapshot that /metrics serves. Rendering is lazy and cached per snapshot.
"""
from __future__ import annotations

import gc
import gzip
import logging
import math
import sys
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from ac_observe import __version__
from ac_observe import metrics as m
from ac_observe.collectors.attribution import Attribution
from ac_observe.collectors.base import Collector, build, new_counter, new_gauge
from ac_observe.collectors.scrape.table import KIND_TITLES, exports
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.exposition import Renderer
from ac_observe.daemon.http_server import Refusals
from ac_observe.daemon.query import QueryEngine
from ac_observe.daemon.reload import alerting_setup
from ac_observe.daemon.runner import CollectorRunner
from ac_observe.daemon.scrape_pace import ScrapePace
from ac_observe.daemon.series_budget import SeriesBudget
from ac_observe.daemon.windows import Frame, Windows
from ac_observe.friendly import FRIENDLY, Friendly, query_labels, watched_families

if TYPE_CHECKING:  # imported when the daemon has alerts, history or a store
    from ac_observe.daemon.alerting.evaluator import Evaluator
    from ac_observe.daemon.alerting.outbox import WebhookSender
    from ac_observe.daemon.history import HistoryWriter, MinuteAggregator
    from ac_observe.daemon.store import Store

log = logging.getLogger("ac_observe.daemon")


# The collection cycle is pure Python; a short GIL switch interval lets scrape threads in
# within a millisecond instead of queueing behind it for 5 ms slices (p99 at 10k series:
# ~50 ms -> ~10 ms in bench/daemon_cost.py).
SWITCH_INTERVAL_SECONDS = 0.001


# A cycle at 10k series makes and drops ~10k objects (samples, their keys), nearly all freed
# by reference counting; at the default gen0 threshold (700) the cyclic collector ran ~15
# times a cycle, 10-15 % of its CPU (bench/daemon_cost.py, 12 engines).
GC_THRESHOLDS = (50_000, 20, 20)


def tune_interpreter() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    gc.set_threshold(*GC_THRESHOLDS)


class HistoryUnavailable(RuntimeError):
    """A query that needs the store's history while the store cannot be read."""


class WindowTooLong(ValueError):
    """A window reaching further back than the history is kept."""


class Daemon:
    def __init__(self, config: DaemonConfig, collectors: list[Collector] | None = None):
        self.config = config
        self.collectors = collectors if collectors is not None else build(config.collectors,
                                                                            config=config)
        self.runners = [CollectorRunner(c, config.collector_timeout_seconds)
                        for c in self.collectors]
        self._reporting: dict[str, bool] = {}  # collector -> up in the last cycle
        self.budget = SeriesBudget(config.max_series)
        self.attribution = Attribution(socket_path=config.pod_resources_socket)
        self.windows = Windows(max(2, round(config.window_seconds / config.interval_seconds)))
        self.queries = QueryEngine(self.windows, config.interval_seconds)
        self._watched = watched_families()
        self._lock = threading.Lock()
        self._snapshot: list[Metric] = []
        self._generation = 0
        self._rendered: tuple[int, bytes] = (-1, b"")
        self._renderer = Renderer({m.NODE_LABEL: config.node_name})
        self._render_lock = threading.Lock()
        self._pace, self._gzip_pace = ScrapePace(), ScrapePace()
        self._gzipped: tuple = (None, b"")  # (the text object, its gzip)
        self._gzip_lock = threading.Lock()
        self._busy_previous: dict[tuple, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Alert rules are evaluated on their own thread once the daemon is started (a rule
        # reading days of history never delays a cycle); driven by hand, in the cycle.
        self._alert_thread: threading.Thread | None = None
        self._alert_wake = threading.Event()
        self._alert_now = 0.0
        self.webhooks: WebhookSender | None = None
        self.alerts: Evaluator | None = None
        self.store: Store | None = None
        # NOTE: history and history_writer are both set or both None, and set only with
        # a store.
        self.history: MinuteAggregator | None = None
        self.history_writer: HistoryWriter | None = None
        self.last_reload = (True, time.time())  # (took, when one last took): ConfigReloader
        self.http_refusals = Refusals()  # counted by the HTTP server, exported each cycle
        # AlertConfigError (a ValueError) names the file and field: fail fast.
        receivers, rules = alerting_setup(config)
        # An alerting file, even one with no rules, runs the alerting: a reload fills it.
        alerting = bool(receivers or rules or config.alerting_file is not None)
        if alerting or config.history:
            from ac_observe.daemon.store import Store
            try:
                self.store = Store(config.store_url, config.state_dir)
            except Exception as exc:
                if alerting or config.store_url is not None:
                    raise  # alerts without their store would lose state; a named store
                    # (PostgreSQL) that is not up yet is an error, not a reason to go on
                    # without history: fail fast either way
                log.warning("history is off: its store cannot be opened (%s: %s); queries "
                            "reach back only as far as the in-memory windows",
                            type(exc).__name__, str(exc)[:200])
        if config.history and self.store is not None:  # (history alone runs on without it)
            from ac_observe.daemon.history import HistoryWriter, MinuteAggregator
            self.history = MinuteAggregator()
            self.history_writer = HistoryWriter(self.store, config.history_retention_seconds)
        if self.store is not None:
            self.store.outage.kept = (
                "history waits in memory (up to a day), alert transitions are tried again "
                "at each evaluation, deliveries wait in the outbox")
        if alerting:
            from ac_observe.daemon.alerting.evaluator import Evaluator
            from ac_observe.daemon.alerting.outbox import WebhookSender
            assert self.store is not None  # alerts never run without it: it raised above
            self.webhooks = WebhookSender(self.store, receivers,
                                          external_url=f"http://{config.host}:{config.port}")
            self.alerts = Evaluator(self, rules, self.store, self.webhooks,
                                    config.alert_interval_seconds)

    # ----- the cycle ----------------------------------------------------------------------

    def run_cycle(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for runner in self.runners:
            runner.start()
        families: list[Metric] = []
        returning: list[Metric] = []
        counted_before_seen: list[tuple[list[Metric], list[dict]]] = []
        subsets: list[dict[str, str]]
        for runner in self.runners:
            got = runner.finish()
            if runner.up and not self._reporting.get(runner.name):
                returning.extend(got)  # up for the first time, or again after an outage
            elif runner.up and (subsets := getattr(runner.collector, "counted_before_seen",
                                                   list)()):
                # e.g. an engine back, its process the same
                counted_before_seen.append((got, subsets))
            self._reporting[runner.name] = runner.up
            families.extend(got)
        # Per-process series (and a bundled engine's, through its process): container, pod.
        self.attribution.label(families, self._engine_processes())
        self.budget.admit(families)  # in place: `returning` and the rest see it too
        families.extend(self._utilization(families, now))
        families.extend(self._self_metrics())
        watched = self._watched_samples(families)
        preexisting = self._preexisting(returning, counted_before_seen)
        if self.alerts is None:
            with self._lock:  # queries see a window and a snapshot from one and the same cycle
                self._remember(now, watched, preexisting)
                self._snapshot = families
                self._generation += 1
        else:
            with self._lock:
                self._remember(now, watched, preexisting)
            if self.alerts.due(now):
                if self._alert_thread is None:
                    self.alerts.evaluate(now)  # reads the windows just appended
                else:
                    self._alert_now = now
                    self._alert_wake.set()
            families.extend(self._alert_metrics(self.alerts))  # the last evaluation's states
            with self._lock:
                self._snapshot = families
                self._generation += 1
        generation = self._generation
        if self._gzip_pace.due(generation):
            self.render_metrics_gzip(scrape=False)  # a scrape then only copies bytes
        elif self._pace.due(generation):
            self.render_metrics(scrape=False)

    def _engine_processes(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for runner in self.runners:
            if runner.up and hasattr(runner.collector, "processes"):
                found.update(runner.collector.processes())
        return found

    def _preexisting(self, returning: list[Metric],
                     counted_before_seen: list[tuple[list[Metric], list[dict]]]) -> set:
        """A collector's first cycle up, and its first after an outage: the counters it
        reports then have a past the daemon did not see (an engine up for days, found
        now); a new one among them is a base, not an increase from zero."""
        preexisting = set(self._watched_samples(returning).keys()) if returning else set()
        for got, subsets in counted_before_seen:
            for key in self._watched_samples(got).keys():
                labels = dict(key[1])
                if any(all(labels.get(k) == v for k, v in s.items()) for s in subsets):
                    preexisting.add(key)
        return preexisting

    def _remember(self, now: float, watched: Frame, preexisting=()) -> None:
        """The cycle into the windows and the minute's history (under the lock)."""
        self.windows.append(now, watched, preexisting)
        if self.history is not None:
            assert self.history_writer is not None  # set together
            self.history_writer.submit(self.history.add(now, watched, preexisting))

    def _utilization(self, families: list[Metric], now: float) -> list[Metric]:
        """Busy fraction of each lane's stream over the last interval, from busy-time deltas."""
        gauge = new_gauge(m.STREAM_UTILIZATION)
        current = {}
        for family in families:
            if family.name != m.STREAM_BUSY.family:
                continue
            for sample in family.samples:
                labels = tuple(sample.labels.get(label, "")
                               for label in m.STREAM_UTILIZATION.labels)
                current[labels] = (now, sample.value)
                previous = self._busy_previous.get(labels)
                if previous and now > previous[0] and sample.value >= previous[1]:
                    busy = (sample.value - previous[1]) / (now - previous[0])
                    gauge.add_metric(list(labels), min(1.0, busy))
        self._busy_previous = current
        return [gauge] if gauge.samples else []

    def _self_metrics(self) -> list[Metric]:
        up = new_gauge(m.COLLECTOR_UP)
        duration = new_gauge(m.COLLECTOR_DURATION)
        errors = new_counter(m.COLLECTOR_ERRORS)
        for runner in self.runners:
            up.add_metric([runner.name], 1.0 if runner.up else 0.0)
            duration.add_metric([runner.name], runner.duration_seconds)
            errors.add_metric([runner.name], runner.errors_total)
        info = new_gauge(m.BUILD_INFO)
        info.add_metric([__version__], 1.0)
        took, when = self.last_reload
        reloaded, reload_time = (new_gauge(m.CONFIG_RELOAD_SUCCESSFUL),
                                 new_gauge(m.CONFIG_RELOAD_SUCCESS_TIME))
        reloaded.add_metric([], 1.0 if took else 0.0)
        reload_time.add_metric([], when)
        refused = new_counter(m.HTTP_REFUSED)
        for reason, count in self.http_refusals.counts().items():
            refused.add_metric([reason], count)
        return [up, duration, errors, info, reloaded, reload_time, refused,
                *self.budget.metrics(), *self._webhook_metrics()]

    def _alert_metrics(self, alerts: Evaluator) -> list[Metric]:
        firing = new_gauge(m.ALERTS_FIRING)
        counts = alerts.firing_counts  # published by each evaluation: no lock waited on
        for (rule, severity), count in sorted(counts.items()):
            firing.add_metric([rule, severity], count)
        return [firing] if firing.samples else []

    def _webhook_metrics(self) -> list[Metric]:
        families: list[Metric] = []
        sender = self.webhooks
        if sender is None or not sender.outcomes:  # (an alerting file with no receivers)
            return families
        deliveries = new_counter(m.WEBHOOK_DELIVERIES)
        for (receiver, outcome), count in sorted(sender.outcomes.items()):
            deliveries.add_metric([receiver, outcome], count)
        depth, oldest = new_gauge(m.WEBHOOK_QUEUE_DEPTH), new_gauge(m.WEBHOOK_OLDEST_PENDING)
        queue = sender.queue  # refreshed by the sender's own thread: no store call here
        for receiver in sorted(sender.receivers):
            count, age = queue.get(receiver, (0, 0.0))
            depth.add_metric([receiver], count)
            oldest.add_metric([receiver], age)
        return families + [deliveries, depth, oldest]

    def _watched_samples(self, families: list[Metric]) -> Frame:
        frame = Frame()
        for family in families:
            if family.name in self._watched:
                blocks = getattr(family, "blocks", None)
                if blocks is not None:  # keyed and laid out by its collector (the engines')
                    frame.blocks += blocks
                    continue
                for sample in family.samples:
                    # Collectors emit each series' labels in one stable order.
                    frame.loose[(sample.name, tuple(sample.labels.items()))] = sample.value
        return frame

    # ----- reading ------------------------------------------------------------------------

    def render_metrics(self, scrape: bool = True) -> bytes:
        """The latest snapshot as Prometheus text; a render runs once per snapshot.

        A scrape that arrives while the cycle is rendering gets the previous complete
        snapshot at once instead of waiting for the new one.
        """
        if scrape:
            self._pace.scraped(self._generation)
        return self._text(wait=not scrape)

    def render_metrics_gzip(self, scrape: bool = True) -> bytes:
        """render_metrics, gzipped (Prometheus asks for it): compressed once per snapshot,
        at zlib's fastest level (a tenth of the bytes for ~5 ms a MiB)."""
        if scrape:
            self._gzip_pace.scraped(self._generation)
        text = self._text(wait=not scrape)
        compressed = self._gzipped
        if compressed[0] is text:
            return compressed[1]
        with self._gzip_lock:  # 40 scrapes of a snapshot not compressed yet: one compress
            compressed = self._gzipped
            if compressed[0] is not text:
                compressed = self._gzipped = (text, gzip.compress(text, compresslevel=1,
                                                                  mtime=0))
            return compressed[1]

    def _text(self, wait: bool) -> bytes:
        if wait:
            self._render_lock.acquire()
        elif not self._render_lock.acquire(blocking=False):
            previous = self._rendered
            if previous[0] >= 0:
                return previous[1]
            self._render_lock.acquire()
        try:
            with self._lock:
                generation, families = self._generation, self._snapshot
            if self._rendered[0] != generation:
                self._rendered = (generation, self._renderer.render(families))
            return self._rendered[1]
        finally:
            self._render_lock.release()

    def rendered_metrics(self, gzipped: bool = False) -> bytes | None:
        """The latest snapshot's Prometheus text (or its gzip) if it is made already, else
        None: what the HTTP server answers from its event loop without a thread hop or a
        wait."""
        generation, body = self._rendered
        if generation != self._generation:
            return None
        if gzipped:
            compressed = self._gzipped
            if compressed[0] is not body:
                return None
            self._gzip_pace.scraped(generation)
            return compressed[1]
        self._pace.scraped(generation)
        return body

    def query(self, metric: str, window_seconds: float, labels: dict[str, str],
              now: float | None = None, shares: dict[str, float] | None = None,
              source: str = "auto") -> dict:
        """`_query`'s answer with the daemon's `node` first on every series, as on export
        (the windows and the history never hold it): a filter on another node matches
        nothing, one on this node everything."""
        node = self.config.node_name
        wanted = labels.get(m.NODE_LABEL, node)
        answer = self._query(metric, window_seconds,
                             {k: v for k, v in labels.items() if k != m.NODE_LABEL},
                             now, shares, source)
        if wanted != node:
            answer["series"] = []
            answer.pop("not_exported", None)
        for series in answer["series"]:
            series["labels"] = {m.NODE_LABEL: node, **series["labels"]}
        return answer

    def _query(self, metric: str, window_seconds: float, labels: dict[str, str],
               now: float | None = None, shares: dict[str, float] | None = None,
               source: str = "auto") -> dict:
        """A window within the in-memory hour is answered from the windows; a longer one,
        or one that ended before the windows begin, from the store's per-minute history.
        `source` "windows" or "history" (if the daemon keeps one) asks one of them alone.

        NOTE: the view is copied under the lock the cycle appends under, so an answer
        reads one state; the answer is computed after the lock is released."""
        friendly = FRIENDLY[metric]
        until = time.time() if now is None else now
        since = until - window_seconds
        names = friendly.sample_names()
        if self.history is not None and source != "windows" and (
                source == "history" or window_seconds > self.config.window_seconds
                or until < self.windows.earliest_time):
            kept = self.config.history_retention_seconds
            if until - since > kept or since < time.time() - kept - 60.0:
                raise WindowTooLong(f"the window reaches back further than the history is "
                                    f"kept ({kept / 86400:g} days; --history-retention)")
            view = self._history_view(names, since, until)
        else:
            with self._lock:
                view = self.windows.view(names, since, now)
        answer = self.queries.answer(view, friendly, window_seconds, since, labels, shares)
        if friendly.fallbacks:
            self._add_fallbacks(answer, friendly, window_seconds, labels, now, shares, source)
        missing = self._not_exported(friendly, answer, labels)
        if missing:
            answer["not_exported"] = missing
        return answer

    def _not_exported(self, friendly: Friendly, answer: dict,
                      labels: dict[str, str]) -> list[dict]:
        """The scraped engines that have no series of the name because their kind never
        exports it (a vLLM's stream utilisation), each with that said, so the CLI shows
        why, not an empty table or a zero."""
        if friendly.source.source != "engine" and friendly.source is not m.STREAM_UTILIZATION:
            return []
        answered = {s["labels"].get("engine") for s in answer["series"]}
        out = []
        for runner in self.runners:
            if runner.name != "scrape":
                continue
            for engine in getattr(runner.collector, "status", list)():
                kind = engine.get("kind")
                if kind not in KIND_TITLES or engine["engine"] in answered or \
                        exports(kind, friendly) or \
                        any(engine.get(k, v) != v for k, v in labels.items()
                            if k in ("engine", "kind")):
                    continue
                out.append({"engine": engine["engine"], "kind": kind,
                            "reason": f"not exported by {KIND_TITLES[kind]}"})
        return out

    def _add_fallbacks(self, answer: dict, friendly: Friendly, window_seconds: float,
                       labels: dict[str, str], now: float | None,
                       shares: dict[str, float] | None, source: str) -> None:
        """An engine with no series of the name (a vLLM has no block counts) answered by
        the first fallback it has (tokens, then its own gauge), each series saying which
        (`basis`)."""
        primary = friendly.fallbacks and friendly.source.unit or ""
        for series in answer["series"]:
            series["basis"] = primary
        answered = {s["labels"].get("engine") for s in answer["series"]}
        for basis, name in friendly.fallbacks:
            other = FRIENDLY[name]
            if not set(labels) <= set(query_labels(other)):
                continue  # filtered on a label it lacks (a skeleton): nothing of its own
            extra = self._query(name, window_seconds, labels, now, shares, source)
            for series in extra["series"]:
                if series["labels"].get("engine") not in answered:
                    series["basis"] = basis
                    answer["series"].append(series)
                    answered.add(series["labels"].get("engine"))

    def _history_view(self, names: set[str], since: float, until: float):
        from ac_observe.daemon.history import build_view, group_minute, history_step, merge_minutes
        first, last = int(since // 60), math.ceil(until / 60) - 1
        step = history_step(until - since)
        # Asked for only while the daemon keeps history (see query): all three are set.
        assert self.history is not None and self.history_writer is not None
        assert self.store is not None
        with self.history_writer.io_lock:  # no minute both in the store and still queued
            try:
                minutes = self.store.read_minutes(names, first, last, step)
            except Exception as exc:  # StoreUnavailable says why; anything else, what
                raise HistoryUnavailable(f"the daemon's store is unreachable: "
                                         f"{str(exc) or type(exc).__name__}") from None
            with self._lock:  # the cycle hands a finished minute over under this lock
                unwritten = self.history_writer.unwritten()
                current = self.history.current()
        for minute, rows, *_ in unwritten + ([current] if current else []):
            if first <= minute <= last:  # into its group's row, as the database folds
                merge_minutes(minutes, group_minute(minute, first, step), rows, names)
        return build_view(minutes, self.history.kinds, first, last,
                          (current[0], current[2]) if current else None, step)

    # ----- what the alerting reads (alerting.baselines.SeriesSource) -------------------------

    @property
    def interval_seconds(self) -> float:
        return self.config.interval_seconds

    @property
    def window_seconds(self) -> float:
        return self.config.window_seconds

    @property
    def has_history(self) -> bool:
        return self.history is not None

    @property
    def windows_began(self) -> float:
        return self.windows.earliest_time

    def status(self) -> dict:
        engines: list[dict] = []
        for collector in self.collectors:
            engines.extend(getattr(collector, "status", lambda: [])())
        with self._lock:
            as_of = self.windows.latest_time
        return {"version": __version__, "node": self.config.node_name,
                "interval_seconds": self.config.interval_seconds,
                "as_of": as_of,  # the newest cycle: pin queries to it with at=
                "window_seconds": self.config.window_seconds,
                "telemetry_root": str(self.config.telemetry_root),
                "history": self.history is not None,
                "collectors": [{"name": r.name, "up": r.up, "reason": r.reason,
                                "errors_total": r.errors_total,
                                "duration_seconds": round(r.duration_seconds, 6)}
                               for r in self.runners],
                "attribution": self.attribution.status(),
                "engines": engines}

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if self.alerts is not None:  # before the first cycle, which hands evaluations to it
            self._alert_thread = threading.Thread(target=self._alert_loop, name="ac-alerts",
                                                  daemon=True)
            self._alert_thread.start()
        self._thread = threading.Thread(target=self._loop, name="ac-daemon-loop", daemon=True)
        self._thread.start()
        if self.webhooks is not None:
            self.webhooks.start()
        if self.history_writer is not None:
            self.history_writer.start()

    def _alert_loop(self) -> None:
        alerts = self.alerts
        assert alerts is not None  # the thread runs only when there are rules
        while not self._stop.is_set():
            self._alert_wake.wait()
            self._alert_wake.clear()
            if self._stop.is_set():
                break
            try:
                alerts.evaluate(self._alert_now, stop=self._stop)
            except Exception:  # the thread itself must never die
                log.exception("alert evaluation failed")

    def _loop(self) -> None:
        interval = self.config.interval_seconds
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                self.run_cycle()
            except Exception:  # the loop itself must never die
                log.exception("collection cycle failed")
            next_tick += interval
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind: skip missed ticks rather than burst
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def close(self) -> None:
        self._stop.set()
        self._alert_wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._alert_thread is not None:
            # It stops between rules; one rule's read can take a while (days of history).
            self._alert_thread.join(timeout=60)
            if self._alert_thread.is_alive():
                log.warning("an alert rule is still being evaluated; closing the store anyway")
        if self.webhooks is not None:
            self.webhooks.stop()
        if self.history_writer is not None:
            assert self.history is not None  # set together
            with self._lock:
                last = self.history.flush()
            self.history_writer.stop(last)
        if self.store is not None:
            self.store.close()
        for runner in self.runners:
            runner.close()
