"""A real PostgreSQL server for the store's tests: initdb into a private folder, pg_ctl start
on a Unix socket there (no TCP), one fresh database per test, stopped at the end.

As root (CI), the server runs as the `postgres` user (initdb refuses root), in a folder
that user owns.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path


class PostgresServer:
    def __init__(self):
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                self.user = "nobody"
        self.folder = Path(tempfile.mkdtemp(prefix="ac-observe-pg-"))
        self.data = self.folder / "data"
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.folder.chmod(0o700)
        self._run(["initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                   "--no-sync", "-E", "UTF8"])
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l",
                   str(self.folder / "log"), "-o",
                   f"-k {self.folder} -c listen_addresses='' -c fsync=off -p 5432", "start"])

    def _run(self, argv: list[str]) -> str:
        binary = shutil.which(argv[0]) or next(
            (str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{argv[0]}"))),
            None)  # Debian keeps the server's binaries off PATH
        if binary is None:
            raise RuntimeError(f"{argv[0]} is not on PATH: install Debian's postgresql")
        argv = [binary, *argv[1:]]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        return subprocess.run(argv, check=True, capture_output=True, text=True,
                              cwd=self.folder).stdout

    def new_database(self) -> str:
        """A fresh database's SQLAlchemy URL."""
        import psycopg
        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(host=str(self.folder), port=5432, user="postgres",
                             dbname="postgres", autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@/{name}?host={self.folder}&port=5432"

    def pause(self) -> None:
        """Stop the server, keeping its data (an outage); `resume` starts it again."""
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop"])

    def resume(self) -> None:
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l",
                   str(self.folder / "log"), "-o",
                   f"-k {self.folder} -c listen_addresses='' -c fsync=off -p 5432", "start"])

    def stop(self) -> None:
        try:
            self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
