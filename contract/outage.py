"""A dependency's outages as the log tells them (the store, a webhook receiver, a scraped
engine endpoint): one line when it goes away, with why and what is kept meanwhile, a
reminder every `remind_seconds` while it stays away, one line when it is back; never a
traceback, and never a line per failed call. It sits in the contract so that the
collectors and the daemon tell outages alike.

NOTE: `failed` and `ok` may be called from any thread, as often as calls are made.
"""
from __future__ import annotations

import logging
import threading
import time

REMIND_SECONDS = 300.0


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def size_text(count: float) -> str:
    """Bytes in a line: 512 B, 3.2 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


class Outage:
    """`what` goes away (`failed(reason)`) and comes back (`ok()`); `kept` says what is
    kept meanwhile ("history stays in memory ...")."""

    def __init__(self, what: str, kept: str, logger: logging.Logger,
                 remind_seconds: float = REMIND_SECONDS, clock=time.monotonic):
        self.what, self.kept = what, kept
        self.log = logger
        self.remind_seconds = remind_seconds
        self.clock = clock
        self.reason = ""          # why it is away ("" while it is up)
        self._since = 0.0         # when it went away (clock)
        self._reminded = 0.0      # when it was last said
        self._failures = 0        # calls failed since it went away
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return bool(self.reason)

    def failed(self, reason: str) -> None:
        reason = " ".join(reason.split())[:300] or "unknown reason"
        now = self.clock()
        with self._lock:
            if not self.reason:
                self.reason, self._since, self._reminded, self._failures = reason, now, now, 1
                self.log.warning("%s is unavailable: %s; %s", self.what, reason, self.kept)
                return
            self.reason = reason
            self._failures += 1
            if now - self._reminded < self.remind_seconds:
                return
            self._reminded = now
            since, failures = self._since, self._failures
        self.log.warning("%s is still unavailable after %s (%d failed calls): %s; %s",
                         self.what, duration_text(now - since), failures, reason, self.kept)

    def ok(self) -> None:
        if not self.reason:  # the usual case: no lock taken
            return
        with self._lock:
            if not self.reason:
                return
            away = self.clock() - self._since
            self.reason = ""
        self.log.warning("%s is back after %s", self.what, duration_text(away))
