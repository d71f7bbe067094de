"""Runs one collector in isolation: its own thread, a timeout, up/down with a reason.

A collector that raises or hangs never delays or fails the others: a hung call is left
to finish on its own thread (the next one starts only after it returns), and the state
goes back up by itself at the first good run.

NOTE: the worker is a daemon thread, so a collector stuck for good (a driver call that
never returns) cannot keep the process from exiting on SIGTERM.
"""
from __future__ import annotations

import logging
import threading
import time

from ac_observe.collectors.base import Collector, CollectorUnavailable

log = logging.getLogger("ac_observe.daemon")


class CollectorRunner:
    def __init__(self, collector: Collector, timeout_seconds: float):
        self.collector = collector
        self.name = collector.name
        self.timeout = getattr(collector, "timeout_seconds", None) or timeout_seconds
        self._wake = threading.Condition()
        self._requested = 0        # runs asked for
        self._done = threading.Event()
        self._result: tuple = ()   # ("ok", families, seconds) | ("error", exc, seconds)
        self._busy = False
        self._started = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"collector-{self.name}",
                                        daemon=True)
        self._thread.start()
        self.up = False
        self.reason = "not run yet"
        self.errors_total = 0
        self.duration_seconds = 0.0
        self._logged: tuple | None = None

    def _work(self) -> None:
        seen = 0
        while True:
            with self._wake:
                while self._requested == seen and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                seen = self._requested
            start = time.monotonic()
            result: tuple  # as self._result
            try:
                result = ("ok", list(self.collector.collect()), time.monotonic() - start)
            except BaseException as exc:  # noqa: BLE001 - reported, never raised here
                result = ("error", exc, time.monotonic() - start)
            self._result = result
            self._done.set()

    def start(self) -> None:
        """Begin this cycle's run, unless the last one is still hanging."""
        if self._busy:
            return
        self._busy = True
        self._done.clear()
        self._started = time.monotonic()
        with self._wake:
            self._requested += 1
            self._wake.notify()

    def finish(self) -> list:
        """This cycle's families (empty when it failed), waiting at most until the timeout."""
        if not self._busy:
            return []
        if not self._done.wait(max(0.0, self._started + self.timeout - time.monotonic())):
            hung_for = time.monotonic() - self._started
            self.duration_seconds = hung_for
            if self.up or not self.reason.startswith("hung"):
                self.errors_total += 1  # one error per hang, not one per cycle it lasts
            self._set(False, f"hung: no answer after {hung_for:.1f}s (timeout {self.timeout:g}s)")
            return []
        self._busy = False
        outcome, value, self.duration_seconds = self._result
        if outcome == "ok":
            self._set(True, "")
            return value
        if isinstance(value, CollectorUnavailable):
            self._set(False, str(value))
        else:  # isolate: this collector is down, the others carry on
            self.errors_total += 1
            self._set(False, f"error: {type(value).__name__}: {value}")
        return []

    def _set(self, up: bool, reason: str) -> None:
        self.up, self.reason = up, reason
        state = (up, reason.split(":")[0] if reason.startswith("hung") else reason)
        if state != self._logged:  # once per change, not once per cycle
            self._logged = state
            if up:
                log.info("collector %s up", self.name)
            else:
                log.warning("collector %s down: %s", self.name, reason)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if not self._busy:  # a hung collector is left to its (daemon) thread
            try:
                self.collector.close()
            except Exception:
                log.exception("collector %s failed to close", self.name)
