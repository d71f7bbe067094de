"""The gateway's request handler: every request relayed to one upstream as it is.

- Request: method, path, query, headers (hop-by-hop ones dropped, `Host` the upstream's,
  `traceparent` kept or added) and body (read whole, at most `max_body_bytes`: 413 beyond).
- Response: status, headers (hop-by-hop dropped; `x-ac-trace-id` ours) and body as the
  upstream sent them. An event stream goes on as it arrives (what arrived together in one
  write, up to upstream.MAX_MERGED); any other answer of at most `max_whole_bytes` is sent
  whole with `x-ac-gateway-ttft-ns`.
- The client's hang-up cancels the relay at once: the upstream connection is closed, which
  is how an OpenAI or Anthropic server learns to abort the request.
- Failures answer in the API's own error shape: 502 (upstream unreachable, TLS refused,
  broken answer), 503 (every upstream connection busy past `pool_timeout`), 504 (no answer
  within `read_timeout`). A stream already under way that fails is ended where it stopped.
  Each request the upstream failed carries the failure's reason into
  `ac_gateway_upstream_failures_total{reason}` (UpstreamError.reason, or the answer's own:
  upstream_5xx, error_event, malformed_sse).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass

from ac_observe.engine.api_wire import error_body, traceparent_trace_id
from ac_observe.gateway.exchange import BodyBroken, BodyTooLarge, ClientGone, Exchange
from ac_observe.gateway.measure import (
    CLIENT_GONE,
    OK,
    TIMEOUT,
    UPSTREAM_ERROR,
    GatewayStats,
    RequestFigures,
    now_ns,
)
from ac_observe.gateway.sse import EventReader
from ac_observe.gateway.upstream import (
    BadResponse,
    ConnectFailed,
    PoolFull,
    ReadTimedOut,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from ac_observe.metrics import DEFAULT_LANE, LANE_HEADER, LANES

log = logging.getLogger("ac_observe.gateway")

# RFC 9110 7.6.1, plus the ones proxies have always dropped; `host` and `content-length`
# are the upstream request's own (the pool writes both), `expect` is answered here.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                        b"proxy-authorization", b"proxy-connection", b"te", b"trailer",
                        b"trailers", b"transfer-encoding", b"upgrade"})
_REQUEST_OWN = frozenset({b"host", b"content-length", b"expect"})
TRACE_ID_HEADER = b"x-ac-trace-id"
TTFT_HEADER = b"x-ac-gateway-ttft-ns"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    upstream: str                    # base URL, e.g. http://127.0.0.1:8000
    max_body_bytes: int = 8 << 20
    max_whole_bytes: int = 64 << 20  # a non-stream answer past this is relayed unmeasured
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    max_connections: int = 256
    pool_timeout: float = 1.0
    upstream_ca_file: str | None = None  # PEM: the CAs an https upstream is verified with


class _Refused(Exception):
    def __init__(self, status: int, message: str, outcome: str, failure: str = ""):
        super().__init__(message)
        self.status, self.message, self.outcome = status, message, outcome
        self.failure = failure  # the upstream's failure reason, if it was the upstream's


def _drop_hop_by_hop(headers) -> list[tuple[bytes, bytes]]:
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in headers
            if name.lower() not in HOP_BY_HOP and name.lower() not in named]


def _trace(headers: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], str]:
    """The headers with a valid `traceparent` (the client's, else a new one) and its
    trace id."""
    given = next((v for n, v in headers if n == b"traceparent"), b"").decode("latin-1")
    trace_id = traceparent_trace_id(given) if given else None
    if trace_id is not None:
        return headers, trace_id
    random = secrets.token_hex(24)  # one read of the system's randomness, not two
    trace_id = random[:32]
    parent = f"00-{trace_id}-{random[32:]}-01".encode()
    return [(n, v) for n, v in headers if n != b"traceparent"] + [(b"traceparent", parent)], \
        trace_id


class Gateway:
    def __init__(self, config: GatewayConfig, stats: GatewayStats):
        self.config = config
        self.stats = stats
        self.pool = UpstreamPool(config.upstream, config.max_connections,
                                 config.connect_timeout, config.read_timeout,
                                 config.pool_timeout, config.upstream_ca_file)
        self._said: set[str] = set()  # the upstream failures' details already logged

    async def aclose(self) -> None:
        self.pool.close()

    async def __call__(self, exchange: Exchange) -> None:
        arrival = now_ns()
        headers = _drop_hop_by_hop(exchange.headers)
        lane = next((v.decode("latin-1") for n, v in headers if n == LANE_HEADER.encode()),
                    DEFAULT_LANE)
        figures = RequestFigures(exchange.path, lane if lane in LANES else DEFAULT_LANE,
                                 arrival)
        headers, trace_id = _trace(headers)
        answer_headers = [(TRACE_ID_HEADER, trace_id.encode())]
        try:
            figures.body = await self._body(exchange, headers)
            await self._relay_until_gone(exchange, headers, figures, answer_headers)
        except _Refused as refused:
            figures.outcome, figures.status = refused.outcome, refused.status
            figures.fail(refused.failure)
            self._error(exchange, refused.status, refused.message, answer_headers)
        except ClientGone:
            figures.outcome = CLIENT_GONE
        finally:
            self.stats.finish(figures, now_ns())

    async def _relay_until_gone(self, exchange: Exchange, headers, figures: RequestFigures,
                                answer_headers) -> None:
        """The relay, cancelled the moment the client hangs up (closing the upstream
        connection is what tells the upstream to abort): the server calls `on_gone`."""
        task = asyncio.current_task(exchange.loop)
        assert task is not None

        def hung_up() -> None:
            task.cancel()
        exchange.on_gone = hung_up
        try:
            await self._relay(exchange, headers, figures, answer_headers)
        except asyncio.CancelledError:
            if not exchange.gone:
                raise  # the server's own shutdown, not the client
            uncancel = getattr(task, "uncancel", None)  # 3.11+: what asyncio.timeout counts
            if uncancel is not None:
                uncancel()
            figures.outcome = CLIENT_GONE
        finally:
            exchange.on_gone = None

    async def _body(self, exchange: Exchange, headers) -> bytes:
        limit = self.config.max_body_bytes
        declared = next((v for n, v in headers if n == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Refused(413, f"request body over {limit} bytes", OK)
        try:
            return await exchange.body()
        except BodyTooLarge:
            raise _Refused(413, f"request body over {limit} bytes", OK) from None
        except BodyBroken as exc:
            raise _Refused(400, f"invalid request body: {exc}", OK) from None

    async def _relay(self, exchange: Exchange, headers, figures: RequestFigures,
                     answer_headers) -> None:
        target = exchange.raw_path.decode("latin-1")
        if exchange.query:
            target += "?" + exchange.query.decode("latin-1")
        upstream_headers = [(n, v) for n, v in headers if n not in _REQUEST_OWN]
        response = await self._send_upstream(exchange.method, target, upstream_headers,
                                             figures.body)
        try:
            _check(exchange)
            figures.status = response.status_code
            if response.status_code >= 500:
                figures.outcome = UPSTREAM_ERROR
                figures.fail("upstream_5xx")
            out_headers = [(n.lower(), v) for n, v in _drop_hop_by_hop(response.headers)
                           if n.lower() != TRACE_ID_HEADER] + answer_headers
            content_type = response.header(b"content-type") or b""
            encoded = (response.header(b"content-encoding") or b"identity") != b"identity"
            if content_type.startswith(b"text/event-stream"):
                await self._stream(response, out_headers, figures, exchange,
                                   None if encoded else EventReader())
            else:
                await self._whole(response, out_headers, figures, exchange)
        finally:
            self.pool.release(response)

    async def _send_upstream(self, method: str, target: str, headers,
                             body: bytes) -> UpstreamResponse:
        try:
            return await self.pool.request(method, target, headers, body)
        except PoolFull as exc:
            raise _Refused(503, str(exc), UPSTREAM_ERROR, exc.reason) from None
        except ConnectFailed as exc:
            if exc.detail and exc.detail not in self._said:  # once each: no flood
                if len(self._said) < 64:
                    self._said.add(exc.detail)
                log.warning("upstream %s: %s: %s", self.config.upstream, exc, exc.detail)
            what = "upstream refused" if exc.reason == "tls" else "upstream unreachable"
            raise _Refused(502, f"{what}: {exc}", UPSTREAM_ERROR, exc.reason) from None
        except ReadTimedOut as exc:
            raise _Refused(504, f"upstream gave no answer within "
                           f"{self.config.read_timeout:g} s", TIMEOUT, exc.reason) from None
        except BadResponse as exc:
            raise _Refused(502, f"upstream answered with no valid HTTP response: {exc}",
                           UPSTREAM_ERROR, exc.reason) from None

    async def _stream(self, response: UpstreamResponse, out_headers,
                      figures: RequestFigures, exchange: Exchange,
                      reader: EventReader | None) -> None:
        # The first event already here leaves with the head: one send, not two.
        exchange.start(response.status_code, out_headers, response.body_at_hand)
        figures.reader = reader
        try:
            async for chunk in response.chunks(self.config.read_timeout):
                if response.complete and not response.body_at_hand:
                    exchange.end(chunk)  # the last part and the end in one send
                else:
                    exchange.write(chunk)
                _check(exchange)
                sent = now_ns()
                if reader is not None:
                    figures.content_sent(reader.feed(chunk), sent)
                if exchange.write_paused:
                    await exchange.drain()
        except ReadTimedOut as exc:
            figures.outcome = TIMEOUT
            figures.fail(exc.reason)
        except UpstreamError as exc:
            figures.outcome = UPSTREAM_ERROR
            figures.fail(exc.reason)
        if reader is not None:
            figures.usage = reader.usage
            if reader.errors and figures.outcome == OK:
                figures.outcome = UPSTREAM_ERROR
                figures.fail("error_event")
            if reader.malformed:  # relayed as it came; the outcome stays the stream's
                figures.fail("malformed_sse")
        exchange.end()

    async def _whole(self, response: UpstreamResponse, out_headers,
                     figures: RequestFigures, exchange: Exchange) -> None:
        parts, size = [], 0
        chunks = response.chunks(self.config.read_timeout)
        try:
            async for chunk in chunks:
                parts.append(chunk)
                size += len(chunk)
                if size > self.config.max_whole_bytes:
                    break
            else:
                body = b"".join(parts)
                ready = now_ns()
                ttft = ready - figures.arrival_ns
                exchange.start(response.status_code,
                               out_headers + [(TTFT_HEADER, str(ttft).encode())], True)
                exchange.end(body)  # head and body in one send
                if response.status_code < 400:
                    figures.content_sent(1, ready)
                    self.stats.whole_usage(figures, body)
                return
        except ReadTimedOut as exc:
            raise _Refused(504, f"upstream's answer stalled past {self.config.read_timeout:g} s",
                           TIMEOUT, exc.reason) from None
        except UpstreamError as exc:
            raise _Refused(502, f"upstream's answer broke off: {exc}", UPSTREAM_ERROR,
                           exc.reason) from None
        await self._stream_rest(response.status_code, out_headers, parts, chunks, figures,
                                exchange)

    async def _stream_rest(self, status, out_headers, parts, chunks, figures: RequestFigures,
                           exchange: Exchange) -> None:
        """An answer too large to hold: what was read, then the rest as it comes."""
        exchange.start(status, out_headers)
        for part in parts:
            exchange.write(part)
        try:
            async for chunk in chunks:
                exchange.write(chunk)
                _check(exchange)
                if exchange.write_paused:
                    await exchange.drain()
        except UpstreamError as exc:
            figures.fail(exc.reason)
        exchange.end()

    def _error(self, exchange: Exchange, status: int, message: str, answer_headers) -> None:
        if exchange.started or exchange.gone:
            return
        body = json.dumps(error_body(exchange.path, status, message)).encode()
        exchange.start(status, [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                *answer_headers], True)
        exchange.end(body)


def _check(exchange: Exchange) -> None:
    """ClientGone once the client hung up: the cancel `on_gone` sent may have been
    swallowed (asyncio.wait_for in 3.11 drops a cancel that lands as its inner future
    completes), and a relay must not run on for nobody."""
    if exchange.gone:
        raise ClientGone
