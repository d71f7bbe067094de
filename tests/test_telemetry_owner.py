"""The telemetry owner (--telemetry-owner, AC_OBSERVE_TELEMETRY_OWNER): a root daemon
reads the telemetry of engines that run as a non-root user (the engine image's uid 10001)
when told that user, and still refuses directories anyone else owns or others can write,
and anything reached through a symlink of that user's."""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
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
        with pytest.raises(CollectorUnavailable) as refused:
            _collector(above / "telemetry", ENGINE_UID).collect()
        assert f"{above} is owned by the telemetry owner (uid 10001), who may own the " \
            "telemetry root itself but no directory above it" in str(refused.value)
        assert "--telemetry-owner" not in str(refused.value)  # it was given
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
        status = collector.status()  # refused, said so (not silently skipped)
        assert [e["directory"] for e in status] == [str(root / "e2")], status
        assert "is a symlink" in status[0]["error"], status
    finally:
        writer.close()


def test_the_owner_is_a_uid_or_a_user_name_of_this_host(caplog):
    assert parse_owner("10001") == 10001
    assert parse_owner("") is None and parse_owner(None) is None
    for bad in ("no-such-user-ac-observe", "10001\n0"):
        with pytest.raises(ValueError, match="no such user"):
            parse_owner(bad)
    for bad in ("-1", "+5", "99999999999", "4294967296"):
        with pytest.raises(ValueError, match="not a uid"):
            parse_owner(bad)
    # A digit to str.isdigit, no uid to int(): said as a name not found, not int's error.
    with pytest.raises(ValueError, match="no such user"):
        parse_owner("\u00b2")
    # The overflow uids: what an unmapped user reads as, never an engine's own.
    for bad, said in (("65534", "nobody"), ("4294967294", "overflow"),
                      ("4294967295", "no uid")):
        with pytest.raises(ValueError, match=said):
            parse_owner(bad)
    # Root and the daemon's own user are trusted anyway: allowed, and said to do nothing.
    with caplog.at_level(logging.WARNING, "ac_observe.daemon"):
        assert parse_owner(" root ") == 0
        assert parse_owner(str(os.geteuid())) == os.geteuid()
        assert parse_owner("10001") == 10001
    warned = [r.getMessage() for r in caplog.records if "--telemetry-owner" in r.getMessage()]
    assert len(warned) == 2 and all("changes nothing" in w for w in warned), warned


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


