"""One relayed request's figures, and the telemetry they are written to.

A request's clock starts at its arrival (the handler's call, once the gateway's HTTP
parser has read its head) and every stamp is `time.perf_counter_ns()` taken right after the bytes
concerned were handed to the client's socket. Nothing here runs between the upstream's
bytes and the client's: figures are kept in the request's own lists and, when it finishes,
handed to the writer's thread, which computes the prompt's skeleton and writes them.

Outcomes map onto `ac_requests_total{status}` as the engine counts its own: ok → ok,
client_gone → aborted, upstream_error and timeout → error (the log and the gateway's
`outcomes` count them apart, and `ac_gateway_upstream_failures_total{reason}` says why
the upstream failed: `RequestFigures.failure`).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ac_observe import metrics as m
from ac_observe.engine.skeleton import Skeleton, skeleton_of_request, skeleton_of_text
from ac_observe.engine.telemetry import SkeletonLabeler, TelemetryWriter
from ac_observe.gateway.sse import EventReader, Usage, usage_of_body

log = logging.getLogger("ac_observe.gateway")

NS = 1e-9
OK, CLIENT_GONE, UPSTREAM_ERROR, TIMEOUT = OUTCOMES = ("ok", "client_gone", "upstream_error",
                                                       "timeout")
_STATUS_OF = {OK: "ok", CLIENT_GONE: "aborted", UPSTREAM_ERROR: "error", TIMEOUT: "error"}
GENERATION_PATHS = frozenset({"/v1/messages", "/v1/chat/completions", "/v1/completions"})


@dataclass(slots=True)
class RequestFigures:
    """What one request showed, stamped as its bytes left."""
    path: str
    lane: str
    arrival_ns: int
    body: bytes = b""
    status: int = 0
    first_content_ns: int = 0    # the chunk completing the first content event, sent
    last_content_ns: int = 0
    gaps_ns: list[int] = field(default_factory=list)
    outcome: str = OK
    reader: EventReader | None = None
    usage: Usage | None = None
    failure: str = ""            # why the upstream failed it (metrics.UPSTREAM_FAILURE_REASONS)

    def fail(self, reason: str) -> None:
        """The upstream failed this request: the first reason is the one counted."""
        if reason and not self.failure:
            self.failure = reason

    def content_sent(self, events: int, now_ns: int) -> None:
        """A chunk that completed `events` content events was handed to the socket: the
        first of them a gap after the last one sent (none for the first token), the rest 0
        after it, as the client reads them."""
        if not events:
            return
        if not self.first_content_ns:
            self.first_content_ns = now_ns
        else:
            self.gaps_ns.append(now_ns - self.last_content_ns)
        self.gaps_ns.extend([0] * (events - 1))
        self.last_content_ns = now_ns

    @property
    def ttft_ns(self) -> int:
        return self.first_content_ns - self.arrival_ns if self.first_content_ns else 0


def skeleton_of_body(path: str, body: bytes) -> Skeleton | None:
    """The prompt's skeleton as the engine computes it: a Messages or Chat body's system
    and messages, a completion's prompt text; None for anything else."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("messages"), list):
        return skeleton_of_request(request.get("system"), request["messages"])
    if path == "/v1/completions" and isinstance(request.get("prompt"), str):
        return skeleton_of_text(request["prompt"])
    return None


class GatewayStats:
    """The gateway's telemetry writer, fed by a thread of its own: the event loop only
    queues a finished request's figures, so no request waits on another's skeleton or
    telemetry writes (a keep-alive client's next request arrives while they run)."""

    def __init__(self, writer: TelemetryWriter | None, skeleton_labels: SkeletonLabeler):
        self.writer = writer
        self.skeleton_labels = skeleton_labels
        self.outcomes: Counter[str] = Counter()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="ac-gateway-telemetry",
                                        daemon=True)
        self._thread.start()

    def finish(self, figures: RequestFigures, end_ns: int) -> None:
        """A finished request (the event loop's thread): counted, and queued for writing."""
        self.outcomes[figures.outcome] += 1
        if figures.outcome != OK:
            log.info("%s %s: %s (status %d)", figures.path, figures.lane, figures.outcome,
                     figures.status)
        if self.writer is not None and (figures.path in GENERATION_PATHS or figures.failure):
            self._queue.put((figures, end_ns))

    def _drain(self) -> None:
        if self.writer is None:
            return  # nothing is queued without a writer
        while (item := self._queue.get()) is not None:
            figures, end_ns = item
            try:
                skeleton = skeleton_of_body(figures.path, figures.body) \
                    if figures.body and figures.path in GENERATION_PATHS else None
                self._write(self.writer, figures, end_ns, skeleton)
                if self._queue.empty():
                    self.writer.flush()
            except Exception:  # a full disk costs figures, never a request or the gateway
                log.exception("gateway telemetry write failed")

    def _write(self, writer: TelemetryWriter, figures: RequestFigures, end_ns: int,
               skeleton: Skeleton | None) -> None:
        if figures.failure:  # any path's: an unreachable upstream fails /v1/models too
            writer.inc(m.UPSTREAM_FAILURES, reason=figures.failure)
        if figures.path not in GENERATION_PATHS:
            return
        lane = figures.lane
        if skeleton is not None:
            label = self.skeleton_labels.label(skeleton.skeleton_id)
            writer.observe(m.SKELETON_COMPLEXITY, float(skeleton.depth))
            writer.inc(m.SKELETON_REQUESTS, skeleton=label)
        writer.inc(m.REQUESTS, stream=lane, status=_STATUS_OF[figures.outcome])
        if figures.ttft_ns:
            ttft = figures.ttft_ns * NS
            writer.observe(m.INFERENCE_LATENCY, ttft, stream=lane)
            writer.observe(m.FIRST_TOKEN_SENT, ttft, stream=lane)
        if figures.gaps_ns:
            writer.observe_many(m.INTER_TOKEN_LATENCY, [g * NS for g in figures.gaps_ns],
                                stream=lane)
        if figures.outcome == OK:
            writer.observe(m.E2E_LATENCY, (end_ns - figures.arrival_ns) * NS, stream=lane)
        usage = figures.usage
        if usage is not None:
            if usage.prompt_tokens:
                writer.inc(m.PROMPT_TOKENS, usage.prompt_tokens)
            if usage.output_tokens:
                writer.inc(m.GENERATION_TOKENS, usage.output_tokens)

    def whole_usage(self, figures: RequestFigures, body: bytes) -> None:
        if figures.path in GENERATION_PATHS:
            figures.usage = usage_of_body(body)

    def close(self) -> None:
        """Writes what is queued, then closes the writer."""
        self._queue.put(None)
        self._thread.join(10)
        if self.writer is not None:
            self.writer.close()


def now_ns() -> int:
    return time.perf_counter_ns()
