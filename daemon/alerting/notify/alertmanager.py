"""Alertmanager's webhook body (version 4), so receivers written for Alertmanager take the
daemon's notifications unchanged."""
from __future__ import annotations

import json

from ac_observe.daemon.alerting.alert import Alert, fingerprint, rfc3339


def _common(dicts: list[dict]) -> dict:
    if not dicts:
        return {}
    first = dicts[0]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in dicts[1:])}


def alertmanager_body(receiver: str, alerts: list[Alert], external_url: str) -> dict:
    """The body Alertmanager posts to a webhook receiver (version 4). Each notification is
    one alert instance, grouped by all its labels (Alertmanager's `group_by: ['...']`), so
    a receiver keying incidents by groupKey never sees one instance's resolution close
    another's."""
    group_labels = dict(alerts[0].labels)
    status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f"{k}={json.dumps(v)}"
                                       for k, v in sorted(group_labels.items())) + "}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a.labels for a in alerts]),
        "commonAnnotations": _common([a.annotations for a in alerts]),
        "externalURL": external_url,
        "alerts": [{"status": a.status, "labels": a.labels, "annotations": a.annotations,
                    "startsAt": rfc3339(a.starts_at), "endsAt": rfc3339(a.ends_at),
                    "generatorURL": a.generator_url, "fingerprint": fingerprint(a.labels)}
                   for a in alerts],
    }
