"""An alert as notifications carry it: labels, annotations, status and times, named by
Alertmanager's fingerprint of its labels."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of an alert still firing


@dataclass(frozen=True, slots=True)
class Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    status: str                     # firing | resolved
    starts_at: float
    ends_at: float | None = None    # set when resolved
    generator_url: str = ""


def fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set: FNV-1a 64 over the sorted names and
    values, each followed by 0xff (prometheus/common model.LabelSet.Fingerprint)."""
    h = 0xcbf29ce484222325
    for name in sorted(labels):
        for part in (name, labels[name]):
            for byte in part.encode() + b"\xff":
                h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def rfc3339(seconds: float | None) -> str:
    if seconds is None:
        return ZERO_TIME
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def trial_alert(now: float, host: str) -> Alert:
    """What `ac-observe alerts test` delivers: says who sent it and that nothing is wrong."""
    return Alert(labels={"alertname": "AcObserveTestAlert", "severity": "none",
                         "instance": host},
                 annotations={"summary": "ac-observe test delivery",
                              "description": "Sent by `ac-observe alerts test`; nothing "
                                             "is wrong."},
                 status="firing", starts_at=now)
