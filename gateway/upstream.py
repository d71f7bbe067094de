"""A lean HTTP/1.1 client for the gateway's one upstream: pooled keep-alive connections
on asyncio protocols, responses parsed by httptools (the C parser the server side uses).

Why not httpx: on the CI VM its client cost ~1.1 ms a request before the first byte and
most of the gateway's CPU a relayed chunk (h11 in Python, a timeout scope a read); the
gateway's overhead aim is 0.5 ms (docs/benchmarks.md, row 9).

A response's body comes as the upstream's data arrives (chunked framing removed, content
encodings kept); reading pauses while more than MAX_BUFFERED bytes wait for a slow
client. Connections are reused only after a complete response.
"""
from __future__ import annotations

import asyncio
import os
import ssl
import stat
from collections import deque
from urllib.parse import urlsplit

import httptools

MAX_BUFFERED = 1 << 20
MAX_MERGED = 256 << 10  # one write of what arrived together, at most
_CUT_OFF = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
MAX_CA_FILE_BYTES = 10 << 20  # a CA bundle is a few hundred KiB


class UpstreamError(Exception):
    """Base: the upstream could not be reached or answered wrongly. `reason` is the
    failure's name in `ac_gateway_upstream_failures_total` (metrics.UPSTREAM_FAILURE_REASONS)."""
    reason = "bad_response"

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        if reason:
            self.reason = reason


class PoolFull(UpstreamError):
    reason = "pool_full"


class ConnectFailed(UpstreamError):
    """Not connected: `unreachable` (refused, no route, no such host), `connect_timeout`
    or `tls` (the handshake failed or the certificate was not trusted). `detail` is for the
    operator's log, never the client: the upstream's certificate and the gateway's options."""
    reason = "unreachable"

    def __init__(self, message: str, reason: str = "", detail: str = ""):
        super().__init__(message, reason)
        self.detail = detail


class ReadTimedOut(UpstreamError):
    reason = "read_timeout"


class BadResponse(UpstreamError):
    reason = "bad_response"


