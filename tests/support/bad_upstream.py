"""An upstream that misbehaves on request, for the gateway's tests: a raw asyncio HTTP
server on a loopback port, in a thread. The request's `x-bad` header picks the fault:

- `malformed`: a 200 event stream with an unterminated 2 MiB event, data that is not
  JSON, then one valid content event and [DONE] (the bytes are in `MALFORMED_STREAM`)
- `slow`: no answer for 3 s
- `stall`: a stream's head and first event, then silence for 3 s
- `5xx`: a 500 with an OpenAI error body (`ERROR_500`)
- `garbage`: bytes that are no HTTP response, then the connection closed
- `error_event`: a 200 event stream with one content event, then an error event
- `paced`: a well-formed 200 event stream, its content events apart by `PACED_GAPS_S` (each
  event a chunk of its own), then [DONE]
- `burst`: a content event, 50 ms later BURST events (a chunk each) in one write, 50 ms
  later one more, then [DONE]

With `tls` (a server context), it serves https.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import threading

ERROR_500 = json.dumps({"error": {"message": "boom", "type": "server_error", "param": None,
                                  "code": None}}).encode()
CONTENT_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
ERROR_EVENT = b'data: {"error":{"message":"overloaded","type":"server_error"}}\n\n'
# Distinct gaps between content events (three latency buckets or more apart).
PACED_GAPS_S = (0.01, 0.06, 0.2) * 4
BURST = 5
MALFORMED_STREAM = [b"data: {not json\n\n", b"data: " + b"x" * (2 << 20), b"\n\n",
                    b": a comment\n\ndata: [1, 2]\n\n", CONTENT_EVENT, b"data: [DONE]\n\n"]


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class BadUpstream:
    def __init__(self, tls: ssl.SSLContext | None = None):
        self.tls = tls
        self.faults: list[str] = []  # each request's, as it arrived
        self.loop = asyncio.new_event_loop()
        self.server = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                self.faults.append(headers.get("x-bad", ""))
                if not await self._answer(headers.get("x-bad", ""), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _answer(self, fault: str, writer) -> bool:
        stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                       b"transfer-encoding: chunked\r\n\r\n")
        if fault == "malformed":
            writer.write(stream_head)
            for part in MALFORMED_STREAM:
                writer.write(_chunk(part))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        elif fault == "silent":  # no answer for longer than any test waits
            await asyncio.sleep(60)
            return False
        elif fault in ("slow", "stall"):
            if fault == "stall":
                writer.write(stream_head + _chunk(CONTENT_EVENT))
                await writer.drain()
            await asyncio.sleep(3)
            return False
        elif fault in ("paced", "error_event"):
            writer.write(stream_head + _chunk(CONTENT_EVENT))
            await writer.drain()
            for gap in PACED_GAPS_S if fault == "paced" else ():
                await asyncio.sleep(gap)
                writer.write(_chunk(CONTENT_EVENT))
                await writer.drain()
            writer.write(_chunk(ERROR_EVENT if fault == "error_event" else b"data: [DONE]\n\n")
                         + b"0\r\n\r\n")
        elif fault == "burst":
            writer.write(stream_head + _chunk(CONTENT_EVENT))
            await writer.drain()
            for events in (BURST, 1):
                await asyncio.sleep(0.05)
                writer.write(_chunk(CONTENT_EVENT) * events)
                await writer.drain()
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif fault == "early_hints":  # a 103 first: its headers are not the answer's
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n")
            await writer.drain()
            writer.write(stream_head + _chunk(CONTENT_EVENT) + _chunk(b"data: [DONE]\n\n")
                         + b"0\r\n\r\n")
        elif fault == "5xx":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                         b"application/json\r\ncontent-length: "
                         + str(len(ERROR_500)).encode() + b"\r\n\r\n" + ERROR_500)
        else:  # garbage
            writer.write(b"SPLAT\x00\x01 not http\r\n\r\n")
            await writer.drain()
            return False
        await writer.drain()
        return True

    def stop(self) -> None:
        async def close():  # answers still under way (a slow one) end here, not in the GC
            self.server.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self.loop.stop()
        asyncio.run_coroutine_threadsafe(close(), self.loop)
        self.thread.join(5)
