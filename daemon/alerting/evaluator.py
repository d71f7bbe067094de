"""Drift rules evaluated on the daemon's series: every rule, every `interval_seconds`, for
each series its value and baseline (baselines.py) moved through the states (state.py);
each transition written to the store with the deliveries it causes in one transaction.
"""
from __future__ import annotations

import logging
import math
import threading

from ac_observe.daemon.alerting.alert import Alert, fingerprint
from ac_observe.daemon.alerting.baselines import Baseline, BaselineReader, LabelSet, SeriesSource
from ac_observe.daemon.alerting.explain import explain
from ac_observe.daemon.alerting.outbox import WebhookSender
from ac_observe.daemon.alerting.rules import TEMPLATE, Rule, alert_labels, breached, figure
from ac_observe.daemon.alerting.state import (
    ACTIVE,
    FIRING,
    INACTIVE,
    PENDING,
    RESOLVED,
    AlertInstance,
    lack_data,
    observe,
)
from ac_observe.daemon.store import SavedAlert, Store, StoreUnavailable, Transition
from ac_observe.friendly import FRIENDLY

log = logging.getLogger("ac_observe.daemon.alerting")

InstanceKey = tuple[str, str]  # (rule, fingerprint)


def _render(template: str, fields: dict) -> str:
    return TEMPLATE.sub(lambda m: str(fields.get(m.group(1), "")), template)


