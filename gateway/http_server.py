"""The gateway's HTTP/1.1 server: asyncio protocols and httptools (llhttp), no ASGI layer.

A handler gets one `Exchange` a request: the request's head, its body when asked for, and
writes that go straight to the socket. What it keeps of a mature server: keep-alive
(connections idle past `keep_alive_s` are closed; a client that takes nothing of its
answer for `write_timeout_s` is cut off), pipelining (requests answered in order,
reading paused while one is answered), `Expect: 100-continue` (answered when the handler
asks for the body, never when it refuses first), chunked request bodies, flow control both
ways, HTTP/1.0 clients (no chunked framing; closed after the answer), HEAD, 204 and 304
without bodies, and a graceful shutdown (`Server.shutdown`). Hostile clients: a head over
MAX_HEAD_BYTES is a 431, a request llhttp refuses a 400, a body over the handler's limit
is never buffered past it; each closes the connection. A handler's own failure is a 500
(or the connection closed, once its answer began) and harms no other request.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import unquote

import httptools

log = logging.getLogger("ac_observe.gateway")

MAX_HEAD_BYTES = 64 << 10   # request line and headers; nginx's default is 8 KiB a line
MAX_HEADERS = 256
_STATUS_LINES = {int(s): b"HTTP/1.1 %d %s\r\n" % (s, s.phrase.encode()) for s in HTTPStatus}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE_VALUE = re.compile(rb"[\x00\r\n]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ClientGone(Exception):
    """The client's connection ended before its answer did."""


class BodyTooLarge(Exception):
    """The request's body passed the server's `max_body_bytes`."""


class Exchange:
    """One request and its answer. The handler reads `method`, `path` (percent-decoded),
    `raw_path`, `query` and `headers` (names lower-cased, in order), awaits `body()`, then
    calls `start`, `write` (awaiting `drain()` while `write_paused`) and `end`. `gone`
    turns true when the client hangs up, and `on_gone` (if set) is called then."""

    __slots__ = ("method", "path", "raw_path", "query", "headers", "keep_alive", "gone",
                 "on_gone", "started", "ended", "_conn", "_parts", "_size", "_limit",
                 "_complete", "_body_waiter", "_expect_continue", "_chunked", "_no_body",
                 "_declared", "_sent", "_http_10", "_held")

    def __init__(self, conn: _ClientConnection, limit: int):
        self._conn = conn
        self._limit = limit
        self.method = ""
        self.path = ""
        self.raw_path = self.query = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.gone = False
        self.on_gone: Callable[[], None] | None = None
        self.started = self.ended = False
        self._parts: list[bytes] = []
        self._size = 0
        self._complete = False
        self._body_waiter: asyncio.Future | None = None
        self._expect_continue = False
        self._chunked = self._no_body = self._http_10 = False
        self._declared: int | None = None
        self._sent = 0
        self._held = b""  # a head that leaves with the first write

    # The request
    async def body(self) -> bytes:
        """The whole body (chunked framing removed). BodyTooLarge past the limit, ClientGone
        if the client leaves first."""
        if not self._complete and self._size <= self._limit and not self.gone:
            if self._expect_continue and not self.started:
                self._expect_continue = False
                self._conn.write(_CONTINUE)
            self._conn.resume_reading()
            self._body_waiter = self._conn.loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        if self._size > self._limit:
            raise BodyTooLarge
        if self.gone:
            raise ClientGone
        return b"".join(self._parts) if len(self._parts) != 1 else self._parts[0]

    def _wake_reader(self) -> None:
        if self._body_waiter is not None and not self._body_waiter.done():
            self._body_waiter.set_result(None)

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
        self._no_body = self.method == "HEAD" or status in (204, 304) or status < 200
        if not self._no_body and self._declared is None:
            if self._http_10:
                self.keep_alive = False
            else:
                self._chunked = True
                head.append(b"transfer-encoding: chunked\r\n")
        if not self._complete or self._conn.closing_after_answer:
            self.keep_alive = False  # an unread body, an upgrade or a shutdown
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.started = True
        self._expect_continue = False
        if with_first_write and not self._no_body:
            self._held = b"".join(head)
        else:
            self._conn.write(b"".join(head))

    def write(self, data: bytes) -> None:
        if not data or self._no_body or self.gone:
            return
        self._sent += len(data)
        if self._chunked:
            self._conn.write(b"%b%x\r\n%b\r\n" % (self._held, len(data), data))
        else:
            self._conn.write(self._held + data if self._held else data)
        self._held = b""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    @property
    def write_paused(self) -> bool:
        return self._conn.write_paused

    async def drain(self) -> None:
        """Returns once the client takes more; ClientGone if it left."""
        await self._conn.drain()
        if self.gone:
            raise ClientGone

    def end(self, last: bytes = b"") -> None:
        """The answer is whole; `last`, its last part, leaves in the same send."""
        if self.ended:
            return
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


