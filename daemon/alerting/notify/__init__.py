"""Notifiers: where an alert goes, one module a format (what is measured and decided lives
in the rules, the evaluator and the states; how it travels, here). `body_for` makes a
receiver's body, `send` posts one delivery of it."""
from __future__ import annotations

import httpx

from ac_observe.daemon.alerting.alert import Alert
from ac_observe.daemon.alerting.notify import grafana, webhook
from ac_observe.daemon.alerting.notify.alertmanager import alertmanager_body
from ac_observe.daemon.alerting.notify.grafana import grafana_annotation
from ac_observe.daemon.alerting.notify.slack import slack_body
from ac_observe.daemon.alerting.receivers import Receiver


def body_for(receiver: Receiver, alerts: list[Alert], external_url: str) -> dict:
    if receiver.format == "slack":
        return slack_body(alerts)
    if receiver.format == "grafana":
        return grafana_annotation(alerts)
    return alertmanager_body(receiver.name, alerts, external_url)


def send(client: httpx.Client, receiver: Receiver, delivery_id: str, body: str,
         now: float) -> httpx.Response:
    if receiver.format == "grafana":
        return grafana.post(client, receiver, body)
    return webhook.post(client, receiver, delivery_id, body, now)
