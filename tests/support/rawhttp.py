"""A bare HTTP/1.1 client over one socket, for timing a stream's first bytes.

httpx spends ~1 ms of its own on this VM between the bytes' arrival and the line it hands
out (parsing the head, building the response, decoding). That is the client's time, not
the server's: a test that asks how much of the client's wait the engine's TTFT leaves out
takes its clock at the `recv` that brings the first event instead."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit


class RawStreamClient:
    def __init__(self, url: str, timeout: float = 60.0):
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawStreamClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fill(self, until: bytes, start: int = 0) -> int:
        """Reads until `until` occurs in the buffer at or after `start`; its index."""
        while (index := self.buffer.find(until, start)) < 0:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        return index

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken

    def post_stream(self, path: str, body: dict) -> tuple[float, int, dict[str, str], str]:
        """POSTs `body` as JSON; (seconds from the send to the recv that completed the first
        chunk, which holds the first SSE event; status; headers with lower-case names; the
        whole body as text)."""
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
                   f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        started = time.perf_counter()
        self.sock.sendall(request)
        end = self._fill(b"\r\n\r\n")
        head = self._take(end + 4).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        assert status == 200 and headers.get("transfer-encoding") == "chunked", \
            (status, headers, self.buffer[:500])
        first_event = None
        chunks = []
        while True:
            line_end = self._fill(b"\r\n")
            size = int(self.buffer[:line_end].split(b";")[0], 16)
            self._take(line_end + 2)
            data = self._take(size + 2)[:-2]
            if first_event is None and size:  # the first event's bytes are all here
                first_event = time.perf_counter()
            if not size:
                break
            chunks.append(data)
        text = b"".join(chunks).decode()
        return (first_event or time.perf_counter()) - started, status, headers, text
