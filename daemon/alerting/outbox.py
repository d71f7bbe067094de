"""The webhook outbox's sender: delivers the store's pending deliveries until each is
acknowledged.

Delivery rules: only a 2xx answer delivers. 410 Gone disables the receiver (until its URL
changes in the file): its pending deliveries end as `disabled`. Anything else (refused,
timed out, 429, 5xx, another 4xx) is retried with exponential backoff (1 s doubling to 5
min, each wait drawn between half and all of it) or after the receiver's `Retry-After`
(seconds or an HTTP date; at most an hour), until the delivery is `max_age` old (24 h),
when it ends as `failed`. Deliveries live in the store: a daemon killed mid-post posts
again after the claim's lease (60 s plus four times the receiver's timeout), under the
same id. A wait counts from the receiver's answer, so a receiver slower than the wait is
posted to again as soon as the wait is over.

NOTE: the sender never logs a body, a signature, a token or a secret; a receiver is named by
its `name`, and its URL only in the status it came from (the alerting file).
"""
from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from dataclasses import dataclass
from datetime import timezone

import httpx

from ac_observe.daemon.alerting import notify
from ac_observe.daemon.alerting.alert import Alert, trial_alert
from ac_observe.daemon.alerting.notify.grafana import REFUSED_FOR_GOOD
from ac_observe.daemon.alerting.receivers import Receiver
from ac_observe.daemon.store import (
    DELIVERED,
    DISABLED,
    FAILED,
    PENDING,
    Delivery,
    Store,
    StoreUnavailable,
)
from ac_observe.outage import Outage

log = logging.getLogger("ac_observe.daemon.alerting.outbox")


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
LEASE_SECONDS = 60.0


