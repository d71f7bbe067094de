"""The web-config file in force (`daemon/web_config.py`): the SSLContext new connections
get, the basic-auth users and the response headers, and how they change.

A new connection asks `WebSettings.current()`, which at most once a second looks at the
files it came from (the web-config file, the certificate, the key, the client CA: their
inode, size and mtime, through symlinks, as Kubernetes swaps a mounted secret): when one
changed, everything is read again and a new SSLContext built, so a rotated certificate is
served without a restart. A file that does not load (a half-written key, a certificate
that does not match it) keeps the settings in force and logs why, once per change. A
reload (SIGHUP, `POST /-/reload`) reads them all again and fails loudly instead.

Whether the port speaks TLS is fixed at start: a change that would turn it on or off
is refused until a restart.
"""
from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ac_observe.daemon.credentials import BasicUsers
from ac_observe.daemon.web_config import (
    CIPHER_SUITES,
    CURVES,
    TLS_VERSIONS,
    TlsServerConfig,
    WebConfig,
    WebConfigError,
    read_web_config,
)

log = logging.getLogger("ac_observe.daemon.tls")

CHECK_EVERY_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class WebSnapshot:
    """One reading of the web-config file and what it names, all of it valid."""
    config: WebConfig
    context: ssl.SSLContext | None          # None: plain HTTP
    allowed_sans: frozenset[str] = frozenset()
    headers: dict[str, str] = field(default_factory=dict)
    basic: BasicUsers | None = None         # basic_auth_users
    signature: tuple = ()                   # the files' (inode, size, mtime_ns)


def resolve(base: Path, name: str) -> Path:
    """A file named in the web-config file: relative ones from the file's folder."""
    path = Path(name)
    return path if path.is_absolute() else base / path


def tls_files(config: WebConfig, base: Path) -> list[Path]:
    tls = config.tls_server_config
    if tls is None:
        return []
    return [resolve(base, name) for name in (tls.cert_file, tls.key_file, tls.client_ca_file)
            if name]


def signature(paths: list[Path]) -> tuple:
    out: list[tuple] = []
    for path in paths:
        try:
            stat = path.stat()
            out.append((str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns))
        except OSError as exc:
            out.append((str(path), exc.errno))
    return tuple(out)