def _as_user(uid: int, groups: list[int], body, *args) -> tuple[int, int, int]:
    """A forked child that drops to `uid` (its group `uid` and `groups`) and runs
    body(*args, write): (pid, the end to read what it writes, the end that ends it when
    closed). (A fork, not a new interpreter: this one's may be in a directory only root
    can enter.)"""
    out_r, out_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(out_r)
            os.close(stop_w)
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o077)  # the most private: the engine sets its modes itself
            body(*args, lambda text: os.write(out_w, text.encode() + b"\n"))
            os.read(stop_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(stop_r)
    return pid, out_r, stop_w


def _run_engine(directory: Path, write) -> None:
    writer = TelemetryWriter(directory, {"started_at": time.time()}, engine="e0",
                             model="m", heartbeat_seconds=0.5)
    writer.set(m.KV_BLOCKS, 64)
    write("ready")


def _run_collector(root: Path, write) -> None:
    collector = _collector(root, ENGINE_UID)
    write(json.dumps({"read": sorted(_engines_read(collector)),
                      "errors": [e["error"] for e in collector.status()]}))


def _output_of(uid: int, groups: list[int], body, *args) -> str:
    pid, out, stop = _as_user(uid, groups, body, *args)
    try:
        with os.fdopen(out) as lines:
            return lines.readline()
    finally:
        os.close(stop)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


@needs_root
def test_a_daemon_of_its_own_uid_in_the_engines_group_reads_the_engines_telemetry():
    """The unprivileged DaemonSet: the daemon is not the engine's uid (10001) but its own
    (10002), with the engine's group as a supplementary one; the engine makes its
    directory and files group-readable (whatever its umask), nothing more."""
    base = Path(tempfile.mkdtemp(prefix="ac-observe-trust-", dir="/tmp"))
    engine = None
    try:
        base.chmod(0o755)
        root = base / "telemetry"
        root.mkdir(mode=0o755)
        os.chown(root, ENGINE_UID, ENGINE_UID)
        engine = _as_user(ENGINE_UID, [], _run_engine, root / "e0")
        with os.fdopen(engine[1]) as lines:
            assert lines.readline() == "ready\n"
        directory = root / "e0"
        assert stat.S_IMODE(directory.stat().st_mode) == 0o750
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
        assert modes and set(modes.values()) == {0o640}, modes
        assert json.loads(_output_of(OTHER_UID, [ENGINE_UID], _run_collector, root)) == \
            {"read": ["e0"], "errors": [""]}
        # Outside the engine's group: nothing to read.
        outside = json.loads(_output_of(OTHER_UID, [], _run_collector, root))
        assert outside["read"] == [] and "Permission denied" in outside["errors"][0], outside
    finally:
        if engine is not None:
            os.close(engine[2])
            _, status = os.waitpid(engine[0], 0)
            assert os.waitstatus_to_exitcode(status) == 0
        shutil.rmtree(base)


@needs_root
def test_an_older_engines_private_directory_is_made_group_readable_and_root_reads_both(
        tmp_path):
    root = tmp_path / "telemetry"
    writer = _engine(root / "old", "old", uid=None)
    writer.close()
    (root / "old").chmod(0o700)  # as older engines made them
    for path in (root / "old").iterdir():
        path.chmod(0o600)
    assert _engines_read(_collector(root, None)) == {"old"}  # root reads them as they are
    writer = _engine(root / "old", "old", uid=None)
    try:
        assert stat.S_IMODE((root / "old").stat().st_mode) == 0o750
        assert {stat.S_IMODE(p.stat().st_mode) for p in (root / "old").iterdir()} == {0o640}
        assert _engines_read(_collector(root, None)) == {"old"}
    finally:
        writer.close()


def _start_engine(directory: Path, write) -> None:
    try:
        TelemetryWriter(directory, {"started_at": time.time()}, engine="e0", model="m")
        write("started")
    except Exception as exc:  # what the engine tells its user
        write(f"{type(exc).__name__}: {exc}".replace("\n", " "))


@needs_root
def test_an_older_releases_root_owned_directory_says_whose_it_is_and_what_to_do():
    """Upgrading: engine-0 made by a root engine (0700, files 0600) stays root's after
    the root is handed to uid 10001; the engine says so, not a bare PermissionError."""
    base = Path(tempfile.mkdtemp(prefix="ac-observe-trust-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "telemetry"
        writer = TelemetryWriter(root / "engine-0", {"started_at": time.time()},
                                 engine="e0", model="m")
        writer.close()
        (root / "engine-0").chmod(0o700)
        os.chown(root, ENGINE_UID, ENGINE_UID)  # "chown it to 10001": the top alone
        said = _output_of(ENGINE_UID, [], _start_engine, root / "engine-0")
        assert said.startswith("UnsafeDirectory: "), said
        assert f"{root / 'engine-0'} is owned by uid 0 (mode 0700)" in said, said
        assert "chown -R 10001 it" in said, said
        # The directory handed over, its files not: said too.
        os.chown(root / "engine-0", ENGINE_UID, ENGINE_UID)
        said = _output_of(ENGINE_UID, [], _start_engine, root / "engine-0")
        assert said.startswith("UnsafeDirectory: ") and "of uid 0, not yours" in said, said
        assert f"chown -R 10001 {root / 'engine-0'}" in said, said
        # chown -R, as the docs say: it starts.
        _chown_tree(root / "engine-0", ENGINE_UID)
        assert _output_of(ENGINE_UID, [], _start_engine, root / "engine-0") == "started\n"
    finally:
        shutil.rmtree(base)


def _collect_gone(root: Path, write) -> None:
    """Three cycles of a collector past a gone engine's grace: what it logged."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ac_observe.collectors.engine").addHandler(handler)
    collector = EngineCollector(SimpleNamespace(telemetry_root=root, engine_stale_seconds=1,
                                                engine_grace_seconds=1,
                                                telemetry_owner=ENGINE_UID))
    for _ in range(3):
        collector.collect()
    write(json.dumps(said))


@needs_root
def test_a_gone_engine_this_daemon_may_not_remove_is_said_once_and_left():
    """The unprivileged daemon (uid 10002, group 10001) may read a gone engine's files but
    not remove them: said once for the directory, not every cycle."""
    base = Path(tempfile.mkdtemp(prefix="ac-observe-trust-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "telemetry"
        TelemetryWriter(root / "gone", {"started_at": 0.0}, engine="gone",
                        model="m").close()
        info = json.loads((root / "gone" / "engine.json").read_text())
        (root / "gone" / "engine.json").write_text(json.dumps({**info, "pid": 2 ** 31 - 1}))
        (root / "gone" / "engine.json").chmod(0o640)
        os.utime(root / "gone" / "engine.json", (0, 0))
        root.chmod(0o755)
        _chown_tree(root, ENGINE_UID)
        _chown_tree(root / "gone", ENGINE_UID)
        said = json.loads(_output_of(OTHER_UID, [ENGINE_UID], _collect_gone, root))
        removal = [line for line in said if "cannot remove" in line]
        assert removal == ["cannot remove telemetry of gone engine directory 'gone': "
                           "Permission denied; left in place, not tried again"], said
        assert (root / "gone" / "engine.json").exists()
    finally:
        shutil.rmtree(base)
