"""Alert webhooks: receivers from the alerting file, Alertmanager-v4 (or Slack) bodies,
Standard Webhooks signatures, and a sender that delivers the store's outbox until each
delivery is acknowledged.

Delivery rules: only a 2xx answer delivers. 410 Gone disables the receiver (until its URL
changes in the file): its pending deliveries end as `disabled`. Anything else (refused,
timed out, 429, 5xx, another 4xx) is retried with exponential backoff (1 s doubling to 5
min, each wait drawn between half and all of it) or after the receiver's `Retry-After`
(seconds or an HTTP date; at most an hour), until the delivery is `max_age` old (24 h),
when it ends as `failed`. Each attempt is signed afresh (a new `webhook-timestamp`) under
the same `webhook-id`, so a receiver dedupes retries by that id. Deliveries live in the
store: a daemon killed mid-post posts again after the claim's lease (60 s), under the
same id.

A receiver of format `grafana` is a Grafana (its base URL): each transition becomes an
annotation (`POST /api/annotations`, a service-account token as bearer), a point when the
alert fires and a region from start to end when it resolves, tagged `ac-observe`, the
status and every label as `name:value`, so the generated dashboards' "ac-observe alerts"
annotation query shows them on every board. Grafana has no idempotency key: before every
post the sender looks for the annotation an unanswered earlier attempt may have left
(same tags, time and text; a daemon killed mid-post records no attempt) and counts it
delivered instead of posting a second.

NOTE: the sender never logs a body, a signature, a token or a secret; a receiver is named by
its `name`, and its URL only in the status it came from (the alerting file).
"""
from __future__ import annotations

import email.utils
import hashlib
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from ac_observe.auth import header_token_ok
from ac_observe.daemon.store import DELIVERED, DISABLED, FAILED, PENDING, Delivery, Store

log = logging.getLogger("ac_observe.daemon.webhooks")

FORMATS = ("alertmanager", "slack", "grafana")
ANNOTATION_TAG = "ac-observe"  # every Grafana annotation carries it; the dashboards filter on it
ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of an alert still firing


class AlertConfigError(ValueError):
    """An alerting file that cannot be used; the message names the file and the field."""


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


