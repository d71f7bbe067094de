"""How answers leave the server: SSE streams written on the handler's own task, the
delivery stamp (arrival to the first content bytes handed to the socket), answers sent
whole with that stamp in their trace detail, and the event loop's sampled lag.

NOTE: the delivery stamp is taken as the ASGI `send` of the message carrying the first
text is called, its bytes final: uvicorn's protocol frames them and writes them to the
socket inside that call, microseconds later. Not after it returns: the write's syscall
lets the engine thread take the GIL, and a stamp taken after it came out up to 5 ms
later than the client's own receipt on a busy 2-core VM.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse, StreamingResponse

from ac_observe.engine import api_format as fmt
from ac_observe.engine.llm_engine import RequestOutput, TraceDetail
from ac_observe.engine.stats import EngineStats

LOOP_LAG_PERIOD_SECONDS = 0.1


class FirstSent:
    """One stream's delivery stamp. The body generator `arm`s it just before it yields the
    chunk that carries the request's first text; the response stamps it as it sends that
    chunk, and hands both figures to the engine's statistics."""
    __slots__ = ("arrival_ns", "lane", "stats", "armed", "text_ready_ns", "sent_ns")

    def __init__(self, arrival_ns: int, lane: str, stats: EngineStats):
        self.arrival_ns, self.lane, self.stats = arrival_ns, lane, stats
        self.armed = False
        self.text_ready_ns = 0  # arrival to the first text ready on the engine thread
        self.sent_ns = 0        # arrival to its bytes handed to the socket (0: not yet)

    def arm(self, out: RequestOutput) -> None:
        if out.first_text_ns and not self.sent_ns:
            self.text_ready_ns, self.armed = out.first_text_ns, True

    def stamp(self) -> None:
        self.armed = False
        self.sent_ns = time.monotonic_ns() - self.arrival_ns
        self.stats.on_first_sent(self.lane, self.sent_ns * 1e-9,
                                 max(0, self.sent_ns - self.text_ready_ns) * 1e-9)


class EventStreamResponse(StreamingResponse):
    """An SSE stream whose head and first event go out on the handler's own task.

    Starlette's StreamingResponse (under ASGI spec < 2.4, which uvicorn speaks) first
    starts a task group, spawns the writer as a new task and only then sends the head:
    ~0.2 ms on a 2-core VM between the first token and its bytes that no latency figure
    counts. Here the head and the first chunk (which carries the first token's text) are
    written at once; Starlette's own path (writer and disconnect listener) then carries the
    rest, so a client that goes away still cancels the body and frees the request's
    blocks. `first_sent` is stamped as the chunk it was armed for is sent."""

    def __init__(self, body, first_sent: FirstSent | None = None, **kwargs):
        super().__init__(body, **kwargs)
        self.first_sent = first_sent

    async def __call__(self, scope, receive, send) -> None:
        chunks = aiter(self.body_iterator)
        first_sent = self.first_sent
        try:
            first = await anext(chunks, None)
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            if first is not None:
                message = {"type": "http.response.body", "more_body": True,
                           "body": first if isinstance(first, (bytes, memoryview))
                           else first.encode(self.charset)}
                if first_sent is not None and first_sent.armed:
                    first_sent.stamp()
                await send(message)
            self.body_iterator = chunks

            async def after_head(message) -> None:
                if message["type"] != "http.response.start":  # sent above
                    if first_sent is not None and first_sent.armed:
                        first_sent.stamp()
                    await send(message)

            await super().__call__(scope, receive, after_head)
        finally:
            # Whatever ended it (a client gone before Starlette's writer ran, a send that
            # raised), the body's `finally` (which aborts the request) runs now, not when a
            # garbage collector gets to the generator.
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()


def sse_response(body, first: RequestOutput, first_sent: FirstSent) -> EventStreamResponse:
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no",
               **fmt.trace_headers(first.trace)}
    return EventStreamResponse(body, first_sent, media_type="text/event-stream",
                               headers=headers)


class WholeResponse(JSONResponse):
    """An answer sent whole: its body is rendered first, then, just before the head is
    written, the delivery stamp goes into `x-ac-trace-detail` (`first_sent_ns`; the body's
    bytes follow the head in the same turn of the loop)."""

    def __init__(self, content, trace: TraceDetail | None, arrival_ns: int):
        super().__init__(content, headers=fmt.final_trace_headers(trace))
        self.trace, self.arrival_ns = trace, arrival_ns

    async def __call__(self, scope, receive, send) -> None:
        detail = fmt.trace_detail_json(self.trace)
        detail["first_sent_ns"] = time.monotonic_ns() - self.arrival_ns
        value = json.dumps(detail, separators=(",", ":")).encode("latin-1")
        self.raw_headers = [(k, value if k == b"x-ac-trace-detail" else v)
                            for k, v in self.raw_headers]
        await super().__call__(scope, receive, send)


async def sample_loop_lag(stats_of: Callable[[], EngineStats | None],
                          period: float = LOOP_LAG_PERIOD_SECONDS) -> None:
    """Every `period`, how late the loop woke for a timer due then: the time a ready
    callback (a first token's chunk among them) waits behind the loop's other work."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        stats = stats_of()
        if stats is not None:
            stats.on_loop_lag(max(0.0, loop.time() - due))
