"""Attribution for the benches: wrap a function or method so every call adds its duration
to a Counter under a label (and counts the call), without a profiler's tracing cost."""
from __future__ import annotations

import collections
import time


def time_calls(owner, name: str, spent: collections.Counter, label: str,
               clock=time.perf_counter) -> None:
    """Replace `owner.name` (a module's function or a class's method) by a wrapper adding
    each call's `clock` time to spent[label] and 1 to spent[label + " calls"]."""
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = clock()
        try:
            return real(*args, **kwargs)
        finally:
            spent[label] += clock() - start
            spent[label + " calls"] += 1
    setattr(owner, name, timed)
