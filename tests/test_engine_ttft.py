"""Time to first token as the client sees it, first visible text, and request fields that
are honoured or refused, never silently ignored."""
from __future__ import annotations

import gc
import json
import socket
import statistics
import time

import httpx
import pytest
from starlette.responses import StreamingResponse

from support.rawhttp import RawStreamClient
from support.telemetry import family_value, read_with_multiprocess_collector


def _messages(prompt: str, **extra) -> dict:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": prompt}], **extra}


def _stream(client: httpx.Client, url: str, body: dict):
    """(seconds to the first SSE event, to the first non-empty text, headers, final trace)
    as this client sees them."""
    started = time.perf_counter()
    first_event = first_text = None
    trace = {}
    with client.stream("POST", url + "/v1/messages", json=body) as response:
        assert response.status_code == 200, response.read()
        event = None
        for line in response.iter_lines():
            now = time.perf_counter()
            if line.startswith("event: "):
                event = line[7:]
                first_event = first_event or now
            elif line.startswith("data: ") and event == "content_block_delta":
                if json.loads(line[6:])["delta"]["text"]:
                    first_text = first_text or now
            elif line.startswith("data: ") and event == "message_delta":
                trace = json.loads(line[6:])["metadata"]["ac_trace"]
        headers = response.headers
    return first_event - started, first_text and first_text - started, headers, trace


def _trace_of(events: str) -> dict:
    """The ac_trace of a Messages stream's message_delta event."""
    for block in events.split("\n\n"):
        if block.startswith("event: message_delta\n"):
            return json.loads(block.split("data: ", 1)[1])["metadata"]["ac_trace"]
    raise AssertionError(f"no message_delta in {events[:300]!r}")


@pytest.mark.slow
def test_the_clock_starts_when_the_request_arrives(engine_server):
    """Sequential requests on one connection, timed from the send to the recv that brings
    the first event: the engine's TTFT (from the request's first byte to the first token)
    never claims more than the client waited, holds the front-end and queue times, and
    leaves out little: the HTTP stack's way out. How little is a speed figure, so it is
    bench/ttft_gap.py's (bench/run.py row 7: median 0.4-0.9 ms on a 2-core VM as its host
    is quiet or busy, against 1 ms; ~1.05 ms from this client before the arrival moved to
    the parser's first byte, the httptools parser, and the head and first event to the
    handler's own task, which the next two tests pin down one by one). Here it is bounded
    at 5 ms, against regressions such as a clock started late."""
    gaps = []
    gc.disable()  # the client's own collections (this test process holds a lot) are not
    try:          # the server's time
        _time_gaps(engine_server, gaps)
    finally:
        gc.enable()
    assert min(gaps) >= 0, gaps
    assert statistics.median(gaps) < 0.005, sorted(gaps)


def _time_gaps(engine_server, gaps: list) -> None:
    with RawStreamClient(engine_server.url) as client:
        for i in range(10):  # a fresh engine's first requests take its colder paths
            client.post_stream("/v1/messages", _messages(f"warm up {i}"))
        for i in range(60):
            to_event, _, headers, events = client.post_stream(
                "/v1/messages", _messages(f"<q>{i}</q> " * (1 + i % 7)))
            ttft = int(headers["x-ac-model-latency-ns"]) / 1e9
            assert _trace_of(events)["model_latency_ns"] / 1e9 == ttft
            detail = json.loads(headers["x-ac-trace-detail"])
            assert 0 < detail["frontend_ms"] / 1e3 + int(headers["x-ac-queue-time-ns"]) / 1e9 \
                < ttft  # front-end and queue are parts of it
            gaps.append(to_event - ttft)