class _Connection(asyncio.Protocol):
    def __init__(self):
        # Kept: asyncio.get_running_loop() is a getpid() system call a use in 3.11.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.response: UpstreamResponse | None = None
        self.parser = httptools.HttpResponseParser(self)

    def _current(self) -> UpstreamResponse:
        """The response being parsed (the parser calls back only while there is one)."""
        assert self.response is not None
        return self.response

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: this connection is not reusable
            self.close()
            return
        response.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response._fail(BadResponse("upgrade is not relayed"))
            self.close()
        except httptools.HttpParserError as exc:
            response._fail(BadResponse(f"invalid HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete:
            if response.status_code and response._until_close:
                response._finish()  # a body delimited by the connection's end
            else:
                response._fail(BadResponse("the upstream closed the connection"))

    def pause_writing(self) -> None:  # the request is written at once; nothing to pause
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._current().headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._current()
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (103 Early Hints...): the real one follows
            response.headers.clear()
            response._interim = True
            return
        response.status_code = status
        response.keep_alive = self.parser.should_keep_alive()
        names = {n.lower() for n, _ in response.headers}
        response._until_close = b"content-length" not in names and \
            b"transfer-encoding" not in names
        if response.head_only or response.status_code in (204, 304):
            response._headers_ready()
            response._finish()
            return
        response._headers_ready()

    def on_body(self, body: bytes) -> None:
        self._current()._push(body)

    def on_message_complete(self) -> None:
        response = self._current()
        if response._interim:
            response._interim = False
            return
        response._finish()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    def __init__(self, connection: _Connection, head_only: bool):
        self.connection = connection
        self.head_only = head_only
        self.status_code = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.received = False
        self._until_close = False
        self._interim = False  # a 1xx answer is being read
        self._error: UpstreamError | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._wake: asyncio.Future | None = None
        self._head: asyncio.Future = connection.loop.create_future()
        # A failure after the request gave up waiting is no one's to retrieve: mark it read.
        self._head.add_done_callback(_retrieve)

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n.lower() == name), None)

    @property
    def body_at_hand(self) -> bool:
        """Whether body bytes have arrived that `chunks` has not yet given."""
        return bool(self._chunks)

    # from the protocol
    def _headers_ready(self) -> None:
        if not self._head.done():
            self._head.set_result(None)

    def _push(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > MAX_BUFFERED and not self._paused:
            self._paused = True
            if self.connection.transport is not None:
                self.connection.transport.pause_reading()
        self._wakeup()

    def _finish(self) -> None:
        self.complete = True
        self._wakeup()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wakeup()

    def _wakeup(self) -> None:
        if self._wake is not None:
            _settle(self._wake, True)

    # for the relay
    async def chunks(self, read_timeout: float):
        """The body as it arrives; ReadTimedOut after `read_timeout` s of silence."""
        loop = self.connection.loop
        while True:
            if self._chunks:
                # What arrived together leaves together (up to MAX_MERGED): one send, not
                # one a chunk.
                body = self._chunks.popleft()
                if self._chunks and len(body) + len(self._chunks[0]) <= MAX_MERGED:
                    parts = [body]
                    size = len(body)
                    while self._chunks and size + len(self._chunks[0]) <= MAX_MERGED:
                        parts.append(self._chunks.popleft())
                        size += len(parts[-1])
                    body = b"".join(parts)
                self._buffered -= len(body)
                if self._paused and self._buffered <= MAX_BUFFERED // 2:
                    self._paused = False
                    if self.connection.transport is not None:
                        self.connection.transport.resume_reading()
                yield body
                continue
            if self._error is not None:
                raise self._error
            if self.complete:
                return
            self._wake = loop.create_future()
            timer = loop.call_later(read_timeout, _settle, self._wake, False)
            try:
                woken = await self._wake
            finally:
                timer.cancel()
            if not woken:
                raise ReadTimedOut(f"no data for {read_timeout:g} s")


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


async def _done_within(future: asyncio.Future, seconds: float) -> bool:
    """Whether `future` is done within `seconds`: waits without cancelling it (one timer,
    where asyncio.wait_for with shield adds a task and two futures a request)."""
    if not future.done():
        loop = future.get_loop()
        waiter = loop.create_future()

        def wake(_=None) -> None:
            _settle(waiter, None)
        timer = loop.call_later(seconds, wake)
        future.add_done_callback(wake)
        try:
            await waiter
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
    return future.done()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class UpstreamPool:
    """At most `max_connections` connections to one upstream, idle ones kept alive."""

    def __init__(self, base_url: str, max_connections: int, connect_timeout: float,
                 read_timeout: float, pool_timeout: float, ca_file: str | None = None):
        parts = urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host: str = parts.hostname or ""  # serve.check_upstream: there is one
        self.port = parts.port or (443 if self.https else 80)
        default = 443 if self.https else 80
        self.host_header = (self.host if ":" not in self.host else f"[{self.host}]") + \
            ("" if self.port == default else f":{self.port}")
        self.prefix = parts.path.rstrip("/")
        self.max_connections = max_connections
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.pool_timeout = pool_timeout
        self._ssl = tls_context(ca_file) if self.https else None
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> UpstreamResponse:
        """Sends one request; its response once the head arrived (its body to read, then
        `release`). Raises PoolFull, ConnectFailed, ReadTimedOut or BadResponse."""
        if self._slots.locked():  # wait_for makes a task: only when one must wait
            try:
                await asyncio.wait_for(self._slots.acquire(), self.pool_timeout)
            except asyncio.TimeoutError:
                raise PoolFull(f"all {self.max_connections} upstream connections are busy") \
                    from None
        else:
            await self._slots.acquire()
        connection: _Connection | None = None
        try:
            head = self._head(method, target, headers, body)
            for attempt in (0, 1):
                reused = bool(self._idle)
                connection = await self._connection()
                response = UpstreamResponse(connection, method == "HEAD")
                connection.response = response
                assert connection.transport is not None  # connected
                connection.transport.write(head)
                try:
                    if await _done_within(response._head, self.read_timeout):
                        response._head.result()  # BadResponse when it failed
                        return response
                    raise ReadTimedOut(f"no answer within {self.read_timeout:g} s")
                except BadResponse:
                    connection.close()
                    # a kept-alive connection the upstream closed meanwhile: once more, anew
                    if attempt or not reused or response.received:
                        raise
            raise AssertionError("unreachable")
        except BaseException:
            # Cancelled too (the client hung up before the head came): closing the
            # connection is how the upstream learns to abort the request.
            if connection is not None:
                connection.response = None
                connection.close()
            self._slots.release()
            raise

    def release(self, response: UpstreamResponse) -> None:
        """Back to the pool when whole and kept alive; closed otherwise."""
        connection = response.connection
        connection.response = None
        if response.complete and response.keep_alive and not connection.closed and \
                response._error is None:
            connection.parser = httptools.HttpResponseParser(connection)
            self._idle.append(connection)
        else:
            connection.close()
        self._slots.release()

    def _head(self, method, target, headers, body) -> bytes:
        lines = [f"{method} {self.prefix}{target} HTTP/1.1\r\nhost: {self.host_header}\r\n"
                 .encode("latin-1")]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"content-length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        return b"".join(lines) + body

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(
                _Connection, self.host, self.port, ssl=self._ssl,
                server_hostname=self.host if self._ssl else None), self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectFailed("connect timed out", "connect_timeout") from None
        except ssl.SSLCertVerificationError as exc:
            raise ConnectFailed("its TLS certificate is not trusted", "tls",
                                f"{exc.verify_message}; --upstream-ca-file names the CAs to "
                                f"trust") from None
        except ssl.SSLError as exc:
            raise ConnectFailed("the TLS handshake failed", "tls",
                                str(exc.reason or exc)) from None
        except OSError as exc:
            if self._ssl is not None and isinstance(exc, _CUT_OFF):  # mid-handshake
                raise ConnectFailed("the TLS handshake failed", "tls",
                                    "the upstream closed the connection during the TLS "
                                    "handshake (is it serving TLS on that port?)") from None
            raise ConnectFailed(exc.strerror or type(exc).__name__) from None
        return connection

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """The context an https upstream is verified with: the system's CAs, or only those in
    `ca_file` (PEM) when given. Raises ValueError when that file is unreadable or holds no
    certificate."""
    if ca_file is None:
        return ssl.create_default_context()
    try:
        # OpenSSL reads to the end: a FIFO or a device would hold the start forever.
        info = os.stat(ca_file)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CA_FILE_BYTES:
            raise ValueError(f"--upstream-ca-file {ca_file}: a regular file of at most "
                             f"{MAX_CA_FILE_BYTES >> 20} MiB is expected")
        return ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError:  # before OSError: it is one
        why = "no CA certificate could be read from it (PEM expected)"
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
    raise ValueError(f"--upstream-ca-file {ca_file}: {why}")