def lease_seconds(timeout_seconds: float) -> float:
    """How long a claim holds a delivery: 60 s plus four times the receiver's timeout (a
    post may take the connect, write, read and pool timeouts in turn)."""
    return LEASE_SECONDS + 4 * timeout_seconds


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
        self._counting = threading.Lock()  # the receivers' threads count; a reload copies
        self._started = False
        self._threads: dict[str, threading.Thread] = {}
        self._warned: set[str] = set()  # receivers whose refusals were logged once
        self.outages = {name: self._outage(name) for name in receivers}
        self._enable_moved(receivers)

    def _enable_moved(self, receivers: dict[str, Receiver]) -> None:
        """A receiver whose URL changed since a 410 disabled it is tried again."""
        for name, url in self.store.disabled().items():
            if name in receivers and receivers[name].url != url:
                self.store.enable_receiver(name)

    def replace_receivers(self, receivers: dict[str, Receiver]) -> None:
        """A reload's receivers: a new one gets its thread, a removed one's thread ends
        after its attempt in progress (its pending deliveries stay in the outbox), a
        changed one is posted to as it now is."""
        try:
            self._enable_moved(receivers)
        except StoreUnavailable:  # (told by the store) kept off until the next reload
            log.warning("a receiver a 410 disabled stays off although its url changed: "
                        "the store is unreachable; reload again once it is back")
        added = [name for name in receivers if name not in self._clients]
        # New tables swapped in whole, never changed in place: the cycle (outcomes), the
        # evaluator (wake) and the receivers' threads read them without a lock.
        self._clients = {**self._clients, **{name: httpx.Client(
            follow_redirects=False, trust_env=False) for name in added}}
        self._wakes = {**self._wakes, **{name: threading.Event() for name in added}}
        self.outages = {**self.outages, **{name: self._outage(name) for name in added}}
        with self._counting:  # (no count lost between the copy and the swap)
            self.outcomes = {**self.outcomes, **{(name, outcome): 0 for name in added
                                                 for outcome in OUTCOMES}}
        self.receivers = dict(receivers)
        if self._started:
            self.start()
        self.wake()  # a removed receiver's thread sees it is gone

    @staticmethod
    def _outage(name: str) -> Outage:
        return Outage(f"webhook receiver {name}",
                      "its deliveries wait in the outbox and are retried", log)

    def bodies(self, alerts: list[Alert]) -> list[tuple[str, dict]]:
        """(receiver, body) of one delivery per receiver: what the store's outbox takes."""
        return [(receiver.name, notify.body_for(receiver, alerts, self.external_url))
                for receiver in self.receivers.values()]

    def enqueue(self, alerts: list[Alert], kind: str) -> list[str]:
        """One delivery per receiver, in the outbox now; their webhook-ids."""
        now = self.clock()
        ids = [self.store.add(name, kind, body, now) for name, body in self.bodies(alerts)]
        self.wake()
        return ids

    def send_test(self, host: str) -> list[str]:
        return self.enqueue([trial_alert(self.clock(), host)], "test")

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
            current = self.receivers  # one table, whatever a reload swaps in meanwhile
            active = [name for name in receivers if name in current and name not in disabled]
            if not active:
                return done
            # A delivery tried in this pass is left unclaimed, due as recorded: the next
            # pass (at once: this one was busy) takes it on time.
            delivery = self.store.claim_one(self.clock(), active, lease_seconds(
                max(current[n].timeout_seconds for n in active)), only, tried)
            if delivery is None:
                return done
            tried.add(delivery.id)
            self._attempt(delivery)
            done += 1

    def _attempt(self, delivery: Delivery) -> None:
        receiver = self.receivers.get(delivery.receiver)
        if receiver is None:  # removed by a reload since the claim: due again after it
            return
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
        answered = self.clock()  # the wait counts from the answer, not from the post
        if status is not None and 200 <= status < 300:
            self.store.record_attempt(delivery, now, seconds, status, None, DELIVERED)
            self._count(receiver.name, "delivered")
            self.outages[receiver.name].ok()
            return
        if status == 410:
            reason = "410 Gone: the receiver asked to stop; change its url to resume"
            self.store.record_attempt(delivery, now, seconds, status, reason, DISABLED)
            self.store.disable_receiver(receiver.name, receiver.url, now, reason)
            self._count(receiver.name, "disabled")
            log.warning("webhook receiver %s answered 410 Gone: disabled", receiver.name)
            return
        error = error or f"HTTP {status}"
        if receiver.format == "grafana" and status in REFUSED_FOR_GOOD:
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
                                  next_attempt_at=answered + delay)
        self._count(receiver.name, "retried")
        self.outages[receiver.name].failed(error)  # one line an outage, not one a retry
        log.debug("webhook delivery %s to %s: %s; next try in %.1f s", delivery.id,
                  receiver.name, error, delay)

    def _give_up(self, delivery: Delivery, now: float, seconds: float, status: int | None,
                 error: str, why: str) -> None:
        self.store.record_attempt(delivery, now, seconds, status, error, FAILED)
        self._count(delivery.receiver, "failed")
        log.error("webhook delivery %s to %s failed for good after %d attempts (%s): %s",
                  delivery.id, delivery.receiver, delivery.attempts + 1, why, error)

    def _send(self, receiver: Receiver, delivery: Delivery, now: float) -> httpx.Response:
        return notify.send(self._clients[receiver.name], receiver, delivery.id,
                           delivery.body, now)

    def _count(self, receiver: str, outcome: str) -> None:
        key = (receiver, outcome)
        with self._counting:
            self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def wake(self) -> None:
        for event in self._wakes.values():
            event.set()

    def start(self) -> None:
        """A thread for each receiver that has none running."""
        self._started = True
        for name in self.receivers:
            running = self._threads.get(name)
            if running is not None and running.is_alive():
                continue
            thread = threading.Thread(target=self._loop, args=(name,), daemon=True,
                                      name=f"ac-webhooks-{name}"[:40])
            thread.start()
            self._threads[name] = thread

    def _loop(self, name: str) -> None:
        wake = self._wakes[name]
        while not self._stop.is_set() and name in self.receivers:
            try:
                busy = self.run_once(receivers=[name])
            except StoreUnavailable:  # told once by the store's outage; keep trying
                busy = 0
            except Exception:  # never die
                log.exception("webhook pass for %s failed", name)
                busy = 0
            if not busy:
                wake.wait(self.poll_seconds)
                wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + 30
        for thread in list(self._threads.values()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for client in self._clients.values():
            client.close()
