"""The web-config file (`--web-config-file`): Prometheus exporter-toolkit's format, the one
file every exporter takes for TLS and basic auth, read and checked.

```yaml
tls_server_config: {cert_file: server.crt, key_file: server.key,
                    client_auth_type: RequireAndVerifyClientCert, client_ca_file: ca.crt}
basic_auth_users: {prometheus: $2y$10$...}    # bcrypt hashes
http_server_config: {headers: {X-Frame-Options: deny}}
```

A file that cannot be used raises WebConfigError naming the file and the field
(`web.yml: tls_server_config.cert_fil: unknown field`). Relative paths are read from the
file's own folder, as exporter-toolkit reads them. What Python's `ssl` cannot do as Go's
`crypto/tls` does is refused by name, never dropped in silence: RequestClientCert and
RequireAnyClientCert (OpenSSL verifies every certificate it asks for), a cipher suite
OpenSSL does not know, more than one curve, `rate_limit`.
"""
from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator


class WebConfigError(ValueError):
    """A web-config file that cannot be used; the message names the file and the field."""


TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert",
                     "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
# Go accepts these, but OpenSSL verifies every certificate it asks for: a client
# certificate that is asked for and never verified cannot be had here.
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
VERIFIED_CLIENT_AUTH = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
# Go's cipher suite names (crypto/tls) -> OpenSSL's, for TLS 1.2 and below.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
# TLS 1.3's suites: always on, in Go as in OpenSSL (neither lets a server pick them), so
# naming one is accepted and changes nothing.
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                "TLS_CHACHA20_POLY1305_SHA256")
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1",
          "X25519": "X25519"}
BCRYPT_HASH = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")
HEADER_VALUES = {"X-Frame-Options": ("deny", "sameorigin"),
                 "X-Content-Type-Options": ("nosniff",)}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


