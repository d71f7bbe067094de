"""A small HTTP/1.1 server for the daemon's GET routes (stdlib asyncio: the daemon installs
without a web stack), built to stay up under careless or hostile clients.

- Connections cost no thread: idle and slow clients wait in the event loop, and each
  request head must arrive within `read_timeout` (slowloris), the next one on a kept-alive
  connection within `idle_timeout`. Heads are bounded in size; GET and HEAD carry no body.
- At most `max_requests` handlers run at once (node_exporter's `--web.max-requests`); the
  rest queue for up to `queue_timeout`, then get 503. Past `max_connections`, new
  connections get 503 and are closed.
- The listen backlog is 1024, and every socket is closed when its client goes.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Callable
from urllib.parse import unquote

log = logging.getLogger("ac_observe.daemon.http")

MAX_HEAD_BYTES = 16 << 10
LISTEN_BACKLOG = 1024


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; values as sent (latin-1)


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


def encode_response(response: Response, keep_alive: bool, head_only: bool) -> bytes:
    reason = HTTPStatus(response.status).phrase
    lines = [f"HTTP/1.1 {response.status} {reason}",
             f"Content-Type: {response.content_type}",
             f"Content-Length: {len(response.body)}",
             "Server: ac-observe",
             "Connection: " + ("keep-alive" if keep_alive else "close")]
    lines += [f"{name}: {value}" for name, value in response.headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


class HttpServer:
    def __init__(self, handler: Callable[[Request], Response], host: str, port: int, *,
                 max_requests: int = 40, max_connections: int = 1024,
                 read_timeout: float = 10.0, idle_timeout: float = 30.0,
                 queue_timeout: float = 10.0, write_timeout: float = 30.0):
        self.handler = handler
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self.queue_timeout, self.write_timeout = queue_timeout, write_timeout
        self._pool = ThreadPoolExecutor(max_requests, thread_name_prefix="ac-http")
        self._max_requests = max_requests
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        """Bind and listen (errors such as a taken port surface here)."""
        self._slots = asyncio.Semaphore(self._max_requests)
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, limit=MAX_HEAD_BYTES,
            backlog=LISTEN_BACKLOG, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._server.close()
        for writer in list(self._open):
            writer.close()
        await self._server.wait_closed()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until SIGINT or SIGTERM (main thread)."""
        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await self.start()
            if on_ready:
                on_ready()
            await self.serve_until(stop)

        asyncio.run(main())

    def start_in_thread(self) -> Callable[[], None]:
        """Serve from a background thread (benches, embedding); returns the stop function."""
        ready, failure, handles = threading.Event(), [], {}

        async def main() -> None:
            handles["loop"], handles["stop"] = asyncio.get_running_loop(), asyncio.Event()
            try:
                await self.start()
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            await self.serve_until(handles["stop"])

        thread = threading.Thread(target=asyncio.run, args=(main(),), name="ac-http",
                                  daemon=True)
        thread.start()
        ready.wait()
        if failure:
            raise failure[0]

        def stop() -> None:
            handles["loop"].call_soon_threadsafe(handles["stop"].set)
            thread.join(10)

        return stop

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.max_connections:
            writer.write(encode_response(Response(503, b'{"error":"too many connections"}'),
                                         False, False))
            writer.close()
            return
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
                response = await self._dispatch(request)
                if not await self._send(writer, response, keep_alive, request.method == "HEAD"):
                    return
                if not keep_alive:
                    return
                timeout = self.idle_timeout
        finally:
            self._open.discard(writer)
            writer.close()

    async def _dispatch(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
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
            self._slots.release()

    async def _send(self, writer: asyncio.StreamWriter, response: Response, keep_alive: bool,
                    head_only: bool) -> bool:
        try:
            writer.write(encode_response(response, keep_alive, head_only))
            await asyncio.wait_for(writer.drain(), self.write_timeout)
            return True
        except (asyncio.TimeoutError, ConnectionError):
            return False
