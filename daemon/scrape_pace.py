"""When Prometheus's scrapes come, so the cycle renders /metrics ahead of the ones due."""
from __future__ import annotations

import math
import time
from collections import deque

# Render ahead of scrapes (in the cycle) while someone has scraped within this long.
RENDER_AHEAD_SECONDS = 300.0


class ScrapePace:
    """When scrapes come, counted in cycles: a cycle renders ahead only when a scrape is due
    (from the shortest gap between the cycles the last scrapes fell on; with several
    scrapers, the closest two), not in the 14 of 15 cycles between two scrapes of a
    Prometheus at 15 s. From a cycle before the expected scrape until one comes (for at
    most RENDER_AHEAD_SECONDS), every cycle renders; so do all until three scrapes were
    seen, and all while scrapes come every cycle."""

    def __init__(self, keep: int = 9):
        self._cycles: deque[int] = deque(maxlen=keep)  # the snapshots scrapes fell on
        self._last = -math.inf  # monotonic time of the last scrape

    def scraped(self, cycle: int) -> None:
        self._last = time.monotonic()
        if not self._cycles or self._cycles[-1] != cycle:
            self._cycles.append(cycle)

    def due(self, cycle: int) -> bool:
        """Whether snapshot `cycle`, just made, is likely to be scraped (a cycle early, for
        a scraper's jitter: a scrape that beats the render gets it made on demand)."""
        if time.monotonic() - self._last >= RENDER_AHEAD_SECONDS:
            return False
        cycles = list(self._cycles)
        if len(cycles) < 3:
            return True
        gap = min(b - a for a, b in zip(cycles, cycles[1:], strict=False))
        return cycle - cycles[-1] >= gap - 1
