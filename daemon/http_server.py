"""A small HTTP/1.1 server for the daemon's routes (stdlib asyncio: the daemon installs
without a web stack), built to stay up under careless or hostile clients.

- Connections cost no thread: idle and slow clients wait in the event loop, and each
  request head must arrive within `read_timeout` (slowloris), the next one on a kept-alive
  connection within `idle_timeout`. Heads are bounded in size; no request carries a body.
- At most `max_requests` handlers run at once (node_exporter's `--web.max-requests`); the
  rest queue for up to `queue_timeout`, then get 503. At `max_connections` (kept below
  the descriptor limit, which is raised at start) the server stops accepting and new
  clients wait in the kernel's backlog (1024) until a connection closes.
- A client that does not read its answer within `write_timeout` is cut off (the socket
  and its buffer go at once); every socket is closed when its client goes.
- With TLS (`tls`: the web-config file's context, `daemon/tls.py`), a connection's first
  byte tells a TLS handshake from a plain-HTTP request, which is answered 400 ("Client sent
  an HTTP request to an HTTPS server", Go's words) and closed; the handshake must end
  within `read_timeout`. Every refusal is counted by reason (`Refusals`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import unquote

log = logging.getLogger("ac_observe.daemon.http")

MAX_HEAD_BYTES = 16 << 10
LISTEN_BACKLOG = 1024
FD_RESERVE = 256  # for collectors, telemetry files, the handlers' pool
TLS_HANDSHAKE_RECORD = 0x16
PLAIN_HTTP_ON_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     b"Connection: close\r\n\r\n"
                     b"Client sent an HTTP request to an HTTPS server.\n")
# ac_http_refused_total's reasons: a failed TLS handshake (a wrong or missing client
# certificate, a protocol or cipher the server does not take, garbage), plain HTTP sent to
# the TLS port, a verified client certificate whose names client_allowed_sans does not
# hold, a request without credentials, one with wrong credentials.
REFUSAL_REASONS = ("tls_handshake", "plain_http_on_tls", "client_cert_name",
                   "missing_credentials", "bad_credentials")

# The TLS in force for a new connection: its context and the client certificate names
# allowed (empty: any the CA signed).
TlsSource = Callable[[], tuple[ssl.SSLContext, frozenset[str]]]


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one (capped at 65536); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return max(soft if soft != resource.RLIM_INFINITY else 65536, 2 * FD_RESERVE)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; values as sent (latin-1)
    peer: str = ""           # the client's address


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class BadRequest(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> tuple[Request, bool]:
    """The request in a head (request line + headers), and whether to keep the connection."""
    try:
        text = head.decode("latin-1")
        request_line, *header_lines = text[:-4].split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise BadRequest(400, "malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0") or not target.startswith("/"):
        raise BadRequest(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers or headers.get("content-length", "0") not in ("0", ""):
        raise BadRequest(413, "this server takes no request bodies")
    path, _, query = target.partition("?")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return Request(method, unquote(path), query, headers), keep_alive


def encode_head(response: Response, keep_alive: bool) -> bytes:
    reason = HTTPStatus(response.status).phrase
    lines = [f"HTTP/1.1 {response.status} {reason}",
             f"Content-Type: {response.content_type}",
             f"Content-Length: {len(response.body)}",
             "Server: ac-observe",
             "Connection: " + ("keep-alive" if keep_alive else "close")]
    lines += [f"{name}: {value}" for name, value in response.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Refusals:
    """Connections and requests refused, by reason (every reason from 0): counted by the
    event loop and the handlers, read by the daemon's cycle."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(REFUSAL_REASONS, 0)
        self._lock = threading.Lock()

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Coalesced:
    """Runs `action` on a thread of its own when triggered; triggers while it runs make one
    more run after it, not one each (a burst of SIGHUPs is one or two reloads)."""

    def __init__(self, action: Callable[[], object]):
        self.action = action
        self._lock = threading.Lock()
        self._running = self._again = False

    def trigger(self) -> None:
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        threading.Thread(target=self._run, name="ac-reload", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.action()
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False


async def _peek_first_byte(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """The connection's first byte, left in the socket for the TLS layer to read."""
    ready = loop.create_future()
    fd = conn.fileno()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)
    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return conn.recv(1, socket.MSG_PEEK)


class HttpServer:
    def __init__(self, handler: Callable[[Request], Response], host: str, port: int, *,
                 max_requests: int = 40, max_connections: int = 1024,
                 read_timeout: float = 10.0, idle_timeout: float = 30.0,
                 queue_timeout: float = 10.0, write_timeout: float = 30.0,
                 tls: TlsSource | None = None, refusals: Refusals | None = None):
        self.handler = handler
        self.tls = tls
        self.refusals = refusals if refusals is not None else Refusals()
        # handler.inline(request) -> Response | None, if it has one: answered on the event
        # loop (it must not block), None sends the request to the handlers' pool.
        self._inline = getattr(handler, "inline", None)
        self.host, self.port = host, port
        # Connections must never starve the collectors of descriptors: raise the soft
        # limit as far as allowed, and keep a reserve below it.
        self.max_connections = min(max_connections, raise_fd_limit() - FD_RESERVE)
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self.queue_timeout, self.write_timeout = queue_timeout, write_timeout
        self._pool = ThreadPoolExecutor(max_requests, thread_name_prefix="ac-http")
        self._max_requests = max_requests
        self._open: set[asyncio.StreamWriter] = set()
        # NOTE: made by start(), on the loop that serves: every method below that uses
        # them runs after it (hence the asserts).
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._room: asyncio.Event | None = None  # set while below max_connections
        self._connections = 0
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        """Bind and listen (errors such as a taken port surface here)."""
        self._slots = asyncio.Semaphore(self._max_requests)
        self._room = asyncio.Event()
        self._room.set()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.create_server((self.host, self.port), family=family,
                                              backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        """Accept while below max_connections; at the limit, stop accepting (new clients
        wait in the kernel's backlog) rather than take descriptors the daemon needs."""
        loop = asyncio.get_running_loop()
        room, listener = self._room, self._listener
        assert room is not None and listener is not None
        while True:
            await room.wait()
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: back off, never spin
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._connections += 1
            if self._connections >= self.max_connections:
                room.clear()
            loop.create_task(self._serve_socket(conn))

    async def _serve_socket(self, conn: socket.socket) -> None:
        try:
            # An answer is its head and its body, two writes: never hold the body back for
            # the ACK of the head (Nagle; asyncio sets TCP_NODELAY only for sockets whose
            # proto says TCP, and accepted ones say 0).
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is None:
                reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_HEAD_BYTES)
            else:
                opened = await self._open_tls(conn)
                if opened is None:
                    conn.close()
                    return
                reader, writer = opened
            await self._connection(reader, writer)
        except OSError:
            conn.close()
        finally:
            self._connections -= 1
            assert self._room is not None
            self._room.set()

    async def _open_tls(self, conn: socket.socket
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The TLS stream of an accepted connection, or None (refused and counted, or a
        client that sent nothing in time) with the socket left to close."""
        assert self.tls is not None
        loop = asyncio.get_running_loop()
        try:
            first = await asyncio.wait_for(_peek_first_byte(loop, conn), self.read_timeout)
        except (asyncio.TimeoutError, OSError):
            return None
        if not first:
            return None
        if first[0] != TLS_HANDSHAKE_RECORD:
            if first.isalpha():  # a request line's method: plain HTTP
                self.refusals.count("plain_http_on_tls")
                await self._tell_plain_client(loop, conn)
            else:
                self.refusals.count("tls_handshake")
            return None
        context, allowed_names = self.tls()
        reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=context, ssl_handshake_timeout=self.read_timeout)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            self.refusals.count("tls_handshake")
            log.debug("TLS handshake refused: %s", exc)
            return None
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        if allowed_names:
            cert = transport.get_extra_info("peercert") or {}
            names = {str(value) for _, value in cert.get("subjectAltName", ())}
            if not names & allowed_names:
                self.refusals.count("client_cert_name")
                log.debug("client certificate refused: no name in client_allowed_sans")
                transport.abort()
                return None
        return reader, writer

    async def _tell_plain_client(self, loop: asyncio.AbstractEventLoop,
                                 conn: socket.socket) -> None:
        """Go's answer to plain HTTP on a TLS port; the request read first (unread bytes
        would turn the close into a reset that can swallow the answer)."""
        with contextlib.suppress(OSError):
            conn.recv(MAX_HEAD_BYTES)
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(loop.sock_sendall(conn, PLAIN_HTTP_ON_TLS),
                                   self.write_timeout)
            conn.shutdown(socket.SHUT_WR)

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        assert self._accepting is not None and self._listener is not None
        self._accepting.cancel()
        self._listener.close()
        for writer in list(self._open):
            writer.transport.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, on_ready: Callable[[], None] | None = None,
            on_hangup: Callable[[], object] | None = None) -> None:
        """Serve until SIGINT or SIGTERM (main thread); SIGHUP calls `on_hangup` on a
        thread of its own (a reload reads files and the store), or is ignored."""
        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            if on_hangup is not None:
                loop.add_signal_handler(signal.SIGHUP, Coalesced(on_hangup).trigger)
            else:
                loop.add_signal_handler(signal.SIGHUP, lambda: None)
            await self.start()
            if on_ready:
                on_ready()
            await self.serve_until(stop)

        asyncio.run(main())

    def start_in_thread(self) -> Callable[[], None]:
        """Serve from a background thread (benches, embedding); returns the stop function."""
        ready, failure = threading.Event(), []
        running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # (loop, stop)

        async def main() -> None:
            stop_serving = asyncio.Event()
            running.append((asyncio.get_running_loop(), stop_serving))
            try:
                await self.start()
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            await self.serve_until(stop_serving)

        thread = threading.Thread(target=asyncio.run, args=(main(),), name="ac-http",
                                  daemon=True)
        thread.start()
        ready.wait()
        if failure:
            raise failure[0]

        def stop() -> None:
            loop, stop_serving = running[0]
            loop.call_soon_threadsafe(stop_serving.set)
            thread.join(10)

        return stop

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            timeout = self.read_timeout
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
                except asyncio.LimitOverrunError:
                    await self._send(writer, Response(431, b'{"error":"request head too '
                                                           b'large"}'), False, False)
                    return
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    request, keep_alive = parse_head(head)
                except BadRequest as exc:
                    body = f'{{"error":"{exc}"}}'.encode()
                    await self._send(writer, Response(exc.status, body), False, False)
                    return
                peer = writer.get_extra_info("peername")
                request.peer = peer[0] if isinstance(peer, tuple) else ""
                response = None
                if self._inline is not None:
                    try:
                        response = self._inline(request)
                    except Exception:  # the pool's path answers it
                        log.debug("inline answer to %s failed", request.path, exc_info=True)
                        response = None
                if response is None:
                    response = await self._dispatch(request)
                if not await self._send(writer, response, keep_alive, request.method == "HEAD"):
                    return
                if not keep_alive:
                    return
                timeout = self.idle_timeout
        finally:
            # A client that does not read its answer is cut off, not waited for: its
            # socket and buffer go now (and counted as open until then).
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            else:
                writer.close()
            self._open.discard(writer)

    async def _dispatch(self, request: Request) -> Response:
        slots = self._slots
        assert slots is not None
        try:
            await asyncio.wait_for(slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            return Response(503, b'{"error":"too many requests in flight; retry"}',
                            headers={"Retry-After": "1"})
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.handler, request)
        except Exception:
            log.exception("request %s failed", request.path)
            return Response(500, b'{"error":"internal error"}')
        finally:
            slots.release()

    async def _send(self, writer: asyncio.StreamWriter, response: Response, keep_alive: bool,
                    head_only: bool) -> bool:
        try:
            writer.write(encode_head(response, keep_alive))
            if not head_only:
                writer.write(response.body)  # not joined: no copy of a MiB body (NODELAY)
            await asyncio.wait_for(writer.drain(), self.write_timeout)
            return True
        except (asyncio.TimeoutError, ConnectionError):
            writer.transport.abort()
            return False

