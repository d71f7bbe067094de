"""What a collector is, and the registry that names them (node_exporter style).

A collector yields freshly built metric families on every `collect()` call, so a source
that vanished takes its series with it. It signals "cannot run here" by raising
`CollectorUnavailable` with a reason a user can act on; any other exception is an error.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import Metric

REGISTRY: dict[str, Callable[..., "Collector"]] = {}
DEFAULT_ENABLED = ("engine", "nvml")


class CollectorUnavailable(RuntimeError):
    """The source is not present (no GPU, no driver, no privileges): down, with a reason."""


class Collector:
    name: str = ""
    timeout_seconds: float = 2.0

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def register(name: str):
    """Class decorator: make a collector constructible by name (`--collectors`)."""
    def wrap(factory):
        factory.name = name
        REGISTRY[name] = factory
        return factory
    return wrap


def build(names: Iterable[str], **options) -> list[Collector]:
    import collectors.engine  # noqa: F401  (registration side effects)
    import collectors.nvml  # noqa: F401
    collectors_ = []
    for name in names:
        if name not in REGISTRY:
            raise ValueError(f"unknown collector {name!r}; known: {', '.join(sorted(REGISTRY))}")
        collectors_.append(REGISTRY[name](**options))
    return collectors_