class _ServerState:
    def __init__(self, handler, max_body_bytes: int, keep_alive_s: float,
                 write_timeout_s: float):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.write_timeout_s = write_timeout_s
        self.connections: set[_ClientConnection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.shutting_down = False


class _ClientConnection(asyncio.Protocol):
    def __init__(self, state: _ServerState):
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.parsing: Exchange | None = None    # the request the parser is reading
        self.answering: Exchange | None = None  # the request being answered
        self.waiting: deque[Exchange] = deque()  # pipelined, in order
        self.write_paused = False
        self.paused_since = 0.0
        self.read_paused = False
        self.closing_after_answer = False
        self.last_active = self.loop.time()
        self._drain_waiter: asyncio.Future | None = None
        self._url = b""
        self._head_bytes = 0
        self._head_too_large = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.state.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.state.connections.discard(self)
        self.waiting.clear()
        for exchange in (self.answering, self.parsing):
            if exchange is not None and not exchange.gone:
                exchange.gone = True
                exchange._wake_reader()
                if exchange.on_gone is not None:
                    exchange.on_gone()
        self.resume_writing()

    def eof_received(self) -> bool:
        return False  # a half-close ends the connection (and any answer in flight)

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        parser = self.parser
        if parser is None:
            return  # after an upgrade request or a refusal: nothing more is read
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.closing_after_answer = True  # no protocol switch: answered, then closed
            self.parser = None
            self.pause_reading()
        except httptools.HttpParserError as exc:
            if self._head_too_large:
                self._refuse(431, "request head too large")
            else:
                self._refuse(400, f"invalid HTTP request: {exc}")

    def pause_writing(self) -> None:
        self.write_paused = True
        self.paused_since = self.loop.time()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.parsing = Exchange(self, self.state.max_body_bytes)
        self._url = b""
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        exchange = self.parsing
        assert exchange is not None
        if len(exchange.headers) >= MAX_HEADERS:
            self._head_too_large = True
            raise ValueError("too many headers")
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace (RFC 9110 5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            exchange._expect_continue = True
        exchange.headers.append((name, value))

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise ValueError("head too large")

    def on_headers_complete(self) -> None:
        exchange = self.parsing
        parser = self.parser
        assert exchange is not None and parser is not None
        exchange.method = parser.get_method().decode("ascii")
        exchange._http_10 = parser.get_http_version() == "1.0"
        exchange.keep_alive = parser.should_keep_alive() and not exchange._http_10
        url = httptools.parse_url(self._url)  # HttpParserInvalidURLError: a 400
        raw_path = url.path or b"/"
        exchange.raw_path = raw_path
        exchange.query = url.query or b""
        path = raw_path.decode("latin-1")
        exchange.path = unquote(path) if "%" in path else path
        if self.answering is None:
            self._answer(exchange)
        else:
            self.waiting.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        assert exchange is not None
        exchange._size += len(body)
        if exchange._size > exchange._limit:
            exchange._parts.clear()  # never held past the limit; the answer closes
            self.pause_reading()
            exchange._wake_reader()
            return
        exchange._parts.append(body)

    def on_message_complete(self) -> None:
        exchange = self.parsing
        assert exchange is not None
        if exchange._size <= exchange._limit:
            exchange._complete = True
        exchange._wake_reader()
        self.parsing = None

    # Answers
    def _answer(self, exchange: Exchange) -> None:
        self.answering = exchange
        task = self.loop.create_task(self._run(exchange))
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.state.handler(exchange)
        except asyncio.CancelledError:
            if not exchange.ended:
                self._close()
            raise
        except Exception:
            log.exception("the gateway failed a request (%s %s)", exchange.method,
                          exchange.path)
            if not exchange.started and not exchange.gone:
                exchange.keep_alive = False
                _plain(exchange, 500, "internal error")
            else:
                self._close()
        if not exchange.ended:
            self._close()

    def answered(self, exchange: Exchange) -> None:
        """The answer is whole: the next pipelined request, or idle (or closed)."""
        self.answering = None
        if not exchange.keep_alive or self.closing_after_answer or self.transport is None \
                or self.transport.is_closing():
            self._close()
            return
        self.last_active = self.loop.time()
        if self.waiting:
            self._answer(self.waiting.popleft())
        if not self.waiting:
            self.resume_reading()

    def shutdown(self) -> None:
        """Closed now when idle, else after the answer in flight."""
        self.closing_after_answer = True
        self.waiting.clear()
        if self.answering is None:
            self._close()

    def stale(self, now: float, idle_s: float, write_s: float) -> bool:
        """Nothing in flight (or a body awaited) and nothing received for `idle_s`, or a
        client that has taken nothing of its answer for `write_s`."""
        if self.write_paused and now - self.paused_since > write_s:
            return True
        answering = self.answering
        busy = answering is not None and (answering._complete or answering.started)
        return not busy and now - self.last_active > idle_s

    def _refuse(self, status: int, message: str) -> None:
        """A request this server refuses before any handler sees it: answered and closed,
        or, behind an answer in flight, closed once that answer ends."""
        self.parser = None
        self.closing_after_answer = True
        self.waiting.clear()
        self.pause_reading()
        if self.answering is not None:
            return
        log.info("client request refused: %d %s", status, message)
        body = message.encode()
        self.write(_STATUS_LINES[status] + b"content-type: text/plain; charset=utf-8\r\n"
                   b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body))
        self._close()

    # The socket
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        if self.write_paused and self.transport is not None and not self.transport.is_closing():
            self._drain_waiter = self.loop.create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and not self.closing_after_answer:
            self.read_paused = False
            self.transport.resume_reading()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Closed now, what waits to be written dropped (close() would wait to send it)."""
        if self.transport is not None:
            self.transport.abort()


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


def _plain(exchange: Exchange, status: int, message: str) -> None:
    body = message.encode()
    exchange.start(status, [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())], True)
    exchange.end(body)


class Server:
    """`handler(exchange)` for every request on host:port until `shutdown`."""

    def __init__(self, handler, max_body_bytes: int, keep_alive_s: float = 5.0,
                 write_timeout_s: float = 600.0):
        self._state = _ServerState(handler, max_body_bytes, keep_alive_s, write_timeout_s)
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str, port: int, backlog: int = 2048) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientConnection(self._state),
                                                host, port, backlog=backlog)
        self.port = self._server.sockets[0].getsockname()[1]  # the one bound when 0
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Ends connections idle past keep_alive_s and clients that stopped reading for
        write_timeout_s (one timer for all, where a timer each would cost one a request)."""
        state = self._state
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, state.keep_alive_s / 2, state.write_timeout_s / 2))
            now = loop.time()
            for conn in [c for c in state.connections
                         if c.stale(now, state.keep_alive_s, state.write_timeout_s)]:
                conn.abort()

    async def shutdown(self, grace_s: float) -> None:
        """Stops listening, closes idle connections, gives the answers in flight `grace_s`
        to end, then cancels them (which closes their upstream requests)."""
        state = self._state
        state.shutting_down = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(state.connections):
            conn.shutdown()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=grace_s)
        for task in list(state.tasks):
            task.cancel()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=1.0)
        for conn in list(state.connections):
            conn._close()