def _check_url(url: str, where: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise AlertConfigError(f"{where}: a URL is required")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise AlertConfigError(f"{where}: {parts.scheme or 'no'} scheme: use http or https")
    try:
        host, _ = parts.hostname, parts.port  # a bad port raises here
    except ValueError as exc:
        raise AlertConfigError(f"{where}: {exc}") from None
    if not host:
        raise AlertConfigError(f"{where}: no host in the URL")
    if parts.fragment:
        raise AlertConfigError(f"{where}: a URL fragment is never sent; remove it")
    return url.strip()


def _credential(entry: dict, where: str, key: str) -> tuple[str, str] | None:
    """(field given, value) of `key`, `key_file` or `key_env` (at most one), or None."""
    given = [k for k in (key, f"{key}_file", f"{key}_env") if k in entry]
    if len(given) > 1:
        raise AlertConfigError(f"{where}: give one of {key}, {key}_file, {key}_env")
    if not given:
        return None
    name = given[0]
    value = entry[name]
    if not isinstance(value, str) or not value.strip():
        raise AlertConfigError(f"{where}.{name}: must be a non-empty string")
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


def _secret(entry: dict, where: str) -> str | None:
    given = _credential(entry, where, "secret")
    if given is None:
        return None
    key, secret = given
    from standardwebhooks.webhooks import Webhook
    try:
        Webhook(secret)
    except Exception:
        raise AlertConfigError(f"{where}.{key}: not a Standard Webhooks secret (whsec_ and "
                               "base64 of at least 24 bytes)") from None
    if len(Webhook(secret)._whsecret) < 24:
        raise AlertConfigError(f"{where}.{key}: the secret is shorter than 24 bytes")
    return secret


def _token(entry: dict, where: str) -> str | None:
    given = _credential(entry, where, "token")
    if given is None:
        return None
    key, token = given
    if not header_token_ok(token):
        raise AlertConfigError(f"{where}.{key}: a token is one line without spaces")
    return token


def parse_receivers(raw, source: str) -> dict[str, Receiver]:
    """`receivers:` of an alerting file (already parsed), checked field by field."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise AlertConfigError(f"{source}: receivers: must be a list")
    receivers: dict[str, Receiver] = {}
    for i, entry in enumerate(raw):
        where = f"{source}: receivers[{i}]"
        if not isinstance(entry, dict):
            raise AlertConfigError(f"{where}: must be a mapping")
        unknown = set(entry) - {"name", "url", "format", "secret", "secret_file",
                                "secret_env", "token", "token_file", "token_env",
                                "timeout_seconds"}
        if unknown:
            raise AlertConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise AlertConfigError(f"{where}.name: a name of 1-200 characters is required")
        where = f"{source}: receivers[{i}] ({name})"
        if name in receivers:
            raise AlertConfigError(f"{where}.name: {name!r} is used twice")
        fmt = entry.get("format", "alertmanager")
        if fmt not in FORMATS:
            raise AlertConfigError(f"{where}.format: {fmt!r} is not one of {list(FORMATS)}")
        timeout = entry.get("timeout_seconds", 10.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
                not 0 < timeout <= 300:
            raise AlertConfigError(f"{where}.timeout_seconds: a number in (0, 300]")
        # Grafana is reached with a token and posts no signature; a webhook the reverse.
        unused = "secret" if fmt == "grafana" else "token"
        wrong = [k for k in entry if k.startswith(unused)]
        if wrong:
            raise AlertConfigError(f"{where}.{wrong[0]}: format {fmt} takes no {unused} "
                                   f"(a grafana receiver takes a token, a webhook a secret)")
        receivers[name] = Receiver(name, _check_url(entry.get("url"), f"{where}.url"), fmt,
                                   _secret(entry, where), float(timeout),
                                   _token(entry, where))
    return receivers


def grafana_receiver(url: str, token: str | None, name: str = "grafana") -> Receiver:
    """The receiver the daemon's --grafana-url stands for: annotations in that Grafana."""
    url = _check_url(url, "--grafana-url")
    if token is not None:
        token = token.strip()
        if not header_token_ok(token):
            raise AlertConfigError("the Grafana token is empty or not one line without "
                                   "spaces")
    return Receiver(name, url, "grafana", token=token)


def load_alerting(path: str | os.PathLike) -> dict[str, Receiver]:
    """The receivers of an alerting YAML file; AlertConfigError names what to fix."""
    return parse_receivers(read_alerting(path).get("receivers"), str(path))


def read_alerting(path: str | os.PathLike) -> dict:
    """An alerting file's document (receivers, rules), its top level checked."""
    import yaml
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AlertConfigError(f"{source}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AlertConfigError(f"{source}: not YAML: {exc}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise AlertConfigError(f"{source}: the top level must be a mapping")
    unknown = set(document) - {"receivers", "rules"}
    if unknown:
        raise AlertConfigError(f"{source}: unknown section {sorted(unknown)[0]!r}")
    return document


# ----- bodies ----------------------------------------------------------------------------

def fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set: FNV-1a 64 over the sorted names and
    values, each followed by 0xff (prometheus/common model.LabelSet.Fingerprint)."""
    h = 0xcbf29ce484222325
    for name in sorted(labels):
        for part in (name, labels[name]):
            for byte in part.encode() + b"\xff":
                h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def rfc3339(seconds: float | None) -> str:
    if seconds is None:
        return ZERO_TIME
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


@dataclass(frozen=True, slots=True)
class Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    status: str                     # firing | resolved
    starts_at: float
    ends_at: float | None = None    # set when resolved
    generator_url: str = ""


def _common(dicts: list[dict]) -> dict:
    if not dicts:
        return {}
    first = dicts[0]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in dicts[1:])}


def alertmanager_body(receiver: str, alerts: list[Alert], external_url: str) -> dict:
    """The body Alertmanager posts to a webhook receiver (version 4). Each notification is
    one alert instance, grouped by all its labels (Alertmanager's `group_by: ['...']`), so
    a receiver keying incidents by groupKey never sees one instance's resolution close
    another's."""
    group_labels = dict(alerts[0].labels)
    status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
    return {
        "version": "4",
        "groupKey": "{}:{%s}" % ", ".join(f"{k}={json.dumps(v)}"
                                           for k, v in sorted(group_labels.items())),
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a.labels for a in alerts]),
        "commonAnnotations": _common([a.annotations for a in alerts]),
        "externalURL": external_url,
        "alerts": [{"status": a.status, "labels": a.labels, "annotations": a.annotations,
                    "startsAt": rfc3339(a.starts_at), "endsAt": rfc3339(a.ends_at),
                    "generatorURL": a.generator_url, "fingerprint": fingerprint(a.labels)}
                   for a in alerts],
    }


def slack_body(alerts: list[Alert]) -> dict:
    """A Slack incoming-webhook message: one line per alert."""
    lines = []
    for a in alerts:
        mark = ":red_circle:" if a.status == "firing" else ":large_green_circle:"
        summary = a.annotations.get("summary") or a.labels.get("alertname", "alert")
        lines.append(f"{mark} *{a.status.upper()}* {summary}")
    return {"text": "\n".join(lines)}


def _tag(name: str, value: str) -> str:
    """`name:value` as Grafana keeps a tag (key and value up to 100 characters each,
    trimmed): a longer value is cut and marked with a hash of the whole, so it still tells
    series apart (the fingerprint tag names the alert exactly)."""
    name, value = name.strip()[:100], value.strip()
    if len(value) > 100:
        digest = hashlib.sha256(value.encode()).hexdigest()[:8]
        value = f"{value[:90].rstrip()}~{digest}"
    return f"{name}:{value}"


def grafana_annotation(alerts: list[Alert]) -> dict:
    """A Grafana annotation (`POST /api/annotations`) of one alert's transition: a point at
    its start when it fires, a region from start to end when it resolves."""
    if len(alerts) != 1:
        raise ValueError("a Grafana annotation is one alert's transition")
    alert, = alerts
    name = alert.labels.get("alertname", "alert")
    text = f"{alert.status.upper()}: {alert.annotations.get('summary') or name}"
    if alert.annotations.get("description"):
        text += "\n" + alert.annotations["description"]
    body = {"time": int(round(alert.starts_at * 1000)),
            "tags": [ANNOTATION_TAG, alert.status,
                     f"fingerprint:{fingerprint(alert.labels)}"]
            + [_tag(k, v) for k, v in sorted(alert.labels.items())],
            "text": text}
    if alert.status == "resolved" and alert.ends_at is not None:
        body["timeEnd"] = int(round(alert.ends_at * 1000))
    return body


def body_for(receiver: Receiver, alerts: list[Alert], external_url: str) -> dict:
    if receiver.format == "slack":
        return slack_body(alerts)
    if receiver.format == "grafana":
        return grafana_annotation(alerts)
    return alertmanager_body(receiver.name, alerts, external_url)


def test_alert(now: float, host: str) -> Alert:
    return Alert(labels={"alertname": "AcObserveTestAlert", "severity": "none",
                         "instance": host},
                 annotations={"summary": "ac-observe test delivery",
                              "description": "Sent by `ac-observe alerts test`; nothing "
                                             "is wrong."},
                 status="firing", starts_at=now)


# ----- delivery --------------------------------------------------------------------------

def signed_headers(receiver: Receiver, delivery_id: str, body: str, now: float) -> dict:
    headers = {"content-type": "application/json", "user-agent": "ac-observe",
               "webhook-id": delivery_id, "webhook-timestamp": str(int(now))}
    signer = receiver.signer()
    if signer is not None:
        stamp = datetime.fromtimestamp(int(now), tz=timezone.utc)
        headers["webhook-signature"] = signer.sign(delivery_id, stamp, body)
    return headers


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(when.timestamp() - now, 0.0)


@dataclass(frozen=True, slots=True)
class Backoff:
    first: float = 1.0
    cap: float = 300.0
    max_retry_after: float = 3600.0
    max_age: float = 86400.0

    def delay(self, attempts: int, rng: random.Random) -> float:
        """Wait before the attempt after `attempts` failed ones: equal jitter."""
        full = min(self.cap, self.first * 2 ** max(attempts - 1, 0))
        return full * rng.uniform(0.5, 1.0)


OUTCOMES = ("delivered", "retried", "failed", "disabled")


def _holds(found: httpx.Response, annotation: dict) -> bool | None:
    """Whether Grafana's find-annotations answer holds `annotation` already (None: not an
    answer to read)."""
    try:
        items = found.json()
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    want_end = annotation.get("timeEnd", annotation["time"])
    return any(
        isinstance(item, dict) and item.get("time") == annotation["time"]
        and item.get("timeEnd", item.get("time")) == want_end
        and item.get("text") == annotation["text"]
        and set(annotation["tags"]) <= set(item.get("tags") or ())
        for item in items)


class WebhookSender:
    """Delivers the outbox. `run_once` does one pass (tests drive it); `start` runs passes
    on one thread per receiver, woken at once by `wake` after an enqueue, so a receiver
    that hangs until its timeout delays only its own deliveries."""

    def __init__(self, store: Store, receivers: dict[str, Receiver], external_url: str = "",
                 backoff: Backoff = Backoff(), clock=time.time, seed: int | None = None,
                 poll_seconds: float = 1.0):
        self.store = store
        self.receivers = receivers
        self.external_url = external_url
        self.backoff = backoff
        self.clock = clock
        self.poll_seconds = poll_seconds
        self._rng = random.Random(seed)
        self._clients = {name: httpx.Client(follow_redirects=False, trust_env=False)
                         for name in receivers}
        self.outcomes: dict[tuple[str, str], int] = {
            (name, outcome): 0 for name in receivers for outcome in OUTCOMES}
        self.queue: dict[str, tuple[int, float]] = {}  # receiver -> (pending, oldest age)
        self._wakes = {name: threading.Event() for name in receivers}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._warned: set[str] = set()  # receivers whose refusals were logged once
        # A receiver whose URL changed since a 410 disabled it is tried again.
        for name, url in store.disabled().items():
            if name in receivers and receivers[name].url != url:
                store.enable_receiver(name)

    def enqueue(self, alerts: list[Alert], kind: str, connection=None) -> list[str]:
        """One delivery per receiver (inside the caller's transaction when given one)."""
        now = self.clock()
        ids = []
        for receiver in self.receivers.values():
            body = body_for(receiver, alerts, self.external_url)
            if connection is None:
                ids.append(self.store.add(receiver.name, kind, body, now))
            else:
                ids.append(self.store.enqueue(connection, receiver.name, kind, body, now))
        self.wake()
        return ids

    def send_test(self, host: str) -> list[str]:
        return self.enqueue([test_alert(self.clock(), host)], "test")

    def run_once(self, only: list[str] | None = None,
                 receivers: list[str] | None = None) -> int:
        """One pass: every due delivery (among `only`, and to `receivers`, when given)
        attempted once, claimed one at a time; the queue figures refreshed."""
        try:
            return self._deliver_due(only, list(self.receivers) if receivers is None
                                     else receivers)
        finally:
            self.queue = self.store.pending_by_receiver(self.clock())

    def _deliver_due(self, only: list[str] | None, receivers: list[str]) -> int:
        done = 0
        tried: set[str] = set()
        while True:
            disabled = self.store.disabled()  # a 410 earlier in this pass counts at once
            active = [name for name in receivers if name not in disabled]
            if not active:
                return done
            # A post may take connect + write + read (+ pool) timeouts: the lease covers all.
            lease = 60.0 + 4 * max(self.receivers[n].timeout_seconds for n in active)
            delivery = self.store.claim_one(self.clock(), active, lease, only)
            if delivery is None or delivery.id in tried:
                return done
            tried.add(delivery.id)
            self._attempt(delivery)
            done += 1

    def _attempt(self, delivery: Delivery) -> None:
        receiver = self.receivers[delivery.receiver]
        now = self.clock()
        started = time.monotonic()
        status = error = None
        wait = None
        try:
            response = self._send(receiver, delivery, now)
            status = response.status_code
            wait = retry_after(response.headers.get("retry-after"), now)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        seconds = time.monotonic() - started
        if status is not None and 200 <= status < 300:
            self.store.record_attempt(delivery, now, seconds, status, None, DELIVERED)
            self._count(receiver.name, "delivered")
            return
        if status == 410:
            reason = "410 Gone: the receiver asked to stop; change its url to resume"
            self.store.record_attempt(delivery, now, seconds, status, reason, DISABLED)
            self.store.disable_receiver(receiver.name, receiver.url, now, reason)
            self._count(receiver.name, "disabled")
            log.warning("webhook receiver %s answered 410 Gone: disabled", receiver.name)
            return
        error = error or f"HTTP {status}"
        if receiver.format == "grafana" and status in (400, 404, 413, 422):
            # The annotation or the URL is wrong: retrying the same request cannot help.
            self._give_up(delivery, now, seconds, status, error,
                          "Grafana refused it: check the receiver's url (Grafana's base URL) "
                          "and version")
            return
        if receiver.format == "grafana" and status in (401, 403) and \
                receiver.name not in self._warned:
            self._warned.add(receiver.name)
            log.warning("Grafana receiver %s answers %s: its token is missing, wrong or "
                        "lacks annotation rights (a service account with Editor); retrying",
                        receiver.name, status)
        if now - delivery.created_at >= self.backoff.max_age:
            self._give_up(delivery, now, seconds, status, error, "too old to retry")
            return
        delay = self.backoff.delay(delivery.attempts + 1, self._rng)
        if wait is not None:  # at least the first backoff step: Retry-After: 0 never spins
            delay = max(min(wait, self.backoff.max_retry_after), self.backoff.first)
        self.store.record_attempt(delivery, now, seconds, status, error, PENDING,
                                  next_attempt_at=now + delay)
        self._count(receiver.name, "retried")
        log.info("webhook delivery %s to %s: %s; next try in %.1f s", delivery.id,
                 receiver.name, error, delay)

    def _give_up(self, delivery: Delivery, now: float, seconds: float, status: int | None,
                 error: str, why: str) -> None:
        self.store.record_attempt(delivery, now, seconds, status, error, FAILED)
        self._count(delivery.receiver, "failed")
        log.error("webhook delivery %s to %s failed for good after %d attempts (%s): %s",
                  delivery.id, delivery.receiver, delivery.attempts + 1, why, error)

    def _send(self, receiver: Receiver, delivery: Delivery, now: float) -> httpx.Response:
        client = self._clients[receiver.name]
        if receiver.format != "grafana":
            return client.post(receiver.url, content=delivery.body.encode(),
                               headers=signed_headers(receiver, delivery.id, delivery.body, now),
                               timeout=receiver.timeout_seconds)
        api = receiver.url.rstrip("/") + "/api/annotations"
        headers = {"content-type": "application/json", "user-agent": "ac-observe"}
        if receiver.token:
            headers["authorization"] = f"Bearer {receiver.token}"
        # Grafana has no idempotency key, and an earlier attempt may have landed unanswered
        # (a timeout, a daemon killed mid-post: no attempt recorded): look first. A lookup
        # that fails is the attempt's answer (retried later), never a blind post.
        annotation = json.loads(delivery.body)
        found = client.get(api, headers=headers, timeout=receiver.timeout_seconds,
                           params={"from": annotation["time"],
                                   "to": annotation.get("timeEnd", annotation["time"]),
                                   "tags": annotation["tags"], "type": "annotation",
                                   "limit": 100})
        if found.status_code != 200:
            return found
        holds = _holds(found, annotation)
        if holds is None:  # a 200 that is not Grafana's list: try again later
            return httpx.Response(502, request=found.request)
        if holds:
            return found
        return client.post(api, content=delivery.body.encode(), headers=headers,
                           timeout=receiver.timeout_seconds)

    def _count(self, receiver: str, outcome: str) -> None:
        key = (receiver, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def wake(self) -> None:
        for event in self._wakes.values():
            event.set()

    def start(self) -> None:
        for name in self.receivers:
            thread = threading.Thread(target=self._loop, args=(name,), daemon=True,
                                      name=f"ac-webhooks-{name}"[:40])
            thread.start()
            self._threads.append(thread)

    def _loop(self, name: str) -> None:
        wake = self._wakes[name]
        while not self._stop.is_set():
            try:
                busy = self.run_once(receivers=[name])
            except Exception:  # a store outage: keep trying, never die
                log.exception("webhook pass for %s failed", name)
                busy = 0
            if not busy:
                wake.wait(self.poll_seconds)
                wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + 30
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for client in self._clients.values():
            client.close()
