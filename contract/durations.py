"""The durations and instants users type: `30s`, `5m`, `1h`, `7d`; unix seconds or ISO
8601. One reading for the CLI, the query API and the alerting file's rules."""
from __future__ import annotations

import re
import time
from datetime import datetime

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
MAX_DURATION_SECONDS = 366 * 86400.0
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    match = _DURATION.match(text or "")
    if not match:
        raise ValueError(f"bad duration {text!r}: use e.g. 30s, 5m, 1h")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds <= MAX_DURATION_SECONDS:
        raise ValueError(f"bad duration {text[:40]!r}: it must be positive and at most 366d")
    return seconds


def parse_instant(text: str | None, now: float | None = None) -> float | None:
    """An instant: unix seconds or an ISO 8601 time (local time when it names no zone);
    None for none. Never in the future: a window that ends later than now is a mistake."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        instant = float(text)
    except ValueError:
        iso = text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text  # 3.10 lacks Z
        try:
            instant = datetime.fromisoformat(iso).timestamp()
        except ValueError:
            raise ValueError(f"bad time {text[:40]!r}: use unix seconds or ISO 8601, "
                             f"e.g. 2026-12-01T14:03:00") from None
    now = time.time() if now is None else now
    if not 0 < instant <= now + 1.0:
        raise ValueError(f"bad time {text[:40]!r}: it must be in the past")
    return instant
