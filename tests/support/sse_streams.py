"""A bare asyncio client of the OpenAI chat route: many streams at once over raw sockets,
each request timed from its send to the recv that completed its first content chunk, and
read against its own usage chunk's `ac_trace`.

Bare sockets, because an HTTP library's own parsing (~1 ms a chunk for httpx on a 2-core
VM) would be counted as the server's; no chunked-encoding parse is needed to find an
event's end, only its `\\n\\n`."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit


def _body(i: int, max_tokens: int) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"<q>{i}</q> " * (2 + i % 5)}]}
                      ).encode()


async def _one(reader, writer, i: int, max_tokens: int) -> dict:
    payload = _body(i, max_tokens)
    started = time.perf_counter()  # before the write: the server may stamp arrival first
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    buffer, first_content, trace = b"", None, None
    scanned = 0
    while trace is None:
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        now = time.perf_counter()
        buffer += chunk
        while (end := buffer.find(b"\n\n", scanned)) >= 0:
            event, scanned = buffer[scanned:end], end + 2
            start = event.find(b"data: {")
            # Only the events it needs are parsed: the client's own work is in the figure.
            if start < 0 or (first_content is not None and b'"ac_trace"' not in event):
                continue
            data = json.loads(event[start + 6:].split(b"\r\n", 1)[0])
            choices = data.get("choices")
            if first_content is None and choices and choices[0]["delta"].get("content"):
                first_content = now - started
            if "usage" in data:
                trace = data["usage"]["ac_trace"]
    while not buffer.endswith(b"0\r\n\r\n"):  # the chunked body's end: the next request
        chunk = await reader.read(65536)     # starts on a clean connection
        if not chunk:
            break
        buffer += chunk
    return {"client_first_content_s": first_content, **trace}


async def _stream_worker(host: str, port: int, index: int, requests: int,
                         max_tokens: int, out: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for k in range(requests):
            out.append(await _one(reader, writer, index * 1000 + k, max_tokens))
    finally:
        writer.close()


def run_streams(url: str, streams: int, requests_per_stream: int,
                max_tokens: int = 16) -> list[dict]:
    """`streams` connections each sending `requests_per_stream` requests one after the
    other; every request's client-side first-content time and its ac_trace."""
    parts = urlsplit(url)
    out: list[dict] = []

    async def main() -> None:
        await asyncio.gather(*(_stream_worker(parts.hostname, parts.port, i,
                                              requests_per_stream, max_tokens, out)
                               for i in range(streams)))
    asyncio.run(main())
    return out


def gaps_ms(results: list[dict]) -> list[float]:
    """Per request: the client's first content chunk minus the server's `first_sent_ns`
    (both from the request's start: the client's send, the server's first byte), ms."""
    return [r["client_first_content_s"] * 1e3 - r["first_sent_ns"] / 1e6 for r in results]
