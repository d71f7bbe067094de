"""One request on a client connection and the answer to it, as the gateway's handler sees
them (gateway/http_server.py parses the one and frames the other).

The handler reads `method`, `path` (percent-decoded), `raw_path`, `query` and `headers`
(names lower-cased, in order), awaits `body()`, then calls `start`, `write` (awaiting
`drain()` while `write_paused`) and `end`. `gone` turns true when the client hangs up,
and `on_gone`, if set, is called then.
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol

_STATUS_LINES = {int(s): b"HTTP/1.1 %d %s\r\n" % (s, s.phrase.encode()) for s in HTTPStatus}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE_VALUE = re.compile(rb"[\x00\r\n]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ClientGone(Exception):
    """The client's connection ended before its answer did."""


class BodyTooLarge(Exception):
    """The request's body passed the server's `max_body_bytes`."""


class BodyBroken(Exception):
    """The request's body broke its framing (a bad chunk, trailers too large): a 400."""


class Connection(Protocol):
    """What an exchange needs of its client connection."""
    loop: asyncio.AbstractEventLoop
    write_paused: bool

    def closes_after_this_answer(self) -> bool: ...
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def resume_reading(self) -> None: ...
    def answered(self, exchange: Exchange) -> None: ...


class Exchange:
    __slots__ = ("method", "path", "raw_path", "query", "headers", "keep_alive", "gone",
                 "on_gone", "started", "ended", "status", "http_10", "expect_continue", "complete",
                 "received", "broken", "_conn", "_parts", "_limit", "_body_waiter", "_chunked",
                 "_no_body", "_declared", "_sent", "_held")

    def __init__(self, conn: Connection, limit: int):
        self._conn = conn
        self._limit = limit
        self.method = ""
        self.path = ""
        self.raw_path = self.query = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.http_10 = False
        self.expect_continue = False
        self.gone = False
        self.on_gone: Callable[[], None] | None = None
        self.started = self.ended = False
        self.status = 0  # the answer's, once started
        self.complete = False   # the whole body has arrived (within the limit)
        self.received = 0       # body bytes the parser gave, the limit's past ones too
        self.broken = ""        # why the body's framing broke, if it did
        self._parts: list[bytes] = []
        self._body_waiter: asyncio.Future | None = None
        self._chunked = self._no_body = False
        self._declared: int | None = None
        self._sent = 0
        self._held = b""  # a head that leaves with the first write

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    # The request, as the parser gives it
    def add_body(self, data: bytes) -> bool:
        """False once past the limit (nothing is held then: the answer closes)."""
        self.received += len(data)
        if self.received > self._limit:
            self._parts.clear()
            self._wake_reader()
            return False
        self._parts.append(data)
        return True

    def body_complete(self) -> None:
        self.complete = self.received <= self._limit
        self._wake_reader()

    def body_broken(self, why: str) -> None:
        self.broken = why
        self._wake_reader()

    def client_gone(self) -> None:
        if not self.gone:
            self.gone = True
            self._wake_reader()
            if self.on_gone is not None:
                self.on_gone()

    def _wake_reader(self) -> None:
        if self._body_waiter is not None and not self._body_waiter.done():
            self._body_waiter.set_result(None)

    # The request, as the handler reads it
    async def body(self) -> bytes:
        """The whole body (chunked framing removed). BodyTooLarge past the limit, ClientGone
        if the client leaves first."""
        if not self.complete and self.received <= self._limit and not self.gone \
                and not self.broken:
            if self.expect_continue and not self.started:
                self.expect_continue = False
                self._conn.write(_CONTINUE)
            self._conn.resume_reading()
            self._body_waiter = self._conn.loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        if self.received > self._limit:
            raise BodyTooLarge
        if self.broken:
            raise BodyBroken(self.broken)
        if self.gone:
            raise ClientGone
        return b"".join(self._parts) if len(self._parts) != 1 else self._parts[0]

    # The answer
    def start(self, status: int, headers: list[tuple[bytes, bytes]],
              with_first_write: bool = False) -> None:
        """The status line and headers (ValueError for a name or value that could split
        the head), sent now or, `with_first_write` (a body part is at hand), in the same
        send as the first part. With no content-length the body is chunked (HTTP/1.1) or
        ends with the connection (HTTP/1.0)."""
        if self.started:
            raise RuntimeError("the answer has started")
        head, self._declared = _head_lines(status, headers)
        self.status = status
        self._no_body = self.method == "HEAD" or status in (204, 304) or status < 200
        if not self._no_body and self._declared is None:
            if self.http_10:
                self.keep_alive = False
            else:
                self._chunked = True
                head.append(b"transfer-encoding: chunked\r\n")
        if not self.complete or self._conn.closes_after_this_answer():
            self.keep_alive = False  # an unread body, an upgrade, a refusal or a shutdown
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        elif self.http_10:
            head.append(b"connection: keep-alive\r\n")
        head.append(b"\r\n")
        self.started = True
        self.expect_continue = False
        if with_first_write and not self._no_body:
            self._held = b"".join(head)
        else:
            self._conn.write(b"".join(head))

    def write(self, data: bytes) -> None:
        if not data or self._no_body or self.gone or self.ended:
            return
        self._past_declared(len(data))
        self._sent += len(data)
        if self._chunked:
            self._conn.write(b"%b%x\r\n%b\r\n" % (self._held, len(data), data))
        else:
            self._conn.write(self._held + data if self._held else data)
        self._held = b""

    @property
    def write_paused(self) -> bool:
        return self._conn.write_paused and not self.ended

    async def drain(self) -> None:
        """Returns once the client takes more; ClientGone if it left. Nothing to wait for
        once the answer has ended (the connection may be another request's by then)."""
        if self.ended:
            return
        await self._conn.drain()
        if self.gone:
            raise ClientGone

    def end(self, last: bytes = b"") -> None:
        """The answer is whole; `last`, its last part, leaves in the same send."""
        if self.ended:
            return
        if last and not self._no_body:
            self._past_declared(len(last))
        self.ended = True
        if last and not self._no_body and not self.gone:
            self._sent += len(last)
            if self._chunked:
                self._conn.write(b"%b%x\r\n%b\r\n0\r\n\r\n" % (self._held, len(last), last))
            else:
                self._conn.write(self._held + last)
        elif self._chunked and not self.gone:
            self._conn.write(self._held + b"0\r\n\r\n")
        elif self._held:
            self._conn.write(self._held)
        if self._declared is not None and self._sent != self._declared and not self._no_body:
            self.keep_alive = False  # the client cannot tell where this answer ended
        self._conn.answered(self)

    def _past_declared(self, size: int) -> None:
        if self._declared is not None and self._sent + size > self._declared:
            raise ValueError(f"the answer runs past its content-length {self._declared}")


