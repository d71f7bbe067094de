"""An alert instance (one rule, one label set) and its states.

inactive -> pending (the condition holds) -> firing (it held for `for`) -> resolved (it
failed on two evaluations in a row, so one odd sample never resolves an alert) ->
inactive. The baseline is frozen while pending or firing (and stored, so kept across a
restart). A series with no value or no baseline is "no data": it changes no state (a
firing alert stays firing, and is listed as no data), until it has had none for
NO_DATA_RESOLVE_SECONDS: its series is gone, and the instance resolves or is dropped.

NOTE: a state changes through `move`, which writes the transition (and the deliveries it
causes) to the store and sets the state once that has committed; a refused write leaves
the state as it was, and the next evaluation tries again. The one exception is resolved
-> inactive, a move in memory only: a resolved alert is no longer kept in the store.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ac_observe.daemon.alerting.rules import Rule, breached, figure

INACTIVE, PENDING, FIRING, RESOLVED = "inactive", "pending", "firing", "resolved"
ACTIVE = (PENDING, FIRING)
# An instance without data this long is resolved (firing) or dropped (pending).
NO_DATA_RESOLVE_SECONDS = 3600.0
# A firing alert resolves after this many evaluations in a row with the condition false.
MISSES_TO_RESOLVE = 2


@dataclass(slots=True)
class AlertInstance:
    rule: str
    fingerprint: str  # of its notification's labels (alert_labels), as Alertmanager's
    labels: dict       # the series' labels
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


# Writes `instance`'s move to the state and sets it; False when the store refused it.
Move = Callable[[AlertInstance, str], bool]


def observe(rule: Rule, instance: AlertInstance, value: float, baseline: float | None,
            source: str, now: float, move: Move) -> bool:
    """One evaluation's value (and baseline, None if it has none yet) for the instance.
    False: the instance is done with (see `lack_data`)."""
    if instance.state in ACTIVE and instance.baseline is not None:
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
        return lack_data(instance, now, move)
    instance.no_data, instance.no_data_since = False, None
    instance.value, instance.baseline = value, baseline
    bad = breached(rule, value, baseline)
    state = instance.state
    if state in (INACTIVE, RESOLVED):
        if bad:
            instance.active_since = now
            if not move(instance, PENDING):
                return True
            state = PENDING
        elif state == RESOLVED:
            instance.state = INACTIVE
            instance.baseline = None
    if state == PENDING:
        if not bad:
            move(instance, INACTIVE)
            instance.baseline = None
        elif now - _since(instance.active_since, now) >= rule.for_seconds:
            instance.firing_since = now
            instance.misses = 0
            move(instance, FIRING)
    elif state == FIRING:
        instance.misses = 0 if bad else instance.misses + 1
        if instance.misses >= MISSES_TO_RESOLVE:
            move(instance, RESOLVED)
    return True


def _since(at: float | None, now: float) -> float:
    return now if at is None else at


def lack_data(instance: AlertInstance, now: float, move: Move) -> bool:
    """No data changes nothing, for a while: an instance without data for
    NO_DATA_RESOLVE_SECONDS (its series is gone: an engine removed, a label changed) is
    resolved, saying why, rather than firing forever. False: it is done with (inactive or
    resolved after that time) and can be forgotten."""
    instance.no_data = True
    if instance.no_data_since is None:
        instance.no_data_since = now
    if now - instance.no_data_since < NO_DATA_RESOLVE_SECONDS:
        return True
    if instance.state == FIRING and instance.value is not None \
            and instance.baseline is not None:
        instance.resolved_because = (f"no data for {figure(NO_DATA_RESOLVE_SECONDS)} s: "
                                     "its series is gone")
        move(instance, RESOLVED)
    elif instance.state == PENDING:
        move(instance, INACTIVE)
    return instance.state not in (INACTIVE, RESOLVED)