class Evaluator:
    """Evaluates every rule on the daemon's series (`evaluate`, called by the daemon's
    cycle every `interval_seconds`), keeps instances, writes transitions and deliveries."""

    def __init__(self, series: SeriesSource, rules: list[Rule], store: Store,
                 sender: WebhookSender | None, interval_seconds: float = 5.0):
        self.series = series
        self.rules = {rule.name: rule for rule in rules}
        self.store = store
        self.sender = sender
        self.interval_seconds = interval_seconds
        self.baselines = BaselineReader(series)
        self.instances: dict[InstanceKey, AlertInstance] = {}
        self._last = -math.inf
        self._lock = threading.Lock()
        self._evaluating = threading.Lock()  # an evaluation, against a reload's new rules
        self._orphans: list[SavedAlert] = []
        # fingerprint -> the verdict of an instance this evaluation of its rule may fire,
        # worked out before the lock is taken (explain.py reads many series)
        self._verdicts: dict[str, str] = {}
        # (rule, fingerprint) -> (the evaluation it was worked out at, the explanation)
        self._explained: dict[InstanceKey, tuple[float, dict | None]] = {}
        self._explained_lock = threading.Lock()  # the cache only, never while working out
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
        if self.series.has_history:
            return
        for rule in self.rules.values():
            if not rule.reads_baseline:
                continue
            needed = rule.window_seconds + rule.baseline_min_coverage * rule.baseline_seconds
            if needed > self.series.window_seconds:
                log.warning("alert rule %s: its trailing baseline needs %s s of the in-memory "
                            "windows, which hold %s s (daemon --window), and the history is "
                            "off: it will never have one (lower baseline_min_coverage or the "
                            "baseline, or keep the history)", rule.name, figure(needed),
                            figure(self.series.window_seconds))

    def _load(self) -> None:
        """Pending and firing alerts survive a restart: no second firing delivery. An
        instance whose rule is gone from the file, or whose rule now gives its series
        another label set (labels or severity edited), is retired: a firing one gets its
        resolved notification, so no receiver keeps an alert that nothing will resolve."""
        for saved in self.store.saved_alerts():
            rule = self.rules.get(saved.rule)
            if rule is None or fingerprint(alert_labels(rule, saved.labels)) != \
                    saved.fingerprint:
                self._orphans.append(saved)
                continue
            self.instances[saved.rule, saved.fingerprint] = AlertInstance(
                saved.rule, saved.fingerprint, saved.labels, saved.state, saved.active_since,
                saved.firing_since, saved.value, saved.baseline)

    def _retire_orphans(self, now: float) -> None:
        for saved in list(self._orphans):
            notified = saved.alert_labels or {**saved.labels, "alertname": saved.rule}
            alert = None
            if saved.state == FIRING:
                annotations = dict(saved.annotations or {})
                annotations["resolved_because"] = "its rule was removed or changed"
                alert = Alert(labels=notified, annotations=annotations, status=RESOLVED,
                              starts_at=saved.firing_since or now, ends_at=now)
            transition = Transition(saved.rule, saved.fingerprint, saved.labels, saved.state,
                                    RESOLVED if alert else INACTIVE, now, saved.value,
                                    saved.baseline, "retired: its rule was removed or changed")
            try:
                self._record(transition, None, alert)
            except StoreUnavailable:  # told once by the store's outage
                continue
            except Exception:
                log.exception("alert %s %s: retiring it failed; retried next evaluation",
                              saved.rule, saved.fingerprint)
                continue
            self._orphans.remove(saved)
            log.info("alert %s %s retired (its rule was removed or changed)", saved.rule,
                     saved.fingerprint)

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval_seconds

    def evaluate(self, now: float, stop: threading.Event | None = None) -> None:
        """Every rule once at `now`; a set `stop` (the daemon closing) ends it between rules,
        so nothing is written after the store is closed."""
        with self._evaluating:
            self._evaluate(now, stop)
        self._publish()

    def _evaluate(self, now: float, stop: threading.Event | None) -> None:
        self._last = now
        if self._orphans:
            self._retire_orphans(now)
        for rule in self.rules.values():
            if stop is not None and stop.is_set():
                return
            try:
                values, baselines = self.read_inputs(rule, now)  # reads: no lock held
                verdicts = self._about_to_fire(rule, values, baselines, now)
                with self._lock:  # the HTTP threads read the instances
                    self._verdicts = verdicts
                    try:
                        self._evaluate_rule(rule, values, baselines, now)
                    finally:
                        self._verdicts = {}
            except StoreUnavailable:  # told once by the store's outage
                pass
            except Exception:  # one bad rule never stops the others
                log.exception("rule %s failed to evaluate", rule.name)

    def replace_rules(self, rules: list[Rule]) -> None:
        """A reload's rules, from the next evaluation on (one in progress ends first). An
        instance whose rule is gone, or now gives its series another label set, is
        retired as at a restart (a firing one gets its resolved notification); the others
        keep their state. StoreUnavailable (reading the saved instances): nothing changed."""
        new = {rule.name: rule for rule in rules}
        # The saved instances are read with no evaluation running: one that ended after the
        # read would leave a firing instance retired as the pending one it read.
        with self._evaluating:
            saved = {(s.rule, s.fingerprint): s for s in self.store.saved_alerts()}
            with self._lock:
                kept = {key: instance for key, instance in self.instances.items()
                        if key[0] in new and
                        fingerprint(alert_labels(new[key[0]], instance.labels)) == key[1]}
                orphaned = {(o.rule, o.fingerprint) for o in self._orphans}
                self._orphans += [alert for key, alert in saved.items()
                                  if key in self.instances and key not in kept
                                  and key not in orphaned]
                self.rules, self.instances = new, kept
                self.baselines = BaselineReader(self.series)  # reads are kept per rule name
        self._warn_unreachable()
        self._publish()

    def _publish(self) -> None:
        counts = {(rule.name, rule.severity): 0 for rule in self.rules.values()}
        with self._lock:
            for (name, _), instance in self.instances.items():
                if instance.state == FIRING:
                    counts[name, self.rules[name].severity] += 1
        self.firing_counts = counts

    def read_inputs(self, rule: Rule, now: float) -> tuple[dict[LabelSet, float],
                                                           dict[LabelSet, Baseline]]:
        """(label set -> the window's statistic, label set -> (baseline, its source))."""
        values, _ = self.baselines.statistic(rule, rule.window_seconds, now)
        if not rule.reads_baseline:
            return values, {key: (rule.baseline_value, "static") for key in values}
        return values, self.baselines.read(rule, now, list(values))

    def _about_to_fire(self, rule: Rule, values: dict, baselines: dict,
                       now: float) -> dict[str, str]:
        """fingerprint -> the verdict (explain.py) of each series this evaluation will move
        to firing (as `observe` will find), so its notification carries why; read with no
        lock held, once per firing transition. (Only this thread changes the instances.)"""
        out = {}
        for key, value in values.items():
            labels = dict(key)
            alert_fingerprint = fingerprint(alert_labels(rule, labels))
            instance = self.instances.get((rule.name, alert_fingerprint))
            state = instance.state if instance is not None else INACTIVE
            baseline, source = baselines[key]
            if instance is not None and state in ACTIVE and instance.baseline is not None:
                baseline, source = instance.baseline, instance.baseline_source or source
            if state == FIRING or baseline is None or not breached(rule, value, baseline):
                continue
            since = instance.active_since if instance is not None and state == PENDING \
                else now
            if now - (now if since is None else since) < rule.for_seconds:
                continue
            found = self._explain(rule, {"fingerprint": alert_fingerprint, "labels": labels,
                                         "value": value, "baseline": baseline,
                                         "baseline_source": source, "active_since": since},
                                  now)
            if found is not None:
                out[alert_fingerprint] = found["verdict"]
        return out

    def _explain(self, rule: Rule, alert: dict, now: float) -> dict | None:
        try:
            return explain(rule, alert, self.series, now)
        except Exception:  # an explanation never stops an evaluation or an answer
            log.exception("alert %s %s: its explanation failed", rule.name,
                          alert.get("fingerprint"))
            return None

    def explained(self) -> list[dict]:
        """`active()`, each with its explanation as of the latest evaluation (worked out on
        request, with no lock held, at most once an evaluation per alert)."""
        out = self.active()
        at = self._last
        if not math.isfinite(at):
            return [{**alert, "explanation": None} for alert in out]
        for alert in out:
            key = (alert["rule"], alert["fingerprint"])
            rule = self.rules.get(alert["rule"])
            with self._explained_lock:
                cached = self._explained.get(key)
            if cached is None or cached[0] != at:
                cached = (at, self._explain(rule, alert, at) if rule else None)
                with self._explained_lock:
                    self._explained[key] = cached
            alert["explanation"] = cached[1]
        with self._explained_lock:  # forget those no longer active
            active = {(a["rule"], a["fingerprint"]) for a in out}
            self._explained = {k: v for k, v in self._explained.items() if k in active}
        return out

    def _evaluate_rule(self, rule: Rule, values: dict, baselines: dict, now: float) -> None:
        def move(instance: AlertInstance, to: str) -> bool:
            return self._move(rule, instance, to, now)

        seen = set()
        for key, value in values.items():
            labels = dict(key)
            # As the notification carries it:
            alert_fingerprint = fingerprint(alert_labels(rule, labels))
            seen.add(alert_fingerprint)
            instance = self.instances.get((rule.name, alert_fingerprint))
            if instance is None:
                instance = self.instances[rule.name, alert_fingerprint] = AlertInstance(
                    rule.name, alert_fingerprint, labels)
            baseline, source = baselines[key]
            if not observe(rule, instance, value, baseline, source, now, move):
                del self.instances[rule.name, alert_fingerprint]
        for key, instance in list(self.instances.items()):
            if key[0] == rule.name and key[1] not in seen:  # its series left the window
                instance.waiting_for = ""  # no value: nothing to evaluate, nor to wait for
                if not lack_data(instance, now, move):
                    del self.instances[key]

    def _alert(self, rule: Rule, instance: AlertInstance, status: str, now: float) -> Alert:
        # NOTE: an instance fires or resolves only once it has a value and a baseline.
        value, baseline = instance.value, instance.baseline
        assert value is not None and baseline is not None
        delta = value - baseline
        fields = {"value": figure(value), "baseline": figure(baseline),
                  "delta": figure(delta),
                  "unit": FRIENDLY[rule.metric].statistic_unit(rule.statistic),
                  "delta_percent": figure(100 * delta / abs(baseline)) if baseline else "n/a",
                  "labels": ", ".join(f"{k}={v}" for k, v in sorted(instance.labels.items())),
                  "rule": rule.name, "baseline_source": instance.baseline_source}
        annotations = {k: _render(t, fields) for k, t in rule.annotations.items()}
        against = (f"{rule.comparison} {figure(rule.threshold)}"
                   if rule.comparison in ("above", "below")
                   else f"vs baseline {fields['baseline']}")
        annotations.setdefault("summary", f"{rule.metric} {rule.statistic} {fields['value']} "
                                          f"{fields['unit']} {against}")
        annotations.update(value=fields["value"], baseline=fields["baseline"],
                           baseline_source=instance.baseline_source)
        if status == FIRING and instance.fingerprint in self._verdicts:
            annotations["explanation"] = self._verdicts[instance.fingerprint]
        if status == RESOLVED and instance.resolved_because:
            annotations["resolved_because"] = instance.resolved_because
        return Alert(labels=alert_labels(rule, instance.labels), annotations=annotations,
                     status=status,
                     starts_at=instance.firing_since or now,
                     ends_at=now if status == RESOLVED else None)

    def _move(self, rule: Rule, instance: AlertInstance, to: str, now: float) -> bool:
        """Write the transition (and its deliveries) in one transaction; only once it has
        committed does the instance take the new state. False: the store refused it, the
        state stays and the next evaluation tries again."""
        before = instance.state
        alert = self._alert(rule, instance, to, now) if to in (FIRING, RESOLVED) else None
        transition = Transition(rule.name, instance.fingerprint, instance.labels, before, to,
                                now, instance.value, instance.baseline,
                                alert.annotations["summary"] if alert else None)
        saved = None
        if to in ACTIVE:
            saved = SavedAlert(rule.name, instance.fingerprint, instance.labels, to,
                               instance.active_since, instance.firing_since, instance.value,
                               instance.baseline, now, alert_labels(rule, instance.labels),
                               alert.annotations if alert else None)
        try:
            self._record(transition, saved, alert)
        except StoreUnavailable:  # told once by the store's outage; retried as below
            return False
        except Exception:
            log.exception("alert %s: the store refused %s -> %s; retried next evaluation",
                          rule.name, before, to)
            return False
        instance.state = to
        log.info("alert %s %s: %s -> %s", rule.name, instance.fingerprint, before, to)
        return True

    def _record(self, transition: Transition, saved: SavedAlert | None,
                alert: Alert | None) -> None:
        """The transition into the store, with one delivery per receiver of `alert`; the
        sender is woken once it has committed."""
        queued = []
        if alert is not None and self.sender is not None:
            queued = [(name, transition.to_state, body)
                      for name, body in self.sender.bodies([alert])]
        queued_at = self.sender.clock() if self.sender is not None else transition.at
        self.store.record_transition(transition, saved, queued, queued_at)
        if queued and self.sender is not None:
            self.sender.wake()  # committed now: deliver without waiting for the next poll

    def active(self) -> list[dict]:
        out = []
        with self._lock:
            instances = sorted(self.instances.items())
        for (name, alert_fingerprint), i in instances:
            if i.state in ACTIVE:
                rule = self.rules[name]
                out.append({"rule": name, "fingerprint": alert_fingerprint, "state": i.state,
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
        out = self.store.recent_transitions(limit)
        for entry in out:  # what its value and baseline measure, while the rule is loaded
            rule = self.rules.get(entry["rule"])
            entry.update(metric=rule.metric if rule else "",
                         statistic=rule.statistic if rule else "")
        return out

