"""A Slack incoming-webhook message: one line per alert (and a firing one's explanation
under it)."""
from __future__ import annotations

from ac_observe.daemon.alerting.alert import Alert


def slack_body(alerts: list[Alert]) -> dict:
    lines = []
    for a in alerts:
        mark = ":red_circle:" if a.status == "firing" else ":large_green_circle:"
        summary = a.annotations.get("summary") or a.labels.get("alertname", "alert")
        lines.append(f"{mark} *{a.status.upper()}* {summary}")
        if a.status == "firing" and a.annotations.get("explanation"):
            lines.append(f"why: {a.annotations['explanation']}")
    return {"text": "\n".join(lines)}