def _head_lines(status: int, headers: list[tuple[bytes, bytes]]) -> tuple[list[bytes], int | None]:
    """The status line and header lines (framing headers left to the connection), and the
    content-length the headers declare."""
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"status {status}")
        line = b"HTTP/1.1 %d \r\n" % status
    head, declared = [line], None
    for name, value in headers:
        if _TOKEN.fullmatch(name) is None or _UNSAFE_VALUE.search(value) is not None:
            raise ValueError(f"header {name!r}: not a token, or a value with CR, LF or NUL")
        if name == b"content-length":
            declared = int(value)
        elif name in (b"transfer-encoding", b"connection"):
            continue  # the connection's framing is this server's
        head += (name, b": ", value, b"\r\n")
    return head, declared


def _text(message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = message.encode()
    return [(b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"%d" % len(body))], body


def refusal_bytes(status: int, message: str) -> bytes:
    """A whole text answer that closes the connection, for a request no handler saw."""
    headers, body = _text(message)
    head, _ = _head_lines(status, headers)
    return b"".join(head) + b"connection: close\r\n\r\n" + body


def answer_plain(exchange: Exchange, status: int, message: str) -> None:
    """A whole text answer to a request its handler failed."""
    headers, body = _text(message)
    exchange.start(status, headers, True)
    exchange.end(body)
