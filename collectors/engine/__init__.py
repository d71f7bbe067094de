"""Engine collector: every engine under the telemetry root, read from its files.

Each engine directory holds `engine.json` (refreshed every second as a heartbeat) and
prometheus_client multiprocess `.db` files (`ac_observe.telemetry_format`). One module a
concern:
- `discovery`: the root's engine directories, directory safety, engine.json and its
  heartbeat, the grace period and the clean-up of a gone engine's files, ac_engine_up;
- `files`: reading the `.db` files (one `FileIndex` each) within an engine's bounds;
- `keys`: which keys are series of the metric contract (`check_key`);
- `plan`: the series plan, from checked keys to the exposition and the daemon's window
  keys, and a cycle's values through it;
- `families`: the cycle's metric families, built from each engine's values;
- `collector`: `EngineCollector`, the cycle that ties them (registered as "engine").
"""
from ac_observe.collectors.engine.collector import EngineCollector
from ac_observe.collectors.engine.discovery import BadEngine, EngineState
from ac_observe.collectors.engine.families import EngineFamily
from ac_observe.collectors.engine.files import FileIndex

__all__ = ["BadEngine", "EngineCollector", "EngineFamily", "EngineState", "FileIndex"]
