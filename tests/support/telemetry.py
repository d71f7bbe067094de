"""Telemetry files read the way any prometheus_client user reads them."""
from __future__ import annotations

import json
import subprocess
import sys

READER = r"""
import json, sys
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
registry = CollectorRegistry()
MultiProcessCollector(registry, path=sys.argv[1])
text = generate_latest(registry).decode()
families = {}
for fam in text_string_to_metric_families(text):
    families[fam.name] = {"type": fam.type,
                          "samples": [[s.name, s.labels, s.value] for s in fam.samples]}
print(json.dumps(families))
"""


def read_with_multiprocess_collector(directory) -> dict:
    """{family: {type, samples}} as prometheus_client's MultiProcessCollector reads the
    directory, in a separate process."""
    out = subprocess.run([sys.executable, "-c", READER, str(directory)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def gateway_failures(directory) -> dict:
    """{reason: count} of a gateway's ac_gateway_upstream_failures_total, every reason."""
    from ac_observe.metrics import UPSTREAM_FAILURE_REASONS
    found = dict.fromkeys(UPSTREAM_FAILURE_REASONS, 0.0)
    families = read_with_multiprocess_collector(directory)
    for _, labels, value in families["ac_gateway_upstream_failures"]["samples"]:
        found[labels["reason"]] += value
    return found


def family_value(families, family, sample, **labels):
    """Sum of a family's samples named `sample` whose labels include `labels`."""
    return sum(v for name, lab, v in families[family]["samples"]
               if name == sample and all(lab.get(k) == val for k, val in labels.items()))


def read_as_daemon(root) -> dict:
    """{(sample name, frozenset(labels)): value} as the daemon's engine collector reads
    every engine under a telemetry root."""
    from types import SimpleNamespace

    from ac_observe.collectors.engine import EngineCollector
    collector = EngineCollector(SimpleNamespace(telemetry_root=root, engine_stale_seconds=60,
                                                engine_grace_seconds=60, telemetry_owner=None))
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in collector.collect() for s in family.samples}


def sample_value(samples, name, **labels):
    """The one sample of `read_as_daemon`'s answer with that name and these labels."""
    found = [v for (n, lab), v in samples.items()
             if n == name and all((k, val) in lab for k, val in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]
