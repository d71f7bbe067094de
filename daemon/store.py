"""The daemon's store: SQLite by default (a file in the state directory), PostgreSQL by URL.

Its schema is Alembic's (`daemon/migrations`), brought to the newest revision when the
store opens, so a daemon upgraded in place migrates its own file. What it holds so far:
alert instances (pending or firing, one per rule and label set) and every transition, the
webhook outbox (one row per delivery: its stable `webhook-id`, the receiver, the body,
when it is next due) with every delivery attempt, and the receivers a 410 disabled.

NOTE: times are Unix seconds (floats) as the daemon's clock reads them. Every change is
one transaction, so a delivery written with the alert transition that caused it is
either there with it or not at all, and a daemon killed at any point loses nothing that
was committed. Several daemons may share a PostgreSQL store; a delivery is claimed with
`FOR UPDATE SKIP LOCKED` there, so two senders never post the same attempt.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ac_observe.outage import Outage, size_text

if TYPE_CHECKING:  # each dialect is imported when its store is used
    from sqlalchemy.dialects import postgresql, sqlite

log = logging.getLogger("ac_observe.daemon.store")

MIGRATIONS = Path(__file__).with_name("migrations")
PENDING, DELIVERED, FAILED, DISABLED = "pending", "delivered", "failed", "disabled"

metadata = sa.MetaData()
deliveries = sa.Table(
    "deliveries", metadata,
    sa.Column("id", sa.String(64), primary_key=True),           # the webhook-id
    sa.Column("receiver", sa.String(200), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),            # firing | resolved | test
    sa.Column("body", sa.Text, nullable=False),                  # the JSON posted, as sent
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("last_status", sa.Integer),
    sa.Column("last_error", sa.Text),
    sa.Column("finished_at", sa.Float),
    sa.Column("claim", sa.String(32)),                           # the sender holding it
)
attempts = sa.Table(
    "delivery_attempts", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("delivery_id", sa.String(64), sa.ForeignKey("deliveries.id"), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("status", sa.Integer),                             # HTTP status, if any came
    sa.Column("error", sa.Text),
    sa.Column("seconds", sa.Float, nullable=False),
)
disabled_receivers = sa.Table(
    "disabled_receivers", metadata,
    sa.Column("receiver", sa.String(200), primary_key=True),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)


alert_instances = sa.Table(
    "alert_instances", metadata,
    sa.Column("rule", sa.String(200), primary_key=True),
    sa.Column("fingerprint", sa.String(16), primary_key=True),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),   # pending | firing
    sa.Column("active_since", sa.Float),
    sa.Column("firing_since", sa.Float),
    sa.Column("value", sa.Float),
    sa.Column("baseline", sa.Float),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("alert_labels", sa.Text),    # JSON: the notification's labels (all of them)
    sa.Column("annotations", sa.Text),     # JSON: the last notification's annotations
)
alert_transitions = sa.Table(
    "alert_transitions", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("rule", sa.String(200), nullable=False),
    sa.Column("fingerprint", sa.String(16), nullable=False),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("from_state", sa.String(16), nullable=False),
    sa.Column("to_state", sa.String(16), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("value", sa.Float),
    sa.Column("baseline", sa.Float),
    sa.Column("summary", sa.Text),
)


history_series = sa.Table(
    "history_series", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("sample", sa.String(200), nullable=False),
    sa.Column("labels", sa.Text, nullable=False),        # JSON [[name, value], ...]
    sa.UniqueConstraint("sample", "labels", name="history_series_key"),
)
history_minutes = sa.Table(
    "history_minutes", metadata,
    sa.Column("series_id", sa.Integer, sa.ForeignKey("history_series.id"),
              primary_key=True),
    sa.Column("minute", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("n", sa.Integer, nullable=False),           # samples, or counter intervals
    sa.Column("total", sa.Float, nullable=False),         # sum, or counter increase
    sa.Column("vmin", sa.Float),                          # gauges only
    sa.Column("vmax", sa.Float),
    sa.Column("vlast", sa.Float),
)


def default_state_dir() -> Path:
    explicit = os.environ.get("AC_OBSERVE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ac-observe"


def sqlite_url(state_dir: Path) -> str:
    return f"sqlite+pysqlite:///{state_dir / 'ac-observe.db'}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")   # readers never wait on the writer
    cursor.execute("PRAGMA synchronous=FULL")   # a committed delivery survives power loss
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def migrate(connection: Connection) -> None:
    from alembic import command
    from alembic.config import Config
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


class StoreUnavailable(RuntimeError):
    """The daemon's store cannot be read or written now (its server is down, its disk is
    full): an outage to wait out, not a bug. The message says why."""


@dataclass(frozen=True, slots=True)
class Transition:
    """One move of an alert instance between states (a row of alert_transitions)."""
    rule: str
    fingerprint: str
    labels: dict[str, str]   # the series' labels
    from_state: str
    to_state: str
    at: float
    value: float | None
    baseline: float | None
    summary: str | None = None


@dataclass(frozen=True, slots=True)
class SavedAlert:
    """An alert instance pending or firing, kept across a restart (a row of
    alert_instances)."""
    rule: str
    fingerprint: str
    labels: dict[str, str]          # the series' labels
    state: str
    active_since: float | None
    firing_since: float | None
    value: float | None
    baseline: float | None
    updated_at: float
    alert_labels: dict[str, str] | None = None  # the notification's labels (all of them)
    annotations: dict[str, str] | None = None   # the last notification's annotations


def _json(value) -> str:
    return json.dumps(value, sort_keys=True)


# Errors of an unreachable or unwritable store (psycopg's and sqlite3's connection and
# disk errors come as OperationalError; a pool that cannot connect, as TimeoutError).
OUTAGE_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError, OSError)


@dataclass(frozen=True, slots=True)
class Delivery:
    id: str
    receiver: str
    kind: str
    body: str
    created_at: float
    attempts: int
    claim: str = ""


class Store:
    def __init__(self, url: str | None = None, state_dir: Path | None = None):
        if url is None:
            state_dir = Path(state_dir or default_state_dir())
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            url = sqlite_url(state_dir)
        self.url = url
        self.engine: Engine = sa.create_engine(url, future=True, pool_pre_ping=True)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._history_ids: dict = {}  # series key -> history_series.id
        if self.is_sqlite:
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        with self.engine.begin() as connection:
            migrate(connection)
        # The daemon says what it keeps meanwhile (Daemon sets `kept`).
        self.outage = Outage(f"the store ({self.engine.url.render_as_string(True)})",
                             "what is to be written waits in memory and is retried", log)

    def unavailable_reason(self, exc: BaseException) -> str:
        """Why the store failed, in a line: a full disk names the path and the free space."""
        cause = getattr(exc, "orig", None) or exc
        text = "; ".join(line.strip() for line in str(cause).splitlines() if line.strip())
        text = text or type(cause).__name__
        full = (getattr(cause, "errno", None) == errno.ENOSPC or "disk is full" in text
                or type(cause).__name__ == "DiskFull")
        if full and self.is_sqlite and self.engine.url.database:
            path = Path(self.engine.url.database).resolve()
            try:
                free = size_text(shutil.disk_usage(path.parent).free)
            except OSError:
                free = "unknown"
            return f"the disk holding {path} is full ({free} free): {text}"
        return text

    @contextlib.contextmanager
    def _transaction(self, wrote: bool = True) -> Iterator[Connection]:
        """A transaction; an outage raises StoreUnavailable (and is told by `outage`), a
        commit (`wrote`: one that wrote) says the store is back."""
        try:
            with self.engine.begin() as connection:
                yield connection
        except OUTAGE_ERRORS as exc:
            reason = self.unavailable_reason(exc)
            self.outage.failed(reason)
            raise StoreUnavailable(reason) from exc
        if wrote:
            self.outage.ok()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        try:
            with self.engine.connect() as connection:
                yield connection
        except OUTAGE_ERRORS as exc:
            reason = self.unavailable_reason(exc)
            self.outage.failed(reason)
            raise StoreUnavailable(reason) from exc

    def close(self) -> None:
        self.engine.dispose()

    # ----- history (daemon/history.py) ------------------------------------------------------

    def _series_ids(self, connection: Connection, keys) -> dict:
        """series key -> id, creating the series not yet known (ids cached)."""
        cache = self._history_ids
        missing = [key for key in keys if key not in cache]
        if missing:
            texts = {key: json.dumps([list(item) for item in key[1]], separators=(",", ":"))
                     for key in missing}
            insert = self._insert(history_series).on_conflict_do_nothing(
                index_elements=["sample", "labels"])
            connection.execute(insert, [{"sample": key[0], "labels": texts[key]}
                                        for key in missing])
            wanted = {(key[0], texts[key]): key for key in missing}
            for chunk in _chunks(sorted({key[0] for key in missing}), 500):
                for row in connection.execute(sa.select(history_series).where(
                        history_series.c.sample.in_(chunk))):
                    key = wanted.get((row.sample, row.labels))
                    if key is not None:
                        cache[key] = row.id
        return cache

    def _insert(self, table: sa.Table) -> sqlite.Insert | postgresql.Insert:
        """An INSERT that can say what to do on a conflict (the dialect's own)."""
        if self.is_sqlite:
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert
            return sqlite_insert(table)
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert
        return postgresql_insert(table)

    def write_minutes(self, batch: list[tuple[int, dict]]) -> None:
        """Minutes of aggregates ((minute, {series key: [n, total, min, max, last]}), ...)
        in one transaction, each merged into what the store holds for its minute (sums
        add, extremes widen, last wins). A series id cached here that another daemon's
        prune removed in the meantime fails the foreign key: the ids are looked up afresh
        and the batch written once more. A failed write forgets the ids it cached (rolled
        back, SQLite would give them to other series)."""
        known = set(self._history_ids)
        try:
            try:
                self._write_minutes(batch)
            except sa.exc.IntegrityError:
                self._history_ids.clear()
                self._write_minutes(batch)
        except BaseException:  # ids of series the failed transaction made are not theirs
            self._history_ids = {k: v for k, v in self._history_ids.items() if k in known}
            raise

    def _write_minutes(self, batch: list[tuple[int, dict]]) -> None:
        with self._transaction() as connection:
            ids = self._series_ids(connection, list({key for _, rows in batch for key in rows}))
            insert = self._insert(history_minutes)
            table, new = history_minutes.c, insert.excluded
            upsert = insert.on_conflict_do_update(
                index_elements=["series_id", "minute"],
                set_={"n": table.n + new.n, "total": table.total + new.total,
                      "vmin": sa.case((new.vmin < table.vmin, new.vmin), else_=table.vmin),
                      "vmax": sa.case((new.vmax > table.vmax, new.vmax), else_=table.vmax),
                      "vlast": new.vlast})
            values = [{"series_id": ids[key], "minute": minute, "n": row[0], "total": row[1],
                       "vmin": row[2], "vmax": row[3], "vlast": row[4]}
                      for minute, rows in batch for key, row in rows.items()]
            for chunk in _chunks(values, 5000):
                connection.execute(upsert, chunk)

    def read_minutes(self, samples, first_minute: int, last_minute: int,
                     step: int = 1) -> dict:
        """series key -> [(minute, n, total, min, max, last), ...] of these sample names
        over [first_minute, last_minute], in minute order.

        step > 1: the minutes folded into groups of `step` by the database (a week is 7
        minutes a point: 1,440 rows per series, not 10,080): each row is its group's first
        minute with n and total summed, the extremes of its extremes, and `last` left None
        except in a series' final group (the only one a query reads it from)."""
        out: dict = {}
        with self._reading() as connection:
            series = {row.id: (row.sample, tuple(tuple(item) for item in json.loads(row.labels)))
                      for row in connection.execute(sa.select(history_series).where(
                          history_series.c.sample.in_(sorted(samples))))}
            t = history_minutes.c
            for chunk in _chunks(sorted(series), 500):
                where = (t.series_id.in_(chunk), t.minute.between(first_minute, last_minute))
                if step <= 1:
                    every_minute = (sa.select(t.series_id, t.minute, t.n, t.total, t.vmin,
                                              t.vmax, t.vlast)
                                    .where(*where).order_by(t.series_id, t.minute))
                    for row in connection.execute(every_minute):
                        out.setdefault(series[row[0]], []).append(tuple(row[1:]))
                    continue
                group = (t.minute - first_minute) // step
                groups = (sa.select(t.series_id, group, sa.func.sum(t.n), sa.func.sum(t.total),
                                    sa.func.min(t.vmin), sa.func.max(t.vmax))
                          .where(*where).group_by(t.series_id, group)
                          .order_by(t.series_id, group))
                for sid, g, n, total, vmin, vmax in connection.execute(groups):
                    out.setdefault(series[sid], []).append(
                        (first_minute + int(g) * step, int(n), total, vmin, vmax, None))
                newest = (sa.select(t.series_id, sa.func.max(t.minute))
                          .where(*where).group_by(t.series_id).subquery())
                lasts = sa.select(t.series_id, t.vlast).where(
                    sa.tuple_(t.series_id, t.minute).in_(sa.select(newest)))
                for sid, vlast in connection.execute(lasts):
                    rows = out.get(series[sid])
                    if rows:
                        rows[-1] = rows[-1][:5] + (vlast,)
        return out

    def prune(self, before: float) -> dict[str, int]:
        """Drops history (minutes, then the series left without any), alert transitions and
        finished deliveries (with their attempts) older than `before`; a pending delivery
        is never dropped here."""
        with self._transaction() as connection:
            minutes = connection.execute(history_minutes.delete().where(
                history_minutes.c.minute < int(before // 60))).rowcount
            # Series with no minute left (an engine, a skeleton, a label value long gone):
            # their rows, and the ids cached for them.
            empty = (sa.select(history_series.c.id)
                     .where(~sa.exists().where(history_minutes.c.series_id ==
                                               history_series.c.id)))
            gone = {row.id for row in connection.execute(empty)}
            for chunk in _chunks(sorted(gone), 500):
                connection.execute(history_series.delete().where(
                    history_series.c.id.in_(chunk)))
            transitions = connection.execute(alert_transitions.delete().where(
                alert_transitions.c.at < before)).rowcount
            old = sa.select(deliveries.c.id).where(deliveries.c.state != PENDING,
                                                   deliveries.c.finished_at < before)
            connection.execute(attempts.delete().where(attempts.c.delivery_id.in_(old)))
            finished = connection.execute(deliveries.delete().where(
                deliveries.c.state != PENDING, deliveries.c.finished_at < before)).rowcount
        if gone:
            self._history_ids = {k: v for k, v in self._history_ids.items() if v not in gone}
        return {"minutes": minutes, "series": len(gone), "transitions": transitions,
                "deliveries": finished}

    # ----- alert states ---------------------------------------------------------------------

    def record_transition(self, transition: Transition, saved: SavedAlert | None,
                          deliveries_queued: list[tuple[str, str, dict]],
                          queued_at: float) -> None:
        """In one transaction: the transition, the instance as it now stands (`saved`;
        None: inactive or resolved, so no row) and the deliveries it causes ((receiver,
        kind, body), due at `queued_at`). All of it is committed, or none."""
        with self._transaction() as connection:
            connection.execute(alert_transitions.insert().values(
                rule=transition.rule, fingerprint=transition.fingerprint,
                labels=_json(transition.labels), from_state=transition.from_state,
                to_state=transition.to_state, at=transition.at, value=transition.value,
                baseline=transition.baseline, summary=transition.summary))
            connection.execute(alert_instances.delete().where(
                alert_instances.c.rule == transition.rule,
                alert_instances.c.fingerprint == transition.fingerprint))
            if saved is not None:
                connection.execute(alert_instances.insert().values(
                    rule=saved.rule, fingerprint=saved.fingerprint, labels=_json(saved.labels),
                    state=saved.state, active_since=saved.active_since,
                    firing_since=saved.firing_since, value=saved.value,
                    baseline=saved.baseline, updated_at=saved.updated_at,
                    alert_labels=None if saved.alert_labels is None
                    else _json(saved.alert_labels),
                    annotations=None if saved.annotations is None
                    else _json(saved.annotations)))
            for receiver, kind, body in deliveries_queued:
                self.enqueue(connection, receiver, kind, body, queued_at)

    def saved_alerts(self) -> list[SavedAlert]:
        """The alert instances pending or firing when the daemon last wrote them."""
        with self._reading() as connection:
            rows = list(connection.execute(sa.select(alert_instances)).mappings())
        return [SavedAlert(
            rule=row["rule"], fingerprint=row["fingerprint"], labels=json.loads(row["labels"]),
            state=row["state"], active_since=row["active_since"],
            firing_since=row["firing_since"], value=row["value"], baseline=row["baseline"],
            updated_at=row["updated_at"],
            alert_labels=json.loads(row["alert_labels"]) if row["alert_labels"] else None,
            annotations=json.loads(row["annotations"]) if row["annotations"] else None)
            for row in rows]

    def recent_transitions(self, limit: int = 100) -> list[dict]:
        """The latest transitions, newest first, labels decoded."""
        with self._reading() as connection:
            rows = connection.execute(sa.select(alert_transitions)
                                      .order_by(alert_transitions.c.id.desc()).limit(limit))
            return [{**dict(r), "labels": json.loads(r["labels"])} for r in rows.mappings()]

    # ----- the outbox ---------------------------------------------------------------------

    @staticmethod
    def enqueue(connection: Connection, receiver: str, kind: str, body: dict,
                now: float) -> str:
        """Add a delivery inside the caller's transaction; returns its webhook-id."""
        delivery_id = "msg_" + secrets.token_hex(12)
        connection.execute(deliveries.insert().values(
            id=delivery_id, receiver=receiver, kind=kind,
            body=json.dumps(body, separators=(",", ":"), sort_keys=True),
            created_at=now, next_attempt_at=now, attempts=0, state=PENDING))
        return delivery_id

    def add(self, receiver: str, kind: str, body: dict, now: float) -> str:
        with self._transaction() as connection:
            return self.enqueue(connection, receiver, kind, body, now)

    def claim_one(self, now: float, receivers: list[str], lease_seconds: float,
                  only: list[str] | None = None,
                  skip: set[str] | frozenset[str] = frozenset()) -> Delivery | None:
        """The most overdue pending delivery to these receivers (among `only`, when given,
        and not among `skip`), claimed in one transaction: pushed `lease_seconds` ahead
        under a fresh claim token, so a sender that dies mid-post leaves it due again after
        the lease, and no two senders hold it at once (on PostgreSQL, rows another sender
        locks are skipped)."""
        due = [deliveries.c.state == PENDING, deliveries.c.next_attempt_at <= now,
               deliveries.c.receiver.in_(receivers)]
        if only is not None:
            due.append(deliveries.c.id.in_(only))
        if skip:
            due.append(deliveries.c.id.not_in(sorted(skip)))
        pick = (sa.select(deliveries.c.id).where(*due)
                .order_by(deliveries.c.next_attempt_at, deliveries.c.created_at).limit(1))
        if not self.is_sqlite:
            pick = pick.with_for_update(skip_locked=True)
        # Pick, then claim by id, in one transaction. (Not `UPDATE ... WHERE id IN (SELECT
        # ... LIMIT 1 FOR UPDATE SKIP LOCKED)`: PostgreSQL may run that subquery more than
        # once and claim several rows, of which only one is returned and attempted.) The
        # claim repeats the due conditions, so a row another sender took in between (on
        # SQLite) is not claimed twice; then the next is picked.
        row = None
        for _ in range(3):
            token = secrets.token_hex(8)
            with self._transaction(wrote=False) as connection:
                picked = connection.execute(pick).scalar()
                if picked is None:
                    return None
                row = connection.execute(
                    deliveries.update().where(deliveries.c.id == picked, *due)
                    .values(next_attempt_at=now + lease_seconds, claim=token)
                    .returning(deliveries)).mappings().first()
            if row is not None:
                self.outage.ok()
                break
        if row is None:
            return None
        return Delivery(row["id"], row["receiver"], row["kind"], row["body"],
                        row["created_at"], row["attempts"], token)

    def record_attempt(self, delivery: Delivery, at: float, seconds: float,
                       status: int | None, error: str | None, state: str,
                       next_attempt_at: float | None = None) -> bool:
        """The attempt, and the delivery's new state if this sender still holds its claim
        (False when the lease ran out and another sender took it over)."""
        values: dict[str, object] = {"attempts": deliveries.c.attempts + 1,
                                     "last_status": status, "last_error": error,
                                     "state": state, "claim": None}
        if state == PENDING:
            values["next_attempt_at"] = next_attempt_at
        else:
            values["finished_at"] = at
        with self._transaction() as connection:
            connection.execute(attempts.insert().values(
                delivery_id=delivery.id, at=at, status=status, error=error, seconds=seconds))
            held = connection.execute(
                deliveries.update().where(deliveries.c.id == delivery.id,
                                          deliveries.c.claim == delivery.claim)
                .values(**values)).rowcount
        return held == 1

    def disable_receiver(self, receiver: str, url: str, at: float, reason: str) -> int:
        """A receiver answered 410 Gone: it is off until its URL changes; its pending
        deliveries end as disabled. Returns how many were pending."""
        with self._transaction() as connection:
            connection.execute(disabled_receivers.delete()
                               .where(disabled_receivers.c.receiver == receiver))
            connection.execute(disabled_receivers.insert().values(
                receiver=receiver, url=url, at=at, reason=reason))
            result = connection.execute(
                deliveries.update().where(deliveries.c.receiver == receiver,
                                          deliveries.c.state == PENDING)
                .values(state=DISABLED, finished_at=at, last_error=reason))
            return result.rowcount

    def disabled(self) -> dict[str, str]:
        """Disabled receivers: name -> the URL that answered 410."""
        with self._reading() as connection:
            return {r.receiver: r.url for r in connection.execute(sa.select(disabled_receivers))}

    def enable_receiver(self, receiver: str) -> None:
        with self._transaction() as connection:
            connection.execute(disabled_receivers.delete()
                               .where(disabled_receivers.c.receiver == receiver))

    def pending_by_receiver(self, now: float) -> dict[str, tuple[int, float]]:
        """receiver -> (pending deliveries, age in seconds of the oldest)."""
        query = (sa.select(deliveries.c.receiver, sa.func.count(),
                           sa.func.min(deliveries.c.created_at))
                 .where(deliveries.c.state == PENDING).group_by(deliveries.c.receiver))
        with self._reading() as connection:
            return {receiver: (count, max(now - oldest, 0.0))
                    for receiver, count, oldest in connection.execute(query)}

    def delivery(self, delivery_id: str) -> dict | None:
        with self._reading() as connection:
            row = connection.execute(sa.select(deliveries)
                                     .where(deliveries.c.id == delivery_id)).mappings().first()
            return dict(row) if row else None

    def attempts_of(self, delivery_id: str) -> list[dict]:
        with self._reading() as connection:
            return [dict(r) for r in connection.execute(
                sa.select(attempts).where(attempts.c.delivery_id == delivery_id)
                .order_by(attempts.c.id)).mappings()]


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]
