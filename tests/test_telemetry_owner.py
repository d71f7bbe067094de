"""The telemetry owner (--telemetry-owner, AC_OBSERVE_TELEMETRY_OWNER): a root daemon
reads the telemetry of engines that run as a non-root user (the engine image's uid 10001)
when told that user, and still refuses directories anyone else owns or others can write,
and anything reached through a symlink of that user's."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ac_observe import metrics as m
from ac_observe.collectors.base import CollectorUnavailable
from ac_observe.collectors.engine import EngineCollector
from ac_observe.daemon.config import parse_owner
from ac_observe.engine.telemetry import TelemetryWriter
from support.servers import sample_value, wait_for

ENGINE_UID = 10001  # the engine image's user (Dockerfile)
OTHER_UID = 10002

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to users needs root")


def _engine(directory: Path, engine: str, uid: int | None = ENGINE_UID) -> TelemetryWriter:
    """An engine writing into `directory`, which (with its files) then belongs to `uid`."""
    writer = TelemetryWriter(directory, {"started_at": time.time()}, engine=engine,
                             model="m", heartbeat_seconds=0.5)
    writer.set(m.KV_BLOCKS, 64)
    if uid is not None:
        _chown_tree(directory, uid)
    return writer


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for entry in path.iterdir():
        os.chown(entry, uid, uid, follow_symlinks=False)


def _collector(root: Path, owner: int | None) -> EngineCollector:
    return EngineCollector(SimpleNamespace(telemetry_root=root, engine_stale_seconds=60,
                                           engine_grace_seconds=60, telemetry_owner=owner))


def _engines_read(collector: EngineCollector) -> set[str]:
    return {sample.labels["engine"] for family in collector.collect()
            for sample in family.samples
            if family.name == m.KV_BLOCKS.name and "engine" in sample.labels}


def _error(collector: EngineCollector, name: str) -> str:
    return next(e["error"] for e in collector.status() if e["directory"].endswith(name))


@needs_root
def test_the_owners_engine_directories_are_read_and_no_one_elses(tmp_path):
    root = tmp_path / "telemetry"
    engines = [_engine(root / "ours", "ours"), _engine(root / "other", "other", OTHER_UID),
               _engine(root / "roots", "roots", None)]
    try:
        # Without the setting, the engine user's directory is refused, as before.
        plain = _collector(root, None)
        assert _engines_read(plain) == {"roots"}
        assert "owned by uid 10001" in _error(plain, "ours")
        # With it, that user's directory is read; another user's stays refused.
        told = _collector(root, ENGINE_UID)
        assert _engines_read(told) == {"ours", "roots"}
        error = _error(told, "other")
        assert "owned by uid 10002" in error and "telemetry owner (uid 10001)" in error
        assert _error(told, "ours") == ""
    finally:
        for writer in engines:
            writer.close()


@needs_root
def test_the_owners_directory_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "telemetry"
    writer = _engine(root / "open", "open")
    try:
        (root / "open").chmod(0o777)
        collector = _collector(root, ENGINE_UID)
        assert _engines_read(collector) == set()
        assert "writable by other users" in _error(collector, "open")
        (root / "open").chmod(0o700)
        assert _engines_read(collector) == {"open"}
    finally:
        writer.close()


@needs_root
def test_a_refused_directory_is_logged_once_for_each_reason(tmp_path, caplog):
    root = tmp_path / "telemetry"
    writer = _engine(root / "other", "other", OTHER_UID)
    try:
        collector = _collector(root, ENGINE_UID)
        with caplog.at_level(logging.WARNING, "ac_observe.collectors.engine"):
            for _ in range(3):
                collector.collect()
            os.chown(root / "other", ENGINE_UID, ENGINE_UID)
            (root / "other").chmod(0o777)  # another reason: logged once more
            for _ in range(3):
                collector.collect()
        refused = [r.getMessage() for r in caplog.records if "is not read" in r.getMessage()]
        assert len(refused) == 2, refused
        assert "owned by uid 10002" in refused[0]
        assert "writable by other users" in refused[1]
    finally:
        writer.close()


@needs_root
def test_the_owner_may_own_the_root_itself_but_nothing_above_it(tmp_path):
    # The engine image's /telemetry volume belongs to the engine's user.
    root = tmp_path / "telemetry"
    writer = _engine(root / "e1", "e1")
    try:
        os.chown(root, ENGINE_UID, ENGINE_UID)
        with pytest.raises(CollectorUnavailable, match="uid 10001"):
            _collector(root, None).collect()
        assert _engines_read(_collector(root, ENGINE_UID)) == {"e1"}
        # Its root open to everyone is not the owner's alone: refused.
        root.chmod(0o777)
        with pytest.raises(CollectorUnavailable, match="writable by other users"):
            _collector(root, ENGINE_UID).collect()
        root.chmod(0o755)
        # A directory of the owner's above the root: it could swap the root for another.
        above = tmp_path / "above"
        above.mkdir()
        (root).rename(above / "telemetry")
        os.chown(above, ENGINE_UID, ENGINE_UID)
        with pytest.raises(CollectorUnavailable, match="owned by uid 10001"):
            _collector(above / "telemetry", ENGINE_UID).collect()
    finally:
        writer.close()


@needs_root
def test_symlinks_of_the_owner_are_never_followed(tmp_path):
    real = tmp_path / "real"
    writer = _engine(real / "e1", "e1")
    try:
        os.chown(real, ENGINE_UID, ENGINE_UID)
        # The telemetry root as the owner's symlink to a directory of the owner's.
        lured = tmp_path / "lured"
        lured.symlink_to(real)
        os.chown(lured, ENGINE_UID, ENGINE_UID, follow_symlinks=False)
        with pytest.raises(CollectorUnavailable, match="symlink owned by uid 10001"):
            _collector(lured, ENGINE_UID).collect()
        # An engine directory as the owner's symlink to another engine's directory.
        root = tmp_path / "telemetry"
        root.mkdir()
        (root / "e2").symlink_to(real / "e1")
        os.chown(root / "e2", ENGINE_UID, ENGINE_UID, follow_symlinks=False)
        collector = _collector(root, ENGINE_UID)
        assert _engines_read(collector) == set()
        assert all(e["error"] for e in collector.status())  # skipped, or refused
    finally:
        writer.close()


def test_the_owner_is_a_uid_or_a_user_name_of_this_host():
    assert parse_owner("10001") == 10001
    assert parse_owner(" root ") == 0
    assert parse_owner("") is None and parse_owner(None) is None
    for bad in ("no-such-user-ac-observe", "-1", "99999999999", "10001\n0"):
        with pytest.raises(ValueError, match="--telemetry-owner"):
            parse_owner(bad)


def test_an_unknown_owner_stops_the_daemon_at_start(tmp_path):
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ac-observe")), "daemon", "--telemetry-root",
         str(tmp_path), "--collectors", "engine"],
        env={**os.environ, "AC_OBSERVE_TELEMETRY_OWNER": "no-such-user-ac-observe"},
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--telemetry-owner 'no-such-user-ac-observe': no such user" in done.stderr


@needs_root
def test_the_daemon_reads_the_owners_engine_named_in_its_environment(start_daemon, tmp_path):
    root = tmp_path / "telemetry"
    writer = _engine(root / "ours", "ours")
    try:
        daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s",
                              env={"AC_OBSERVE_TELEMETRY_OWNER": str(ENGINE_UID)})
        wait_for(lambda: sample_value(daemon.metrics(), "ac_kv_cache_blocks",
                                      engine="ours") == 64, 20, "the engine user's engine")
    finally:
        writer.close()
