"""The gateway's HTTP/1.1 server: asyncio protocols and httptools (llhttp), no ASGI layer.

A handler gets one `Exchange` (gateway/exchange.py) a request. What the server keeps of a
mature one: keep-alive (connections idle past `keep_alive_s` are closed), pipelining
(requests answered in order, one at a time; the next starts only once the client has
taken what it could of the one before), `Expect: 100-continue` (answered when the handler
asks for the body, never when it refuses first; ignored from HTTP/1.0 clients), chunked
request bodies, flow control both ways, HTTP/1.0 clients (kept alive on request when the
answer's length is known), HEAD, 204 and 304 without bodies, an access log line a request
(`ac_observe.gateway.access`, at INFO: method, path without query, status, time) and a
graceful shutdown (`Server.shutdown`).

Hostile clients: a head over MAX_HEAD_BYTES or MAX_HEADERS is a 431; a request llhttp
refuses, an upgrade with a body, or a transfer coding other than chunked is a 400 (one
whose body breaks its framing fails the handler reading it: BodyBroken); a head not whole
within `head_timeout_s` of reading (bytes trickling in), a connection idle past
`keep_alive_s` with nothing left to send, and a client that takes nothing of what waits
to be sent for `write_timeout_s` are cut off; a body over the limit is never held past
it. A handler's own failure is a 500 (or the connection closed, if its answer began and
had not ended) and harms no other request.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import httptools

from ac_observe.gateway.exchange import Exchange, answer_plain, refusal_bytes

log = logging.getLogger("ac_observe.gateway")
access_log = logging.getLogger("ac_observe.gateway.access")

MAX_HEAD_BYTES = 64 << 10   # request line and headers; nginx's default is 8 KiB a line
MAX_HEADERS = 256
# After an answer that left a request's body unread (a 413): the body still arriving is
# read and dropped this long before the close, or the client's kernel, getting a reset
# for unread data, may drop the answer before its reader sees it (nginx's lingering_close).
LINGER_S = 2.0
Handler = Callable[[Exchange], Awaitable[None]]


class _Refusal(Exception):
    """A request refused from inside a parser callback (llhttp wraps it)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _ServerState:
    def __init__(self, handler: Handler, max_body_bytes: int, keep_alive_s: float,
                 write_timeout_s: float, head_timeout_s: float):
        if min(keep_alive_s, write_timeout_s, head_timeout_s) <= 0 or max_body_bytes < 0:
            raise ValueError("timeouts must be positive, the body limit not negative")
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.write_timeout_s = write_timeout_s
        self.head_timeout_s = head_timeout_s
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
        self.unsent = 0          # bytes the transport held at the sweeper's last look
        self.unsent_since = 0.0  # and since when it held them without sending any
        self.read_paused = False
        self.closing_after_answer = False  # an upgrade, a refusal or a shutdown
        self.next_deferred = False  # the next request waits for the client to take more
        self.last_active = self.loop.time()
        self.head_since: float | None = None  # a head being read began then
        self._writable: asyncio.Future | None = None  # shared by whoever awaits drain()
        self._url = b""
        self._head_bytes = 0

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.state.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.state.connections.discard(self)
        self.waiting.clear()
        for exchange in (self.answering, self.parsing):
            if exchange is not None:
                exchange.client_gone()
        self.write_paused = False
        self._release_writers()

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
            refusal = exc.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(refusal.status, refusal.message)
            else:
                self._refuse(400, f"invalid HTTP request: {exc}")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release_writers()
        if self.next_deferred:
            self.next_deferred = False
            self._next()

    def _release_writers(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.parsing = Exchange(self, self.state.max_body_bytes)
        self.head_since = self.loop.time()
        self._url = b""
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        exchange = self.parsing
        assert exchange is not None
        if self.head_since is None:
            return  # a chunked body's trailer: counted, not taken for a header
        if len(exchange.headers) >= MAX_HEADERS:
            raise _Refusal(431, f"over {MAX_HEADERS} request headers")
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace (RFC 9110 5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            exchange.expect_continue = True
        exchange.headers.append((name, value))

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Refusal(431, "request head too large")

    def on_headers_complete(self) -> None:
        exchange = self.parsing
        parser = self.parser
        assert exchange is not None and parser is not None
        self.head_since = None
        _check_framing(exchange.headers, parser.should_upgrade())
        exchange.method = parser.get_method().decode("ascii")
        exchange.http_10 = parser.get_http_version() == "1.0"
        exchange.keep_alive = parser.should_keep_alive()
        if exchange.http_10:
            exchange.expect_continue = False  # RFC 9110 10.1.1
        url = httptools.parse_url(self._url)  # HttpParserInvalidURLError: a 400
        raw_path = url.path or b"/"
        exchange.raw_path = raw_path
        exchange.query = url.query or b""
        path = raw_path.decode("latin-1")
        exchange.path = unquote(path) if "%" in path else path
        if self.state.shutting_down:
            self.pause_reading()  # a request after the shutdown began: not taken
        elif self.answering is None and not self.next_deferred:
            self._answer(exchange)
        else:
            self.waiting.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        assert exchange is not None
        if not exchange.add_body(body):
            self.pause_reading()  # the answer (a 413) closes the connection

    def on_message_complete(self) -> None:
        exchange = self.parsing
        assert exchange is not None
        exchange.body_complete()
        self.parsing = None

    # Answers
    def _answer(self, exchange: Exchange) -> None:
        self.answering = exchange
        task = self.loop.create_task(self._run(exchange))
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        logged = access_log.isEnabledFor(logging.INFO)
        began = time.perf_counter() if logged else 0.0
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
                answer_plain(exchange, 500, "internal error")
            elif not exchange.ended:  # once ended, the connection is the next request's
                self._close()
        if not exchange.ended:
            self._close()
        if logged:
            access_log.info('"%s %s" %s %.1f ms', exchange.method,
                            exchange.raw_path.decode("latin-1"),
                            exchange.status if exchange.started else "-",
                            (time.perf_counter() - began) * 1e3)

    def closes_after_this_answer(self) -> bool:
        return self.closing_after_answer and not self.waiting

    def answered(self, exchange: Exchange) -> None:
        """The answer is whole: the next pipelined request (once the client takes more of
        what was written, so a client that reads nothing cannot queue answers without
        end), or idle, or closed."""
        self.answering = None
        if not exchange.complete and not exchange.gone:
            self._linger()
            return
        if not exchange.keep_alive or self.transport is None or self.transport.is_closing():
            self._close()
            return
        self.last_active = self.loop.time()
        if self.write_paused:
            self.next_deferred = True
            return
        self._next()

    def _next(self) -> None:
        if self.waiting:
            self._answer(self.waiting.popleft())
        elif self.closing_after_answer:
            self._close()
        else:
            self.resume_reading()

    def _linger(self) -> None:
        """Half-closed: the answer sent and our end closed for writing, what the client
        still sends is read and dropped, the connection aborted after LINGER_S."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.parser = None  # data_received drops everything from now on
        self.waiting.clear()
        self.closing_after_answer = True
        if transport.can_write_eof():
            transport.write_eof()
        self.read_paused = False
        transport.resume_reading()
        self.loop.call_later(LINGER_S, self.abort)

    def shutdown(self) -> None:
        """Closed now when idle, else after the answer in flight."""
        self.closing_after_answer = True
        self.waiting.clear()
        if self.answering is None:
            self._close()

    def stale(self, now: float) -> bool:
        """A client that has taken nothing of what waits to be sent for write_timeout_s, a
        head trickling in (while reading) past head_timeout_s, or nothing in flight, nothing
        waiting to be sent (or a body awaited) and nothing received for keep_alive_s."""
        state = self.state
        unsent = self.transport.get_write_buffer_size() if self.transport is not None else 0
        if unsent == 0 or self.unsent == 0 or unsent < self.unsent:
            self.unsent_since = now  # nothing held last time, or sent some since
        self.unsent = unsent
        if unsent and now - self.unsent_since > state.write_timeout_s:
            return True
        if self.head_since is not None and not self.read_paused and \
                now - self.head_since > state.head_timeout_s:
            return True
        answering = self.answering
        busy = unsent > 0 or (answering is not None and (answering.complete or answering.started))
        return not busy and now - self.last_active > state.keep_alive_s

    def flushed(self) -> bool:
        return self.transport is None or self.transport.get_write_buffer_size() == 0

    def _refuse(self, status: int, message: str) -> None:
        """A request this server refuses before any handler sees it: answered and closed,
        or, behind answers owed to requests before it, closed once they are sent. One
        whose handler already has its head (the error is in its body) is failed to it."""
        parsing = self.parsing
        if parsing is not None and (parsing is self.answering or parsing in self.waiting):
            parsing.body_broken(f"{status} {message}")
        self.parser = None
        self.parsing = None
        self.closing_after_answer = True
        self.pause_reading()
        log.info("client request refused: %d %s", status, message)
        if self.answering is not None or self.waiting:
            return
        self.write(refusal_bytes(status, message))
        self._close()

    # The socket
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        if self.write_paused and self.transport is not None and not self.transport.is_closing():
            if self._writable is None:
                self._writable = self.loop.create_future()
            await asyncio.shield(self._writable)  # one waiter's cancel is not the others'

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Reading again, unless nothing more is to be parsed (after an upgrade or a
        refusal); a head cut off by the pause gets its whole time again."""
        if self.read_paused and self.transport is not None and self.parser is not None:
            self.read_paused = False
            self.transport.resume_reading()
            if self.head_since is not None:
                self.head_since = self.loop.time()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Closed now, what waits to be written dropped (close() would wait to send it)."""
        if self.transport is not None:
            self.transport.abort()


def _check_framing(headers: list[tuple[bytes, bytes]], upgrade: bool) -> None:
    """_Refusal for a request whose body's end a relay could mistake: a transfer coding
    that is not chunked last (RFC 9112 6.3: the length cannot be known), or an upgrade
    carrying a body (llhttp hands it over as the new protocol's bytes)."""
    for name, value in headers:
        if name == b"transfer-encoding" and \
                value.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
            raise _Refusal(400, "a transfer coding other than chunked")
        if upgrade and ((name == b"content-length" and value.strip() != b"0")
                        or name == b"transfer-encoding"):
            raise _Refusal(400, "an upgrade request with a body is not relayed")


class Server:
    """`handler(exchange)` for every request on host:port until `shutdown`."""

    def __init__(self, handler: Handler, max_body_bytes: int, keep_alive_s: float = 5.0,
                 write_timeout_s: float = 600.0, head_timeout_s: float = 30.0):
        self._state = _ServerState(handler, max_body_bytes, keep_alive_s, write_timeout_s,
                                   head_timeout_s)
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
        """Cuts off the connections `_ClientConnection.stale` names (one timer for all,
        where a timer each would cost one a request)."""
        state = self._state
        loop = asyncio.get_running_loop()
        period = min(1.0, state.keep_alive_s, state.write_timeout_s, state.head_timeout_s) / 2
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in [c for c in state.connections if c.stale(now)]:
                conn.abort()

    async def shutdown(self, grace_s: float, cut_short: asyncio.Event | None = None) -> None:
        """Stops listening, closes idle connections, gives the answers in flight `grace_s`
        (or until `cut_short` is set) to end, then cancels them (which closes their
        upstream requests)."""
        state = self._state
        state.shutting_down = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(state.connections):
            conn.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        stopper = asyncio.ensure_future(cut_short.wait()) if cut_short is not None else None
        try:
            while (pending := [t for t in state.tasks if not t.done()]) and \
                    loop.time() < deadline and not (stopper and stopper.done()):
                await asyncio.wait(pending + ([stopper] if stopper else []),
                                   timeout=deadline - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
            # answers ended but not yet taken by their clients: sent, within the grace
            while any(not c.flushed() for c in state.connections) and \
                    loop.time() < deadline and not (stopper and stopper.done()):
                await asyncio.sleep(0.05)
        finally:
            if stopper is not None:
                stopper.cancel()
        for task in list(state.tasks):
            task.cancel()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=1.0)
        for conn in list(state.connections):
            conn.abort()  # what is left after the grace
