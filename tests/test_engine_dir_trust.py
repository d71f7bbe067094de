"""Which engine directories under a telemetry root are read, the same for every reader:
the engine collector and the eBPF collector's stream names (engine.json's cuda_streams)
both go through open_engine_dir_at; a root others can write into is refused, sticky or
not; refused directories are logged once, by their name's repr, and never crowd real
engines out."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ac_observe import metrics as m
from ac_observe.collectors.base import CollectorUnavailable
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


@needs_root
@pytest.mark.parametrize("owner", [ENGINE_UID, 0])
def test_a_root_others_can_write_into_is_refused_sticky_or_not(tmp_path, owner):
    """Any local user could make entries in a 1777 root (engine directories of their own
    among them, or thousands of names): the root must be its owner's alone."""
    root = tmp_path / "telemetry"
    writer = _engine(root / "e1", "e1", 0x1000)
    try:
        os.chown(root, owner, owner)
        for mode in (0o1777, 0o777, 0o1770):
            root.chmod(mode)
            with pytest.raises(CollectorUnavailable,
                               match=f"is writable by other users \\(mode {mode:04o}\\)"):
                EngineCollector(_config(root, ENGINE_UID)).collect()
            assert EbpfCollector(_config(root, ENGINE_UID))._engine_streams() == {}
        root.chmod(0o755)
        assert _engines_read(EngineCollector(_config(root, ENGINE_UID))) == {"e1"}
    finally:
        writer.close()


@needs_root
def test_refused_directories_are_logged_by_repr_and_never_crowd_engines_out(
        tmp_path, caplog, monkeypatch):
    from ac_observe.collectors.engine import collector as module
    monkeypatch.setattr(module, "MAX_ENGINE_DIRS", 2)
    monkeypatch.setattr(module, "MAX_REFUSED_DIRS", 3, raising=False)
    root = tmp_path / "telemetry"
    root.mkdir()
    # Refused names sorted before the engines: ten of another user's, one forging a line.
    for i in range(10):
        (root / f"a{i}").mkdir()
        os.chown(root / f"a{i}", OTHER_UID, OTHER_UID)
    forged = "a\nWARNING ac_observe.collectors.engine forged line"
    (root / forged).mkdir()
    os.chown(root / forged, OTHER_UID, OTHER_UID)
    writers = [_engine(root / f"x{i}", f"x{i}", 0x1000 + i) for i in range(3)]
    try:
        collector = EngineCollector(_config(root, ENGINE_UID))
        with caplog.at_level(logging.WARNING, "ac_observe.collectors.engine"):
            for _ in range(3):
                assert _engines_read(collector) == {"x0", "x1"}  # the cap: engines alone
        messages = [r.getMessage() for r in caplog.records]
        assert all("\n" not in message for message in messages), messages
        refused = [msg for msg in messages if "is not read" in msg]
        assert len(refused) == 3, messages  # the first three refused, once each
        assert repr(forged) in refused[0]
        assert sum("11 directories under the telemetry root are refused" in msg
                   for msg in messages) == 1, messages
        assert sum("more than 2 engine directories" in msg for msg in messages) == 1, \
            messages
        status = collector.status()
        assert len(status) == 3 + 2 and sum(bool(e["error"]) for e in status) == 3
    finally:
        for writer in writers:
            writer.close()


@needs_root
def test_a_refused_directory_names_each_trusted_owner_once(tmp_path):
    """The root is the telemetry owner's: its uid is said once, as the telemetry owner."""
    root = tmp_path / "telemetry"
    writer = _engine(root / "other", "other", 0x1000, OTHER_UID)
    try:
        os.chown(root, ENGINE_UID, ENGINE_UID)
        collector = EngineCollector(_config(root, ENGINE_UID))
        assert _engines_read(collector) == set()
        (state,) = collector.status()
        assert state["error"] == ("is owned by uid 10002, not by you (uid 0) or the "
                                  "telemetry owner (uid 10001)")
    finally:
        writer.close()
