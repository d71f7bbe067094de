"""Demo traffic for `--demo-load`: a few concurrent clients on the engine's real HTTP API.

Mixes both APIs, both lanes, stream and non-stream, prompts that share long system
prompts (prefix-cache hits) and prompts with nested structure (skeleton depth). Its
`LoadShape` may change while it runs (`up --demo-drift-cause load|prompts`): more clients
(a burst), or each user message repeated (long prompts). An `on_trace` callback gets
each answer's per-request figures (the engine's trace: headers of an answer sent whole,
the last event's `ac_trace` of a stream). Torch-free.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ac_observe.metrics import LANE_HEADER, LOW_LATENCY, THROUGHPUT

log = logging.getLogger("ac_observe.demo")
_REFUSALS_SAID: set[int] = set()

SYSTEMS = [
    "You are a careful SRE assistant. " * 24,
    ("<instructions>\nAnswer in one line.\n"
     "<rules>\n- cite\n- be brief\n</rules>\n</instructions>\n") * 6,
    "",
]
USER_TEMPLATES = [
    "What is the GPU doing right now? Request {n}.",
    "# Incident {n}\n## Symptoms\n- TTFT up\n- KV hit rate down\n  1. since deploy\n",
    "<context><doc id='{n}'>\n```json\n{{\"p95_ms\": [{n}, 12], \"stream\": {{\"util\": 0.9}}}}"
    "\n```\n</doc></context>\nSummarise.",
    "| metric | value |\n|---|---|\n| ttft | {n} ms |\nExplain the table.",
]


@dataclass(slots=True)
class LoadShape:
    """What the demo clients send; read before each request, so a change applies at once."""
    clients: int = 3
    prompt_repeat: int = 1  # each user message this many times over: longer prompts


# An answer's trace as the engine's `ac_trace` has it, with `sent` (the client's wall
# clock when the request left).
TraceCallback = Callable[[dict], None]


def _one_request(client: httpx.Client, rng: random.Random, n: int, repeat: int = 1,
                 on_trace: TraceCallback | None = None) -> None:
    system = rng.choice(SYSTEMS)
    user = "\n".join([rng.choice(USER_TEMPLATES).format(n=n % 50)] * repeat)
    lane = LOW_LATENCY if rng.random() < 0.3 else THROUGHPUT
    headers = {LANE_HEADER: lane}
    max_tokens = rng.randint(8, 48)
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = {"model": "demo", "max_tokens": max_tokens, "stream": stream,
                "messages": [{"role": "user", "content": user}]}
        if system:
            body["system"] = system
        path = "/v1/messages"
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        body = {"model": "demo", "max_tokens": max_tokens, "stream": stream,
                "messages": messages}
        if stream:  # its last chunk's usage carries the trace
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions"
    sent, trace = time.time(), None
    if stream:
        with client.stream("POST", path, json=body, headers=headers) as response:
            for line in response.iter_lines():
                if on_trace is not None and '"ac_trace"' in line:
                    trace = _stream_trace(line)
    else:
        response = client.post(path, json=body, headers=headers)
        if on_trace is not None and response.status_code < 400:
            trace = _whole_trace(response.headers)
    if trace is not None and on_trace is not None:
        on_trace({**trace, "sent": sent})
    if response.status_code >= 400 and response.status_code not in _REFUSALS_SAID:
        # (a long-prompt drift past a small model's context: its figures would mislead)
        _REFUSALS_SAID.add(response.status_code)
        log.warning("demo traffic: the engine answers %d to %s (said once a status)",
                    response.status_code, path)


def _stream_trace(line: str) -> dict | None:
    """The `ac_trace` of a stream's last event: a chat chunk's usage, a message_delta's
    metadata."""
    try:
        event = json.loads(line.removeprefix("data:").strip())
        found = (event.get("usage") or {}).get("ac_trace") or \
            (event.get("metadata") or {}).get("ac_trace")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def _whole_trace(headers: httpx.Headers) -> dict | None:
    """An answer sent whole: its trace headers in the shape of a stream's `ac_trace`."""
    try:
        detail = json.loads(headers.get("x-ac-trace-detail", "{}"))
        return {**detail, "model_latency_ns": int(headers["x-ac-model-latency-ns"]),
                "queue_time_ns": int(headers["x-ac-queue-time-ns"])}
    except (ValueError, KeyError, TypeError):
        return None


def run_demo_load(base_url: str, stop: threading.Event, concurrency: int = 3,
                  seed: int = 0, pause_seconds: float = 0.05,
                  shape: LoadShape | None = None, on_trace: TraceCallback | None = None,
                  in_flight: dict[int, float] | None = None) -> None:
    """Send requests until `stop` is set; survives an engine that restarts or goes away.
    `shape` (default: `concurrency` clients) may change while it runs; `in_flight`, when
    given, holds each client's request under way: its index -> when it was sent."""
    shape = shape or LoadShape(clients=concurrency)

    def worker(index: int) -> None:
        rng = random.Random(seed + index)
        n = 0
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not stop.is_set():
                if index >= shape.clients:  # a client beyond the shape's: idle
                    stop.wait(0.2)
                    continue
                n += 1
                if in_flight is not None:
                    in_flight[index] = time.time()
                try:
                    _one_request(client, rng, n, max(1, shape.prompt_repeat), on_trace)
                except httpx.HTTPError as exc:
                    log.debug("demo request failed: %s", exc)
                    stop.wait(1.0)
                finally:
                    if in_flight is not None:
                        in_flight.pop(index, None)
                stop.wait(pause_seconds * rng.random())

    threads: list[threading.Thread] = []
    while not stop.is_set():
        while len(threads) < shape.clients:
            threads.append(threading.Thread(target=worker, args=(len(threads),), daemon=True,
                                            name=f"demo-{len(threads)}"))
            threads[-1].start()
        stop.wait(0.2)
    for thread in threads:
        thread.join()


def wait_healthy(base_url: str, timeout_seconds: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False
