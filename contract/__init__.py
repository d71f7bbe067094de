"""ac-observe: kernel-level observability for self-hosted LLM inference.

This folder installs as the `ac_observe` package itself (pyproject's package-dir maps it),
next to `ac_observe.daemon`, `ac_observe.engine` and `ac_observe.collectors`. It holds the
contract every part reads and nothing else:

- `ac_observe.metrics`: every exported family, the friendly names, lanes, default ports;
- `ac_observe.telemetry_format`: the engine -> daemon files and the telemetry root.

NOTE: both are leaves: standard library only, never torch, never another ac_observe module.
"""

__version__ = "0.1.0"
