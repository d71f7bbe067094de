"""Grafana annotations: each transition of an alert becomes one (`POST /api/annotations`,
a service-account token as bearer), a point when it fires and a region from start to end
when it resolves, tagged `ac-observe`, the status and every label as `name:value`, so the
generated dashboards' "ac-observe alerts" annotation query shows them on every board.

Grafana has no idempotency key: before every post the sender looks for the annotation an
unanswered earlier attempt may have left (same tags, time and text; a daemon killed
mid-post records no attempt) and counts it delivered instead of posting a second.
"""
from __future__ import annotations

import hashlib
import json

import httpx

from ac_observe.daemon.alerting.alert import Alert, fingerprint
from ac_observe.daemon.alerting.receivers import Receiver
from ac_observe.metrics import GRAFANA_ANNOTATION_TAG

# Answers that say the annotation or the URL is wrong: retrying the same request cannot help.
REFUSED_FOR_GOOD = (400, 404, 413, 422)


def _tag(name: str, value: str) -> str:
    """`name:value` as Grafana keeps a tag (key and value up to 100 characters each,
    trimmed): a longer value is cut and marked with a hash of the whole, so it still tells
    series apart (the fingerprint tag names the alert exactly)."""
    name, value = name.strip()[:100], value.strip()
    if len(value) > 100:
        digest = hashlib.sha256(value.encode()).hexdigest()[:8]
        value = f"{value[:90].rstrip()}~{digest}"
    return f"{name}:{value}"


def grafana_annotation(alerts: list[Alert]) -> dict:
    """A Grafana annotation (`POST /api/annotations`) of one alert's transition: a point at
    its start when it fires, a region from start to end when it resolves."""
    if len(alerts) != 1:
        raise ValueError("a Grafana annotation is one alert's transition")
    alert, = alerts
    name = alert.labels.get("alertname", "alert")
    text = f"{alert.status.upper()}: {alert.annotations.get('summary') or name}"
    if alert.annotations.get("description"):
        text += "\n" + alert.annotations["description"]
    if alert.status == "firing" and alert.annotations.get("explanation"):
        text += "\nwhy: " + alert.annotations["explanation"]
    body = {"time": int(round(alert.starts_at * 1000)),
            "tags": [GRAFANA_ANNOTATION_TAG, alert.status,
                     f"fingerprint:{fingerprint(alert.labels)}"]
            + [_tag(k, v) for k, v in sorted(alert.labels.items())],
            "text": text}
    if alert.status == "resolved" and alert.ends_at is not None:
        body["timeEnd"] = int(round(alert.ends_at * 1000))
    return body


def _holds(found: httpx.Response, annotation: dict) -> bool | None:
    """Whether Grafana's find-annotations answer holds `annotation` already (None: not an
    answer to read)."""
    try:
        items = found.json()
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    want_end = annotation.get("timeEnd", annotation["time"])
    return any(
        isinstance(item, dict) and item.get("time") == annotation["time"]
        and item.get("timeEnd", item.get("time")) == want_end
        and item.get("text") == annotation["text"]
        and set(annotation["tags"]) <= set(item.get("tags") or ())
        for item in items)


def post(client: httpx.Client, receiver: Receiver, body: str) -> httpx.Response:
    """The annotation posted unless an earlier attempt left it there already (then the
    lookup's 200 is the answer). A lookup that fails is the attempt's answer (retried
    later), never a blind post."""
    api = receiver.url.rstrip("/") + "/api/annotations"
    headers = {"content-type": "application/json", "user-agent": "ac-observe"}
    if receiver.token:
        headers["authorization"] = f"Bearer {receiver.token}"
    annotation = json.loads(body)
    found = client.get(api, headers=headers, timeout=receiver.timeout_seconds,
                       params={"from": annotation["time"],
                               "to": annotation.get("timeEnd", annotation["time"]),
                               "tags": annotation["tags"], "type": "annotation",
                               "limit": 100})
    if found.status_code != 200:
        return found
    holds = _holds(found, annotation)
    if holds is None:  # a 200 that is not Grafana's list: try again later
        return httpx.Response(502, request=found.request)
    if holds:
        return found
    return client.post(api, content=body.encode(), headers=headers,
                       timeout=receiver.timeout_seconds)