class TlsServerConfig(_Section):
    cert: str | None = None
    key: SecretStr | None = None
    client_ca: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_allowed_sans: list[str] = Field(default_factory=list)
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: list[str] = Field(default_factory=list)
    prefer_server_cipher_suites: bool = True
    curve_preferences: list[str] = Field(default_factory=list)

    @field_validator("client_auth_type")
    @classmethod
    def _auth_type(cls, value: str) -> str:
        if value not in CLIENT_AUTH_TYPES:
            raise ValueError(f"{value!r} is not one of {list(CLIENT_AUTH_TYPES)}")
        if value in UNVERIFIED_CLIENT_AUTH:
            raise ValueError(f"{value} is not supported: OpenSSL verifies every client "
                             "certificate it asks for; use VerifyClientCertIfGiven or "
                             "RequireAndVerifyClientCert with client_ca_file")
        return value

    @field_validator("min_version", "max_version")
    @classmethod
    def _version(cls, value: str) -> str:
        if value not in TLS_VERSIONS:
            raise ValueError(f"{value!r} is not one of {list(TLS_VERSIONS)}")
        return value

    @field_validator("cipher_suites")
    @classmethod
    def _suites(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in CIPHER_SUITES and name not in TLS13_SUITES:
                raise ValueError(f"unknown or unsupported cipher suite {name!r} (Go's names, "
                                 f"such as TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
        return value

    @field_validator("curve_preferences")
    @classmethod
    def _curves(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in CURVES:
                raise ValueError(f"unknown or unsupported curve {name!r}: one of "
                                 f"{list(CURVES)}")
        if len(value) > 1:
            raise ValueError("Python's ssl takes one curve: name one")
        return value

    def check(self) -> None:
        """The checks across fields, each naming the field to fix (FieldProblem)."""
        if self.cert and self.cert_file:
            raise FieldProblem("cert", "give cert or cert_file, not both")
        if self.key and self.key_file:
            raise FieldProblem("key", "give key or key_file, not both")
        if self.client_ca and self.client_ca_file:
            raise FieldProblem("client_ca", "give client_ca or client_ca_file, not both")
        if not (self.cert or self.cert_file):
            raise FieldProblem("cert_file", "missing: the server's certificate")
        if not (self.key or self.key_file):
            raise FieldProblem("key_file", "missing: the server's private key")
        has_ca = bool(self.client_ca or self.client_ca_file)
        if self.client_auth_type in VERIFIED_CLIENT_AUTH and not has_ca:
            raise FieldProblem("client_ca_file", f"missing: {self.client_auth_type} "
                               "verifies client certificates against it")
        if has_ca and self.client_auth_type not in VERIFIED_CLIENT_AUTH:
            raise FieldProblem("client_auth_type", "a client CA is given but client "
                               "certificates are not asked for: set "
                               "RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")
        if self.client_allowed_sans and \
                self.client_auth_type != "RequireAndVerifyClientCert":
            raise FieldProblem("client_allowed_sans", "needs client_auth_type "
                               "RequireAndVerifyClientCert (else a client may send no "
                               "certificate, with no name to match)")
        if TLS_VERSIONS[self.min_version] > TLS_VERSIONS[self.max_version]:
            raise FieldProblem("min_version", f"{self.min_version} is above max_version "
                               f"{self.max_version}")


class SecurityHeaders(_Section):
    content_security_policy: str | None = Field(None, alias="Content-Security-Policy")
    x_frame_options: str | None = Field(None, alias="X-Frame-Options")
    x_content_type_options: str | None = Field(None, alias="X-Content-Type-Options")
    x_xss_protection: str | None = Field(None, alias="X-XSS-Protection")
    strict_transport_security: str | None = Field(None, alias="Strict-Transport-Security")

    def as_dict(self) -> dict[str, str]:
        headers = self.model_dump(by_alias=True, exclude_none=True)
        for name, value in headers.items():
            if any(c in value for c in "\r\n"):
                raise FieldProblem(f"headers.{name}", "a header value is one line")
            allowed = HEADER_VALUES.get(name)
            if allowed and value.lower() not in allowed:
                raise FieldProblem(f"headers.{name}", f"{value!r} is not one of "
                                   f"{list(allowed)}")
        return {name: value for name, value in headers.items() if value}


class HttpServerConfig(_Section):
    # HTTP/2 is not served (ALPN offers http/1.1 only): true, Go's default, is taken.
    http2: bool = True
    headers: SecurityHeaders | None = None


class WebConfig(_Section):
    tls_server_config: TlsServerConfig | None = None
    http_server_config: HttpServerConfig | None = None
    basic_auth_users: dict[str, SecretStr] | None = None
    rate_limit: Any = None

    @field_validator("rate_limit")
    @classmethod
    def _rate_limit(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported: --max-requests bounds the requests in flight, "
                             "and the rest wait or get 503")
        return value

    @field_validator("basic_auth_users")
    @classmethod
    def _users(cls, value: dict[str, SecretStr] | None) -> dict[str, SecretStr] | None:
        for user, hashed in (value or {}).items():
            if not user or ":" in user:
                raise ValueError(f"user name {user[:60]!r}: a basic-auth user name is "
                                 "non-empty and has no ':'")
            if not BCRYPT_HASH.fullmatch(hashed.get_secret_value()):
                raise ValueError(f"{user[:60]!r}: not a bcrypt hash (htpasswd -nBC 10 \"\" "
                                 "makes one)")
        return value

    @property
    def tls(self) -> bool:
        return self.tls_server_config is not None

    @property
    def authenticates(self) -> bool:
        """Every request must prove who it is: basic auth, or a verified client cert."""
        return bool(self.basic_auth_users) or (
            self.tls_server_config is not None and
            self.tls_server_config.client_auth_type == "RequireAndVerifyClientCert")

    def headers(self) -> dict[str, str]:
        if self.http_server_config is None or self.http_server_config.headers is None:
            return {}
        return self.http_server_config.headers.as_dict()


class FieldProblem(ValueError):
    """A check across fields, naming the one to fix."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field_name = field_name


def parse_web_config(document: Any, source: str) -> WebConfig:
    """A web-config document checked; WebConfigError names `source` and the field."""
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise WebConfigError(f"{source}: the top level must be a mapping")
    try:
        config = WebConfig.model_validate(document)
    except ValidationError as exc:
        raise WebConfigError(f"{source}: {_first_problem(exc)}") from None
    try:
        if config.tls_server_config is not None:
            try:
                config.tls_server_config.check()
            except FieldProblem as exc:
                raise FieldProblem(f"tls_server_config.{exc.field_name}", str(exc)) from None
        if config.http_server_config is not None:
            try:
                config.headers()
            except FieldProblem as exc:
                raise FieldProblem(f"http_server_config.{exc.field_name}", str(exc)) from None
    except FieldProblem as exc:
        raise WebConfigError(f"{source}: {exc.field_name}: {exc}") from None
    return config


def read_web_config(path: Path) -> WebConfig:
    """The web-config file at `path`, checked (its files are read when TLS is set up)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise WebConfigError(f"{path}: {why}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Not the offending line: a key or a password hash may stand on it.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise WebConfigError(f"{path}: not YAML{where}: "
                             f"{getattr(exc, 'problem', None) or type(exc).__name__}") from None
    return parse_web_config(document, str(path))


def _first_problem(error: ValidationError) -> str:
    """The first problem as `<dotted.field>: <why>`, unknown fields first; never the
    value itself when it may be a secret."""
    details = sorted(error.errors(), key=lambda d: d["type"] != "extra_forbidden")
    detail = details[0]
    where = ".".join(str(part) for part in detail["loc"]) or "(top level)"
    if detail["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    message = detail["msg"].removeprefix("Value error, ")
    if detail["type"] == "missing":
        message = "missing"
    return f"{where}: {message}"