def build_context(tls: TlsServerConfig, base: Path, source: str) -> ssl.SSLContext:
    """The server's SSLContext; WebConfigError names the field whose file does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    where = f"{source}: tls_server_config"
    try:
        context.minimum_version = TLS_VERSIONS[tls.min_version]
        context.maximum_version = TLS_VERSIONS[tls.max_version]
    except (ValueError, ssl.SSLError) as exc:
        raise WebConfigError(f"{where}.min_version: this OpenSSL refuses it: {exc}") from None
    suites = [CIPHER_SUITES[name] for name in tls.cipher_suites if name in CIPHER_SUITES]
    if suites:
        try:
            context.set_ciphers(":".join(suites))
        except ssl.SSLError:
            raise WebConfigError(f"{where}.cipher_suites: this OpenSSL enables none of "
                                 "them") from None
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.curve_preferences:
        context.set_ecdh_curve(CURVES[tls.curve_preferences[0]])
    context.set_alpn_protocols(["http/1.1"])
    _load_chain(context, tls, base, where)
    if tls.client_ca_file or tls.client_ca:
        field_name = "client_ca_file" if tls.client_ca_file else "client_ca"
        try:
            if tls.client_ca_file:
                context.load_verify_locations(cafile=str(resolve(base, tls.client_ca_file)))
            else:
                context.load_verify_locations(cadata=tls.client_ca)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise WebConfigError(f"{where}.{field_name}: cannot load the client CA: "
                                 f"{_why(exc)}") from None
        context.verify_mode = (ssl.CERT_REQUIRED
                               if tls.client_auth_type == "RequireAndVerifyClientCert"
                               else ssl.CERT_OPTIONAL)
    return context


def _load_chain(context: ssl.SSLContext, tls: TlsServerConfig, base: Path,
                where: str) -> None:
    """The certificate and key, from their files or from the text inline (written to a
    private temporary file for OpenSSL, gone once read)."""
    with tempfile.TemporaryDirectory(prefix="ac-observe-tls-") as scratch:
        cert = resolve(base, tls.cert_file) if tls.cert_file else None
        key = resolve(base, tls.key_file) if tls.key_file else None
        if cert is None:
            cert = _private_file(Path(scratch) / "cert.pem", tls.cert or "")
        if key is None:
            secret = tls.key.get_secret_value() if tls.key is not None else ""
            key = _private_file(Path(scratch) / "key.pem", secret)
        for name, path, inline in (("cert_file", cert, tls.cert), ("key_file", key, tls.key)):
            if not inline and not path.is_file():
                raise WebConfigError(f"{where}.{name}: {path}: no such file")
        try:
            context.load_cert_chain(str(cert), str(key), password=_no_password)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise WebConfigError(f"{where}.cert_file: cannot load the certificate "
                                 f"({tls.cert_file or 'inline'}) with its key "
                                 f"({tls.key_file or 'inline'}): {_why(exc)}") from None


def _no_password() -> str:
    raise ValueError("the key is encrypted: give it unencrypted (as exporter-toolkit takes "
                     "it), readable by the daemon alone")


def _private_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename or ''}: {exc.strerror}".lstrip(": ")
    return str(exc)


def load_snapshot(path: Path, must_authenticate: bool = False) -> WebSnapshot:
    """Read the web-config file at `path` and what it names; WebConfigError if any of it
    cannot be used. `must_authenticate`: the daemon listens off loopback with no token,
    so the file must make every client prove who it is."""
    before = signature([path])
    config = read_web_config(path)
    base = path.parent
    paths = [path, *tls_files(config, base)]
    sig = before + signature(paths[1:])
    if must_authenticate and not config.authenticates:
        raise WebConfigError(f"{path}: the daemon listens beyond this host with no bearer "
                             "token: basic_auth_users or client_auth_type "
                             "RequireAndVerifyClientCert must guard it")
    context = None
    sans: frozenset[str] = frozenset()
    if config.tls_server_config is not None:
        context = build_context(config.tls_server_config, base, str(path))
        sans = frozenset(config.tls_server_config.client_allowed_sans)
    users = {name: hashed.get_secret_value()
             for name, hashed in (config.basic_auth_users or {}).items()}
    return WebSnapshot(config, context, sans, config.headers(),
                       BasicUsers(users) if users else None, sig)


class WebSettings:
    """The web-config file in force; `current()` from any thread."""

    def __init__(self, path: Path, must_authenticate: bool = False,
                 check_every: float = CHECK_EVERY_SECONDS):
        self.path = path
        self.must_authenticate = must_authenticate
        self.check_every = check_every
        self._snapshot = load_snapshot(path, must_authenticate)
        self.tls = self._snapshot.context is not None
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._failed_signature: tuple | None = None

    def current(self) -> WebSnapshot:
        """The settings in force, read again first when a file changed (checked at most
        every `check_every` seconds)."""
        now = time.monotonic()
        if now - self._checked < self.check_every or not self._lock.acquire(blocking=False):
            return self._snapshot  # another thread is checking: the old one meanwhile
        try:
            self._checked = now
            snapshot = self._snapshot
            paths = [self.path, *tls_files(snapshot.config, self.path.parent)]
            seen = signature(paths)
            if seen == snapshot.signature or seen == self._failed_signature:
                return snapshot
            try:
                self._install(self.load())
                log.info("%s or a file it names changed: read again%s", self.path,
                         ", new connections get the new certificate" if self.tls else "")
            except WebConfigError as exc:
                self._failed_signature = seen
                log.error("%s changed but does not load, the previous settings stay: %s",
                          self.path, exc)
            return self._snapshot
        finally:
            self._lock.release()

    def load(self) -> WebSnapshot:
        """Read everything again (nothing changes yet); WebConfigError if it cannot be
        used, or would turn TLS on or off."""
        snapshot = load_snapshot(self.path, self.must_authenticate)
        if (snapshot.context is not None) != self.tls:
            raise WebConfigError(f"{self.path}: turning TLS {'on' if not self.tls else 'off'}"
                                 " needs a restart")
        return snapshot

    def install(self, snapshot: WebSnapshot) -> None:
        with self._lock:
            self._install(snapshot)

    def _install(self, snapshot: WebSnapshot) -> None:
        self._snapshot = snapshot
        self._failed_signature = None
        self._checked = time.monotonic()
