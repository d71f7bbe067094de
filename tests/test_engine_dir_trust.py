"""Which engine directories under a telemetry root are read, the same for every reader:
the engine collector and the eBPF collector's stream names (engine.json's cuda_streams)
both go through open_engine_dir_at; a root others can write into is refused, sticky or
not; refused directories are logged once, by their name's repr, and never crowd real
engines out."""
from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ac_observe import metrics as m
from ac_observe.collectors.ebpf import EbpfCollector
from ac_observe.collectors.engine import EngineCollector
from ac_observe.engine.telemetry import TelemetryWriter

ENGINE_UID = 10001
OTHER_UID = 10002

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to users needs root")


def _engine(directory: Path, engine: str, handle: int, uid: int | None = ENGINE_UID):
    writer = TelemetryWriter(directory, {"started_at": time.time(),
                                         "cuda_streams": {m.LANES[0]: handle}},
                             engine=engine, model="m", heartbeat_seconds=0.5)
    writer.set(m.KV_BLOCKS, 64)
    if uid is not None:
        os.chown(directory, uid, uid)
        for entry in directory.iterdir():
            os.chown(entry, uid, uid, follow_symlinks=False)
    return writer


def _config(root: Path, owner: int | None) -> SimpleNamespace:
    return SimpleNamespace(telemetry_root=root, telemetry_owner=owner,
                           engine_stale_seconds=60, engine_grace_seconds=60)


def _engines_read(collector: EngineCollector) -> set[str]:
    return {sample.labels["engine"] for family in collector.collect()
            for sample in family.samples
            if family.name == m.KV_BLOCKS.name and "engine" in sample.labels}


@needs_root
def test_ebpf_names_streams_only_of_the_directories_the_engine_collector_reads(tmp_path):
    root = tmp_path / "telemetry"
    writers = [_engine(root / "ours", "ours", 0x1000),
               _engine(root / "other", "other", 0x2000, OTHER_UID),
               _engine(root / "open", "open", 0x3000),
               _engine(root / "roots", "roots", 0x4000, None)]
    try:
        (root / "open").chmod(0o777)
        (root / "lured").symlink_to(root / "ours")
        config = _config(root, ENGINE_UID)
        assert _engines_read(EngineCollector(config)) == {"ours", "roots"}
        streams = EbpfCollector(config)._engine_streams()
        assert streams == {(os.getpid(), 0x1000): m.LANES[0],
                           (os.getpid(), 0x4000): m.LANES[0]}
        # Not told the owner: neither reads the owner's directory.
        plain = _config(root, None)
        assert _engines_read(EngineCollector(plain)) == {"roots"}
        assert EbpfCollector(plain)._engine_streams() == {(os.getpid(), 0x4000): m.LANES[0]}
    finally:
        for writer in writers:
            writer.close()
