"""ASGI middleware: request ids on every response, and a hard limit on body size (413)."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from ac_observe.engine.api_format import new_request_id
from ac_observe.engine.api_wire import traceparent_trace_id  # noqa: F401 - re-exported

GENERATION_PATHS = frozenset({"/v1/messages", "/v1/chat/completions", "/v1/completions"})
TRACE_DEFAULTS = ((b"x-ac-model-latency-ns", b"0"), (b"x-ac-queue-time-ns", b"0"),
                  (b"x-ac-trace-detail", b"{}"))
ARRIVAL_KEY = "arrival_ns"  # in the ASGI scope's state: time.monotonic_ns() at arrival
class BodyLimitAndIdsMiddleware:
    """Tags every response with `request-id` and `x-ac-trace-id` (the W3C traceparent's
    trace id when the client sent one) and refuses bodies over `max_body_bytes` before
    the app parses a byte of them."""

    def __init__(self, app, max_body_bytes: int, error_body: Callable[..., dict]):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.error_body = error_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        # Latencies count from the request's first byte (ArrivalStampingProtocol), or from
        # here under another server: before the body is read and parsed either way.
        arrival_ns = state.get(ARRIVAL_KEY) or time.monotonic_ns()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        request_id = new_request_id()
        trace_id = traceparent_trace_id(headers.get(b"traceparent", b"").decode("latin-1")) \
            or uuid.uuid4().hex
        state["request_id"], state["trace_id"] = request_id, trace_id
        state[ARRIVAL_KEY] = arrival_ns
        ids = [(b"request-id", request_id.encode()), (b"x-ac-trace-id", trace_id.encode())]
        send_with_ids = _sending_ids(send, ids, scope["path"] in GENERATION_PATHS)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._too_large(scope, send_with_ids)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send_with_ids)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(scope, send_with_ids)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        await self.app(scope, _replaying(b"".join(chunks), receive), send_with_ids)

    async def _too_large(self, scope, send) -> None:
        message = f"request body is larger than the limit of {self.max_body_bytes} bytes"
        payload = json.dumps(self.error_body(scope["path"], 413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _sending_ids(send, ids: list[tuple[bytes, bytes]], generation: bool):
    """`send` adding the ids to the response's headers, and on a generation route the
    trace headers too."""
    async def send_with_ids(message):
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", [])) + ids
            if generation:  # the trace headers too, zero when nothing ran (errors)
                present = {k.lower() for k, _ in headers}
                headers += [h for h in TRACE_DEFAULTS if h[0] not in present]
            message = {**message, "headers": headers}
        await send(message)

    return send_with_ids


def _replaying(body: bytes, receive):
    """`receive` handing the app the body read already, once, then the connection's own
    messages (a disconnect)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def arrival_stamping_protocol():
    """uvicorn's httptools protocol, stamping each request's arrival when the parser meets
    its first byte (`on_message_begin`, inside `data_received`), rather than when the ASGI
    app is first called: ~0.1 ms of parsing and dispatch later on a 2-core VM, which the
    client waits through and time to first token would otherwise leave out.

    NOTE: a pipelined request (sent before the previous response ended, which clients
    rarely do) is stamped when its bytes arrive, so its front-end time holds its wait
    behind the response before it."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ArrivalStampingProtocol(HttpToolsProtocol):
        def on_message_begin(self) -> None:
            arrival_ns = time.monotonic_ns()
            super().on_message_begin()
            self.scope.setdefault("state", {})[ARRIVAL_KEY] = arrival_ns

    return ArrivalStampingProtocol
