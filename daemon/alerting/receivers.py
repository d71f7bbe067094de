"""Receivers: where notifications go, as the alerting file's `receivers:` names them.

A receiver is a webhook (format `alertmanager`: Alertmanager's version-4 body, or
`slack`: an incoming-webhook message), signed per Standard Webhooks when it has a
secret, or a Grafana (format `grafana`: its base URL, reached with a service-account
token) that marks each transition as an annotation. Secrets and tokens come from the
file, a file it names (`*_file`) or the environment (`*_env`), never from a log.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from ac_observe.auth import header_token_ok
from ac_observe.daemon.alerting.spec import AlertConfigError, FieldError, NamedSpec, checked_entries

FORMATS = ("alertmanager", "slack", "grafana")
CREDENTIALS = ("secret", "secret_file", "secret_env", "token", "token_file", "token_env")


@dataclass(frozen=True, slots=True)
class Receiver:
    name: str
    url: str
    format: str = "alertmanager"
    secret: str | None = field(default=None, repr=False)  # standardwebhooks "whsec_..."
    timeout_seconds: float = 10.0
    token: str | None = field(default=None, repr=False)   # grafana: bearer token

    def signer(self):
        if self.secret is None:
            return None
        from standardwebhooks.webhooks import Webhook
        return Webhook(self.secret)


class ReceiverSpec(NamedSpec):
    """One receiver as an alerting file writes it; a credential is given at most once, as
    itself, `*_file` or `*_env`."""
    when_missing: ClassVar[dict[str, str]] = {
        "name": "a name of 1-200 characters is required", "url": "a URL is required"}
    name: str = Field(description="How logs, metrics and `alerts test` name it.",
                      json_schema_extra={"minLength": 1, "maxLength": 200})
    url: str = Field(description="http(s) URL of the webhook, or Grafana's base URL.")
    format: str = Field("alertmanager", json_schema_extra={"enum": list(FORMATS)})
    timeout_seconds: float = Field(10.0, description="Per attempt; (0, 300].",
                                   json_schema_extra={"exclusiveMinimum": 0, "maximum": 300})
    secret: str | None = Field(None, description="Standard Webhooks secret (whsec_...).")
    secret_file: str | None = None
    secret_env: str | None = None
    token: str | None = Field(None, description="grafana: a service-account token.")
    token_file: str | None = None
    token_env: str | None = None

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> str:
        if not isinstance(value, str) or not value.strip() or len(value) > 200:
            raise ValueError("a name of 1-200 characters is required")
        return value

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, value: Any) -> str:
        return check_url(value)

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> str:
        if value not in FORMATS:
            raise ValueError(f"{value!r} is not one of {list(FORMATS)}")
        return value

    @field_validator("timeout_seconds", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not 0 < value <= 300:
            raise ValueError("a number in (0, 300]")
        return float(value)

    @field_validator(*CREDENTIALS, mode="before")
    @classmethod
    def _credential(cls, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("must be a non-empty string")
        return value

    @model_validator(mode="after")
    def _credentials_fit_the_format(self) -> ReceiverSpec:
        # Grafana is reached with a token and posts no signature; a webhook the reverse.
        unused = "secret" if self.format == "grafana" else "token"
        wrong = [key for key in CREDENTIALS if key.startswith(unused) and getattr(self, key)]
        if wrong:
            raise FieldError(f"format {self.format} takes no {unused} (a grafana receiver "
                             f"takes a token, a webhook a secret)", wrong[0])
        return self


def check_url(url: Any) -> str:
    """An http(s) URL with a host, stripped; ValueError says what is wrong with it."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("a URL is required")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{parts.scheme or 'no'} scheme: use http or https")
    try:
        host, _ = parts.hostname, parts.port  # a bad port raises here
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    if not host:
        raise ValueError("no host in the URL")
    if parts.fragment:
        raise ValueError("a URL fragment is never sent; remove it")
    return url.strip()


def _credential(spec: ReceiverSpec, where: str, key: str) -> tuple[str, str] | None:
    """(field given, value) of `key`, `key_file` or `key_env` (at most one), or None."""
    given = [name for name in (key, f"{key}_file", f"{key}_env") if getattr(spec, name)]
    if len(given) > 1:
        raise AlertConfigError(f"{where}: give one of {key}, {key}_file, {key}_env")
    if not given:
        return None
    name = given[0]
    value = getattr(spec, name)
    if name.endswith("_file"):
        try:
            read = Path(value).read_text().strip()
        except OSError as exc:
            raise AlertConfigError(f"{where}.{name}: {exc.strerror}: {value}") from None
        if not read:
            raise AlertConfigError(f"{where}.{name}: the file is empty: {value}")
        return name, read
    if name.endswith("_env"):
        read = os.environ.get(value, "").strip()
        if not read:
            raise AlertConfigError(f"{where}.{name}: ${value} is unset or empty")
        return name, read
    return name, value.strip()


def _secret(spec: ReceiverSpec, where: str) -> str | None:
    given = _credential(spec, where, "secret")
    if given is None:
        return None
    key, secret = given
    from standardwebhooks.webhooks import Webhook
    try:
        signer = Webhook(secret)
    except Exception:
        raise AlertConfigError(f"{where}.{key}: not a Standard Webhooks secret (whsec_ and "
                               "base64 of at least 24 bytes)") from None
    if len(signer._whsecret) < 24:
        raise AlertConfigError(f"{where}.{key}: the secret is shorter than 24 bytes")
    return secret


def _token(spec: ReceiverSpec, where: str) -> str | None:
    given = _credential(spec, where, "token")
    if given is None:
        return None
    key, token = given
    if not header_token_ok(token):
        raise AlertConfigError(f"{where}.{key}: a token is one line without spaces")
    return token


def parse_receivers(raw: Any, source: str) -> dict[str, Receiver]:
    """`receivers:` of an alerting file (already parsed), checked field by field."""
    return {spec.name: Receiver(spec.name, spec.url, spec.format, _secret(spec, named),
                                spec.timeout_seconds, _token(spec, named))
            for named, spec in checked_entries(raw, source, "receivers", ReceiverSpec)}


def grafana_receiver(url: str, token: str | None, name: str = "grafana") -> Receiver:
    """The receiver the daemon's --grafana-url stands for: annotations in that Grafana."""
    try:
        url = check_url(url)
    except ValueError as exc:
        raise AlertConfigError(f"--grafana-url: {exc}") from None
    if token is not None:
        token = token.strip()
        if not header_token_ok(token):
            raise AlertConfigError("the Grafana token is empty or not one line without "
                                   "spaces")
    return Receiver(name, url, "grafana", token=token)
