"""The telemetry directory is hostile input: other users, broken or malicious files, and
users' own files. None of it redirects an engine's writes, hides another engine from the
daemon, hangs or bloats the daemon, or costs a user a file."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from ac_observe import metrics as m
from ac_observe.engine.telemetry import TelemetryWriter
from ac_observe.telemetry_format import (
    UnsafeDirectory,
    ValueFile,
    db_file_name,
    open_dir_nofollow,
    sample_key,
)
from support.servers import EngineServer, sample_value, wait_for

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def _writer(directory: Path, engine: str) -> TelemetryWriter:
    writer = TelemetryWriter(directory, {"started_at": time.time()}, engine=engine,
                             model="m", heartbeat_seconds=0.5)
    writer.set(m.KV_BLOCKS, 64)
    return writer


# ----- another user's directories ------------------------------------------------------------

@needs_root
def test_foreign_directories_and_planted_symlinks_never_redirect_a_root_engine():
    base = Path(tempfile.mkdtemp(prefix="ac-hostile-", dir="/tmp"))
    try:
        shared = base / "shared"
        shared.mkdir(mode=0o1777)  # like /tmp: anyone may create entries
        shared.chmod(0o1777)
        base.chmod(0o755)
        secret = base / "root-only.conf"
        secret.write_bytes(b"root secret\n")
        secret.chmod(0o600)
        before = secret.read_bytes()
        # As nobody: pre-create the root's telemetry root and an engine directory in it,
        # with symlinks where the engine writes (engine.json, its temporary, its files).
        root = shared / "ac-observe-0" / "telemetry"
        pid = os.getpid()
        links = " ".join(f"ln -s {secret} {root}/e1/{name};" for name in (
            "engine.json", f".engine.json.{pid}", f"counter_{pid}.db"))
        script = (f"mkdir -p {root}/e1 && chmod 777 {root}/e1 && {links} "
                  f"ln -s {base} {root}/e2")
        # And a symlink of nobody's, in the shared directory, to an empty directory of root's.
        empty = base / "empty-root-dir"
        empty.mkdir(mode=0o755)
        script += f" && ln -s {empty} {shared}/ac-observe-1"
        subprocess.run(["runuser", "-u", "nobody", "--", "/bin/sh", "-c", script], check=True)
        with pytest.raises(UnsafeDirectory, match="symlink owned by uid 65534"):
            _writer(shared / "ac-observe-1" / "e1", "e")
        assert list(empty.iterdir()) == []
        # A root daemon told to read that root refuses it rather than clean up inside it.
        from types import SimpleNamespace

        from ac_observe.collectors.base import CollectorUnavailable
        from ac_observe.collectors.engine import EngineCollector
        for lured in (root, shared / "ac-observe-1"):
            collector = EngineCollector(SimpleNamespace(
                telemetry_root=lured, engine_stale_seconds=0, engine_grace_seconds=0,
                telemetry_owner=None))
            with pytest.raises(CollectorUnavailable, match="uid 65534"):
                collector.collect()
        root = shared / "ac-observe-0" / "telemetry"
        for target in (root / "e1", root / "e2", root / "e3"):
            with pytest.raises(UnsafeDirectory) as refused:
                _writer(target, "e")
            assert "uid 65534" in str(refused.value) or "symlink" in str(refused.value)
        # A directory of ours that others could write into is refused just the same.
        open_dir = base / "ours-but-open"
        open_dir.mkdir()
        open_dir.chmod(0o777)
        with pytest.raises(UnsafeDirectory, match="writable by other users"):
            _writer(open_dir / "e1", "e")
        assert secret.read_bytes() == before
        assert oct(secret.stat().st_mode & 0o777) == "0o600"
    finally:
        shutil.rmtree(base)


def test_engine_refuses_a_directory_holding_other_files(tmp_path):
    project = tmp_path / "my-project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeDirectory, match="notes.txt"):
        _writer(project, "e")
    from support.servers import run_cli
    out = run_cli("engine", "--telemetry-dir", str(project), "--port", "1", timeout=120)
    assert out.returncode != 0
    assert "notes.txt" in out.stdout + out.stderr
    assert (project / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_one_engine_per_directory_and_the_daemon_never_removes_a_held_one(tmp_path):
    from types import SimpleNamespace

    from ac_observe.collectors.engine import EngineCollector
    first = _writer(tmp_path / "root" / "e1", "e1")
    try:
        with pytest.raises(UnsafeDirectory, match="in use by another running engine"):
            TelemetryWriter(tmp_path / "root" / "e1", {}, engine="e1", model="m")
        # Its heartbeat looks long gone and engine.json names a dead pid: still held.
        info = json.loads((tmp_path / "root" / "e1" / "engine.json").read_text())
        (tmp_path / "root" / "e1" / "engine.json").write_text(json.dumps(
            {**info, "pid": 2 ** 31 - 1}))
        os.utime(tmp_path / "root" / "e1" / "engine.json", (0, 0))
        collector = EngineCollector(SimpleNamespace(telemetry_root=tmp_path / "root",
                                                    engine_stale_seconds=1,
                                                    engine_grace_seconds=1, telemetry_owner=None))
        collector.collect()
        assert (tmp_path / "root" / "e1" / "engine.json").exists()
    finally:
        first.close()
    collector.collect()  # released: now it goes
    assert not (tmp_path / "root" / "e1").exists()


@pytest.mark.slow
def test_a_users_file_survives_the_engines_death_and_the_grace(start_daemon, tmp_path):
    root = tmp_path / "telemetry"
    daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s",
                          "--engine-stale", "1s", "--engine-grace", "1s")
    engine = EngineServer(root / "e1", "--engine-name", "e1").wait_ready()
    (root / "e1" / "keep-me.txt").write_text("a user's file")
    engine.proc.kill()
    engine.proc.wait()
    engine.log.close()
    # The daemon removes the engine's files one by one: wait for the last of them.
    wait_for(lambda: sorted(p.name for p in (root / "e1").iterdir()) == ["keep-me.txt"], 20,
             "the dead engine's files to go, and nothing else")
    assert (root / "e1" / "keep-me.txt").read_text() == "a user's file"
    daemon.wait_cycles(3)  # further cycles leave it alone too
    assert (root / "e1" / "keep-me.txt").exists()
    assert httpx.get(daemon.url + "/healthz").status_code == 200


# ----- malformed engine directories -------------------------------------------------------

def _bad_db(directory: Path, key: str) -> None:
    fd = open_dir_nofollow(directory)
    try:
        value_file = ValueFile(fd, db_file_name("counter", 424242))
        value_file.write(key, 1.0, 0.0)
        value_file.close()
    finally:
        os.close(fd)


def _truncated(d: Path):
    (d / db_file_name("counter", os.getpid())).open("r+b").truncate(100)


def _sparse_db(d: Path):
    with (d / db_file_name("counter", 434343)).open("wb") as f:
        f.write((1 << 30).to_bytes(4, "little") + b"\0" * 4)
        f.truncate(1 << 30)


def _info(d: Path, raw: bytes):
    (d / "engine.json").write_bytes(raw)


def _info_dir(d: Path):
    (d / "engine.json").unlink()
    (d / "engine.json").mkdir()


def _fifo(d: Path):
    (d / "engine.json").unlink()
    os.mkfifo(d / "engine.json")


def _huge_info(d: Path):
    with (d / "engine.json").open("r+b") as f:
        f.truncate(100 << 20)


def _valid_info(**changes) -> bytes:
    info = {"engine": "bad", "model": "m", "pid": os.getpid(),
            "telemetry_format": "prometheus-multiprocess-v1"}
    return json.dumps({**info, **changes}).encode()


LABELS = {"engine": "bad", "model": "m", "stream": "low_latency"}
VARIANTS = {
    "truncated .db": (_truncated, "claims"),
    "key not JSON": (lambda d: _bad_db(d, "not json"), "not JSON"),
    "key of the wrong shape": (lambda d: _bad_db(d, "[1, 2, 3]"), "not [family"),
    "le=abc": (lambda d: _bad_db(d, sample_key(
        "ac_inference_latency_seconds", "ac_inference_latency_seconds_bucket",
        {**LABELS, "le": "abc"}, "h")), "not one of its buckets"),
    "le=3 beside le=3.0": (lambda d: _bad_db(d, sample_key(
        "ac_skeleton_complexity", "ac_skeleton_complexity_bucket",
        {"engine": "bad", "model": "m", "le": "3"}, "h")), "not one of its buckets"),
    "engine.json not UTF-8": (lambda d: _info(d, b'{"engine": "\xff\xfe"}'), "not UTF-8"),
    "engine.json a directory": (_info_dir, "not a regular file"),
    "engine.json a list": (lambda d: _info(d, b"[1, 2]"), "holds a list"),
    "pid 2**70": (lambda d: _info(d, _valid_info(pid=2 ** 70)), "out of range"),
    "engine name taken": (lambda d: _info(d, _valid_info(engine="healthy")), "already served"),
    "100 MB engine.json": (_huge_info, "limit"),
    "sparse 1 GiB .db": (_sparse_db, "claims"),
    "FIFO engine.json": (_fifo, "not a regular file"),  # last: SIGTERM is tried with it
}


def _engine_series(metrics: dict, engine: str) -> list:
    """The series read from an engine's files (not the daemon's utilisation gauge)."""
    return [k for k in metrics
            if ("engine", engine) in k[1] and k[0] != m.STREAM_UTILIZATION.name]


def _rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


@pytest.mark.slow
def test_a_bad_engine_directory_is_that_engines_problem_alone(start_daemon, tmp_path):
    root = tmp_path / "telemetry"
    daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s",
                          "--engine-stale", "60s")
    healthy = _writer(root / "healthy", "healthy")
    try:
        wait_for(lambda: sample_value(daemon.metrics(), "ac_kv_cache_blocks",
                                      engine="healthy") == 64, 10, "the healthy engine")
        baseline_series = len(_engine_series(daemon.metrics(), "healthy"))
        for variant, (corrupt, reason) in VARIANTS.items():
            bad = root / "zz-bad"
            _writer(bad, "bad").close()
            corrupt(bad)
            deadline = time.monotonic() + 10
            while True:
                metrics = daemon.metrics()  # every scrape still holds the healthy engine
                assert len(_engine_series(metrics, "healthy")) == baseline_series, variant
                status = httpx.get(daemon.url + "/api/v1/status", timeout=10)
                assert status.status_code == 200, variant
                entry = [e for e in status.json()["engines"] if e["directory"].endswith("zz-bad")]
                if entry and reason in entry[0]["error"] + entry[0]["warning"]:
                    break
                assert time.monotonic() < deadline, (variant, entry)
                time.sleep(0.25)
            assert _rss_kib(daemon.proc.pid, "VmHWM") < 400 << 10, variant
            if variant != "FIFO engine.json":
                shutil.rmtree(bad)
        stopped = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.proc.wait(timeout=5)
        assert time.monotonic() - stopped < 5
    finally:
        healthy.close()