def _wait_until_read(server_port: int, client_port: int, timeout: float = 10.0) -> None:
    """Until the server's end of this connection holds no unread bytes (/proc/net/tcp:
    its rx_queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                local, remote, queues = fields[1], fields[2], fields[4]
                if int(local.split(":")[1], 16) == server_port and \
                        int(remote.split(":")[1], 16) == client_port:
                    if int(queues.split(":")[1], 16) == 0:
                        return
        time.sleep(0.005)
    raise AssertionError("the server did not read the request line")


def test_arrival_is_the_requests_first_byte_not_the_apps_first_call(engine_server):
    """The request line, then 300 ms later the rest: the front-end time holds the 300 ms
    the server spent receiving the request (a stamp taken when the app is first called,
    after the headers, would not)."""
    payload = json.dumps(_messages("slow client")).encode()
    with socket.create_connection(("127.0.0.1", engine_server.port)) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\n")
        # The 300 ms count from the server's read of the request line (a busy server that
        # read both parts at once would see no gap).
        _wait_until_read(engine_server.port, sock.getsockname()[1])
        time.sleep(0.3)
        sock.sendall(b"Host: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
    detail = json.loads(next(line.split(":", 1)[1] for line in head.decode().split("\r\n")
                             if line.lower().startswith("x-ac-trace-detail:")))
    assert 300 <= detail["frontend_ms"] < 2000, detail


def test_the_head_and_the_first_tokens_text_are_written_before_anything_else_waits():
    """EventStreamResponse sends the head and the first chunk before it first awaits the
    client's `receive` (Starlette's StreamingResponse, under ASGI 2.3, starts its
    disconnect listener first and the writer after it), then the rest through Starlette,
    and closes the body (its `finally` aborts the request) whatever ended it."""
    import asyncio

    from ac_observe.engine.streaming import EventStreamResponse

    async def run(response_class, disconnect_after_first: bool):
        log, closed = [], []

        async def body():
            try:
                yield "first"
                yield "second"
            finally:
                closed.append(True)

        async def receive():
            log.append("receive")
            if disconnect_after_first:
                return {"type": "http.disconnect"}
            await asyncio.sleep(3600)

        async def send(message):
            log.append(message["type"].rsplit(".", 1)[1] + ":" +
                       message.get("body", b"").decode())
            await asyncio.sleep(0)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        await response_class(body(), media_type="text/event-stream")(scope, receive, send)
        return log, list(closed)  # before asyncio.run's own shutdown closes generators

    log, closed = asyncio.run(run(EventStreamResponse, False))
    assert log[:2] == ["start:", "body:first"], log
    assert [e for e in log if e != "receive"] == ["start:", "body:first", "body:second",
                                                  "body:"], log
    assert closed == [True]
    log, closed = asyncio.run(run(EventStreamResponse, True))  # gone after the first
    assert log[:2] == ["start:", "body:first"] and closed == [True], log
    log, _ = asyncio.run(run(StreamingResponse, False))
    assert log[0] == "receive", log  # what it replaces waits on the client first


def _prompt_with_late_text(client: httpx.Client, url: str) -> str:
    """A prompt whose first generated bytes are not yet a character (greedy, tiny model)."""
    for i in range(60):
        prompt = f"#{i} é"
        answer = client.post(url + "/v1/messages", json={**_messages(prompt),
                                                        "stream": False, "max_tokens": 8})
        first_text = int(answer.headers["x-ac-first-text-ns"])
        if first_text > int(answer.headers["x-ac-model-latency-ns"]) and \
                answer.json()["content"][0]["text"]:
            return prompt
    raise AssertionError("no prompt of 60 starts with an incomplete character")


def test_first_visible_text_is_timed_apart_from_the_first_token(engine_server):
    """Five runs of one greedy prompt whose first bytes are not yet a character: the first
    text comes after the first token, the client sees each a little after the engine's
    instant (never before), and the engine's sums are exactly the traced figures. The way
    back is bounded on the best of the five runs: one run on a busy 2-core VM can wait
    a scheduler slice."""
    runs = []
    with httpx.Client(timeout=60) as client:
        prompt = _prompt_with_late_text(client, engine_server.url)
        before = read_with_multiprocess_collector(engine_server.telemetry_dir)
        for _ in range(5):
            to_event, to_text, _, trace = _stream(
                client, engine_server.url, {**_messages(prompt), "max_tokens": 8})
            runs.append((to_event, to_text, trace["model_latency_ns"] / 1e9,
                         trace["first_text_ns"] / 1e9))
    for to_event, to_text, ttft, first_text in runs:
        assert first_text > ttft
        assert to_text is not None and to_event >= ttft and to_text >= first_text
    # What the client saw, each a little after the engine's instant (the way back).
    assert min(to_event - ttft for to_event, _, ttft, _ in runs) < 0.010, runs
    assert min(to_text - first for _, to_text, _, first in runs) < 0.010, runs
    after = read_with_multiprocess_collector(engine_server.telemetry_dir)

    def added(family, sample):
        return family_value(after, family, sample, stream="throughput") - \
            family_value(before, family, sample, stream="throughput")

    assert added("ac_time_to_first_text_seconds", "ac_time_to_first_text_seconds_sum") == \
        pytest.approx(sum(run[3] for run in runs), abs=1e-8)
    assert added("ac_inference_latency_seconds", "ac_inference_latency_seconds_sum") == \
        pytest.approx(sum(run[2] for run in runs), abs=1e-8)
    assert added("ac_time_to_first_text_seconds", "ac_time_to_first_text_seconds_count") == 5


@pytest.mark.slow
def test_ignore_eos_min_tokens_and_stop_token_ids_are_honoured(engine_server):
    chat = engine_server.url + "/v1/chat/completions"
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 64, "temperature": 1.0}
    with httpx.Client(timeout=60) as client:
        # A seed with which the random model ends (EOS) well before 64 tokens.
        for seed in range(200):
            early = client.post(chat, json={**base, "seed": seed}).json()
            if early["choices"][0]["finish_reason"] == "stop" and \
                    early["usage"]["completion_tokens"] < 40:
                break
        else:
            raise AssertionError("no seed of 200 ends early")
        n = early["usage"]["completion_tokens"]
        full = client.post(chat, json={**base, "seed": seed, "ignore_eos": True}).json()
        assert full["usage"]["completion_tokens"] == 64
        assert full["choices"][0]["finish_reason"] == "length"
        longer = client.post(chat, json={**base, "seed": seed, "min_tokens": n + 5}).json()
        assert longer["usage"]["completion_tokens"] >= n + 5
        anthropic = [client.post(engine_server.url + "/v1/messages", json={
            "model": "tiny", "max_tokens": 64, "temperature": 1.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"hi {i}"}]}).json() for i in range(4)]
        assert [a["usage"]["output_tokens"] for a in anthropic] == [64] * 4
        assert {a["stop_reason"] for a in anthropic} == {"max_tokens"}
        # Stop on a token id: the byte tokenizer's id of a byte the greedy answer holds.
        greedy = client.post(chat, json={**base, "temperature": 0, "max_tokens": 12}).json()
        text = greedy["choices"][0]["message"]["content"].encode("utf-8", "replace")
        ascii_bytes = [b for b in text if b < 0x80]
        if ascii_bytes:
            stop_id = ascii_bytes[0]
            cut = client.post(chat, json={**base, "temperature": 0, "max_tokens": 12,
                                          "stop_token_ids": [stop_id]}).json()
            assert cut["choices"][0]["finish_reason"] == "stop"
            assert cut["usage"]["completion_tokens"] < 12
            assert bytes([stop_id]) not in cut["choices"][0]["message"]["content"].encode()


@pytest.mark.parametrize("path, extra", [
    ("/v1/messages", {"tools": [{"name": "x", "input_schema": {}}]}),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("/v1/messages", {"foo": 1}),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}),
    ("/v1/chat/completions", {"logprobs": True}),
    ("/v1/chat/completions", {"repetition_penalty": 1.2}),
])
def test_a_field_the_engine_does_not_honour_is_a_400_naming_it(engine_server, path, extra):
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}], **extra}
    response = httpx.post(engine_server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert next(iter(extra)) in error["message"], error


@pytest.mark.parametrize("path, extra", [
    ("/v1/messages", {"metadata": {"user_id": "u-1"}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}),
    ("/v1/chat/completions", {"user": "u-1", "frequency_penalty": 0,
                              "presence_penalty": 0, "logprobs": False,
                              "stream_options": None, "top_k": 5}),
])
def test_documented_fields_that_only_label_a_request_are_accepted(engine_server, path, extra):
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}], **extra}
    assert httpx.post(engine_server.url + path, json=body, timeout=60).status_code == 200
