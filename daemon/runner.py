"""Runs one collector in isolation: its own thread, a timeout, up/down with a reason.

A collector that raises or hangs never delays or fails the others: a hung call is left
to finish on its own thread (the next one starts only after it returns), and the state
goes back up by itself at the first good run.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ac_observe.collectors.base import Collector, CollectorUnavailable

log = logging.getLogger("ac_observe.daemon")


class CollectorRunner:
    def __init__(self, collector: Collector, timeout_seconds: float):
        self.collector = collector
        self.name = collector.name
        self.timeout = getattr(collector, "timeout_seconds", None) or timeout_seconds
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"collector-{self.name}")
        self._future: Future | None = None
        self._started = 0.0
        self.up = False
        self.reason = "not run yet"
        self.errors_total = 0
        self.duration_seconds = 0.0
        self._logged: tuple | None = None

    def start(self) -> None:
        """Begin this cycle's run, unless the last one is still hanging."""
        if self._future is not None and not self._future.done():
            return
        self._started = time.monotonic()
        self._future = self._pool.submit(self._timed)

    def _timed(self):
        start = time.monotonic()
        families = list(self.collector.collect())
        return families, time.monotonic() - start

    def finish(self) -> list:
        """This cycle's families (empty when it failed), waiting at most until the timeout."""
        future = self._future
        if future is None:
            return []
        deadline = self._started + self.timeout
        try:
            families, self.duration_seconds = future.result(max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            hung_for = time.monotonic() - self._started
            self.duration_seconds = hung_for
            if self.up or not self.reason.startswith("hung"):
                self.errors_total += 1  # one error per hang, not one per cycle it lasts
            self._set(False, f"hung: no answer after {hung_for:.1f}s (timeout {self.timeout:g}s)")
            return []
        except CollectorUnavailable as exc:
            self._future = None
            self._set(False, str(exc))
            return []
        except Exception as exc:  # isolate: this collector is down, the others carry on
            self._future = None
            self.errors_total += 1
            self._set(False, f"error: {type(exc).__name__}: {exc}")
            return []
        self._future = None
        self._set(True, "")
        return families

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
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.collector.close()
        except Exception:
            log.exception("collector %s failed to close", self.name)
