"""Drift alerts: rules read from the alerting file, evaluated on the daemon's series
against a baseline, their states kept in the store, their notifications delivered from
the store's outbox.

    rules.py      the rule model and its checks (pydantic), the shipped defaults.yaml
    receivers.py  where notifications go, and their checks
    file.py       the alerting file: read, checked, its JSON Schema
    baselines.py  a rule's values and baselines, read through the daemon's series
    state.py      an alert instance and its states (inactive, pending, firing, resolved)
    evaluator.py  every rule on a clock: values -> states -> store + outbox
    explain.py    why an alert fired: its change split into parts, with causes
    alert.py      an alert as notifications carry it
    notify/       one module a format: Alertmanager, Slack, Grafana annotations, signing
    outbox.py     the sender that delivers the store's outbox, with retries

NOTE: SQL lives in daemon/store.py only; dashboards/ imports rules.py and nothing else.
"""
