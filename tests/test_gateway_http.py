"""The gateway's HTTP/1.1 server (gateway/http_server.py, gateway/exchange.py) against
what clients send: keep-alive, pipelining, `Expect: 100-continue`, chunked bodies,
HTTP/1.0, HEAD, slow readers, hostile heads and framings, a failing handler, a hang-up and
a graceful shutdown. Answers are read back with httptools' response parser (llhttp), not
this server's own code."""
from __future__ import annotations

import asyncio
import logging

import httptools
import pytest

from ac_observe.gateway.exchange import BodyBroken, BodyTooLarge, ClientGone, Exchange
from ac_observe.gateway.http_server import MAX_HEAD_BYTES, Server


class _Answers:
    """Every answer in the bytes a connection received, parsed by llhttp."""

    def __init__(self):
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict] = []
        self._current: dict = {}

    def on_message_begin(self):
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name, value):
        self._current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self):
        self._current["status"] = self.parser.get_status_code()

    def on_body(self, body):
        self._current["body"] += body

    def on_message_complete(self):
        self.done.append(self._current)


async def _answers(reader: asyncio.StreamReader, count: int, timeout: float = 5,
                   pause: float = 0.0) -> list:
    """The first `count` answers (fewer if the server closes first), reading 64 KiB at a
    time with `pause` seconds between reads (a slow reader)."""
    answers = _Answers()
    while len(answers.done) < count:
        data = await asyncio.wait_for(reader.read(65536), timeout)
        if not data:
            break
        answers.parser.feed_data(data)
        if pause:
            await asyncio.sleep(pause)
    return answers.done


async def _closed(reader: asyncio.StreamReader, timeout: float = 5) -> bool:
    """Whether the server closes the connection (with nothing more sent) within `timeout`."""
    try:
        return await asyncio.wait_for(reader.read(1), timeout) == b""
    except asyncio.TimeoutError:
        return False


async def _read(reader: asyncio.StreamReader, count: int) -> tuple:
    """(the first `count` answers, then whether the server closed the connection)."""
    answers = await _answers(reader, count)
    return answers, await _closed(reader)


async def _ask(server: Server, request: bytes) -> tuple:
    """One request on a new connection: (its answers, whether the server then closed)."""
    reader, writer = await _connect(server)
    writer.write(request)
    return await _read(reader, 1)


async def _until(condition, timeout: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never came"
        await asyncio.sleep(0.01)


async def _echo(exchange: Exchange) -> None:
    """Answers the method, path, query and body; `?sleep=S` first sleeps."""
    if exchange.query.startswith(b"sleep="):
        await asyncio.sleep(float(exchange.query[6:]))
    body = await exchange.body()
    answer = b"%s %s %s %s" % (exchange.method.encode(), exchange.path.encode(),
                               exchange.query, body)
    exchange.start(200, [(b"content-length", str(len(answer)).encode())])
    exchange.write(answer)
    exchange.end()


def _echo_noting(paths: list):
    """_echo that first notes each request's path in `paths` (as its handler begins)."""
    async def handler(exchange: Exchange) -> None:
        paths.append(exchange.path)
        await _echo(exchange)
    return handler


def _serve(handler, client, max_body: int = 1 << 20, keep_alive_s: float = 5.0,
           write_timeout_s: float = 600.0, head_timeout_s: float = 30.0):
    async def main():
        server = Server(handler, max_body, keep_alive_s, write_timeout_s, head_timeout_s)
        await server.start("127.0.0.1", 0)
        try:
            return await asyncio.wait_for(client(server), 20)
        finally:
            await server.shutdown(1.0)
    return asyncio.run(main())


async def _connect(server: Server):
    return await asyncio.open_connection("127.0.0.1", server.port)


def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async def client(server):
        reader, writer = await _connect(server)
        # the first is slowest: an answer out of order would show
        writer.write(b"GET /a?sleep=0.2 HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /b%20c HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nxyz"
                     b"GET /c?sleep=0.05 HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = await _answers(reader, 3)
        writer.write(b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection, later
        later = await _answers(reader, 1)
        writer.close()
        return answers + later
    answers = _serve(_echo, client)
    assert [a["body"] for a in answers] == [b"GET /a sleep=0.2 ", b"POST /b c  xyz",
                                            b"GET /c sleep=0.05 ", b"GET /d  "]
    assert all("connection" not in a["headers"] for a in answers)


def test_a_chunked_request_body_and_expect_100_continue():
    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n")
        answers = await _answers(reader, 1)
        writer.close()
        return interim, answers
    interim, answers = _serve(_echo, client)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answers[0]["body"] == b"POST /v1/x  abcdefg"


def test_a_refusal_before_the_body_sends_no_100_and_closes():
    async def refuse(exchange: Exchange) -> None:
        body = b"too large"
        exchange.start(413, [(b"content-length", b"9")])
        exchange.write(body)
        exchange.end()

    async def client(server):
        return await _ask(server, b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                  b"Content-Length: 100000000\r\n\r\n")
    answers, closed = _serve(refuse, client)
    assert answers[0]["status"] == 413 and answers[0]["headers"]["connection"] == "close"
    assert closed  # the unread body would be taken for the next request otherwise


def test_a_body_past_the_limit_is_never_held():
    seen: list = []
    sent = 8 << 20

    async def handler(exchange: Exchange) -> None:
        try:
            await exchange.body()
        except BodyTooLarge:
            seen.append(exchange)
        exchange.start(413, [(b"content-length", b"0")])
        exchange.end()

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        writer.write(block * (sent >> 16))  # more than the socket takes: the rest waits
        return await _read(reader, 1)
    answers, closed = _serve(handler, client, max_body=4096)
    assert answers[0]["status"] == 413 and closed
    # reading stopped soon after the limit (not the 8 MiB), and nothing of it was kept
    assert seen[0].received < sent // 2 and seen[0]._parts == []


def test_http_1_0_gets_no_chunked_framing_and_a_close():
    async def stream(exchange: Exchange) -> None:
        exchange.start(200, [(b"content-type", b"text/event-stream")])
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            exchange.write(part)
        exchange.end()

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        return await asyncio.wait_for(reader.read(), 5)  # to the connection's end
    raw = _serve(stream, client)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head
    assert body == b"data: 1\n\ndata: 2\n\n"


def test_head_and_204_answers_carry_no_body():
    async def handler(exchange: Exchange) -> None:
        status = 204 if exchange.path == "/none" else 200
        exchange.start(status, [(b"content-length", b"5")] if status == 200 else [])
        exchange.write(b"hello")
        exchange.end()

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nGET /none HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while raw.count(b"HTTP/1.1") < 3 or not raw.endswith(b"hello"):
            raw += await asyncio.wait_for(reader.read(65536), 5)
        return raw
    raw = _serve(handler, client)
    assert raw == (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
                   b"HTTP/1.1 204 No Content\r\n\r\n"
                   b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
     431),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
    # llhttp would hand the body over as the new protocol's bytes: relayed without it
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
     b"Upgrade: h2c\r\nContent-Length: 2\r\n\r\n{}", 400),
])
def test_hostile_heads_are_refused_and_the_server_goes_on(request_bytes, status):
    async def client(server):
        refused = await _ask(server, request_bytes)
        reader, writer = await _connect(server)
        writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        after = await _answers(reader, 1)
        return refused, after
    (answers, closed), after = _serve(_echo, client)
    assert answers[0]["status"] == status and closed
    assert after[0]["body"] == b"GET /next  "


def test_an_upgrade_request_is_answered_as_plain_http_then_closed():
    async def client(server):
        return await _ask(server, b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                                  b"Upgrade: websocket\r\n\r\n\x81\x85frame")
    answers, closed = _serve(_echo, client)
    assert answers[0]["body"] == b"GET /ws  " and closed  # the frame never read as a request


def test_a_failing_handler_is_a_500_and_harms_no_other_request():
    async def handler(exchange: Exchange) -> None:
        if exchange.path == "/boom":
            raise RuntimeError("a bug")
        await _echo(exchange)

    async def client(server):
        failed = await _ask(server, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        reader, writer = await _connect(server)
        writer.write(b"GET /fine HTTP/1.1\r\nHost: x\r\n\r\n")
        return failed, await _answers(reader, 1)
    (failed, closed), fine = _serve(handler, client)
    assert failed[0]["status"] == 500 and closed
    assert fine[0]["body"] == b"GET /fine  "


def test_a_slow_reader_pauses_the_writer_and_loses_nothing():
    paused: list = []
    total = 16 << 20

    async def handler(exchange: Exchange) -> None:
        exchange.start(200, [(b"content-length", str(total).encode())])
        block = bytes(range(256)) * 4096  # 1 MiB
        for _ in range(total // len(block)):
            exchange.write(block)
            if exchange.write_paused:
                paused.append(True)
                await exchange.drain()
        exchange.end()

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await _until(lambda: paused)  # the handler filled the socket and waits
        waited = len(paused)
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(total)
        return waited, head, body
    waited, head, body = _serve(handler, client)
    assert waited == 1 and len(paused) < total >> 20
    assert body == (bytes(range(256)) * 4096) * (total >> 20)


def test_a_client_that_stops_reading_is_cut_off_after_the_write_timeout():
    ended: list = []

    async def handler(exchange: Exchange) -> None:
        exchange.start(200, [])
        started = asyncio.get_running_loop().time()
        try:
            while True:
                exchange.write(b"x" * (1 << 20))
                if exchange.write_paused:
                    await exchange.drain()
        except ClientGone:
            ended.append(asyncio.get_running_loop().time() - started)

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        while not ended:  # never reads
            await asyncio.sleep(0.05)
    _serve(handler, client, write_timeout_s=0.5)
    assert 0.5 <= ended[0] < 3.0


def test_a_hang_up_reaches_the_handler_at_once():
    events: list = []

    async def handler(exchange: Exchange) -> None:
        task = asyncio.current_task()
        exchange.on_gone = task.cancel
        exchange.start(200, [])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append(("cancelled", exchange.gone))
            raise

    async def reader_gone(exchange: Exchange) -> None:
        events.append(("reading", exchange.gone))
        try:
            await exchange.body()
        except ClientGone:
            events.append(("body", exchange.gone))

    async def client(server):
        for path in (b"/stream", b"/body"):
            reader, writer = await _connect(server)
            if path == b"/stream":
                writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(b"\r\n\r\n")
            else:
                writer.write(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
                await _until(lambda: len(events) == 2)
            started = asyncio.get_running_loop().time()
            writer.close()
            while len(events) < (1 if path == b"/stream" else 3):
                await asyncio.sleep(0.01)
            assert asyncio.get_running_loop().time() - started < 0.5

    def route(exchange: Exchange):
        return handler(exchange) if exchange.path == "/stream" else reader_gone(exchange)
    _serve(route, client)
    assert events == [("cancelled", True), ("reading", False), ("body", True)]


def test_idle_connections_are_closed_after_the_keep_alive_time():
    async def client(server):
        reader, writer = await _connect(server)
        started = asyncio.get_running_loop().time()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) != b""  # the answer, then nothing
        assert await asyncio.wait_for(reader.read(), 5) == b""
        idle_closed = asyncio.get_running_loop().time() - started
        reader, writer = await _connect(server)  # a head that never ends (slowloris)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        return idle_closed, asyncio.get_running_loop().time() - started
    idle, half = _serve(_echo, client, keep_alive_s=0.4)
    assert 0.4 < idle < 2.0 and 0.4 < half < 2.0


def test_shutdown_lets_answers_in_flight_end_and_closes_the_rest():
    started: list = []

    async def client(server):
        busy_reader, busy_writer = await _connect(server)
        busy_writer.write(b"GET /slow?sleep=0.5 HTTP/1.1\r\nHost: x\r\n\r\n")
        idle_reader, idle_writer = await _connect(server)
        idle_writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await _answers(idle_reader, 1)
        await _until(lambda: "/slow" in started)
        stopping = asyncio.ensure_future(server.shutdown(5.0))
        idle_closed = await _closed(idle_reader, 1)
        answers, closed = await _read(busy_reader, 1)
        await stopping
        try:
            await asyncio.open_connection("127.0.0.1", server.port)
            refused = False
        except OSError:
            refused = True
        return idle_closed, answers, closed, refused
    idle_closed, answers, closed, refused = _serve(_echo_noting(started), client)
    assert idle_closed and refused
    assert answers[0]["body"] == b"GET /slow sleep=0.5 " and closed
    assert answers[0]["headers"]["connection"] == "close"


def test_a_pipelining_client_that_reads_slowly_gets_every_answer_and_leaks_nothing():
    """Streams pipelined behind a large one, read slowly: every answer whole and in order,
    and every handler returns (none left awaiting a drain another answer took over)."""
    sizes = [16 << 20, 192 << 10, 192 << 10, 192 << 10]  # whole 64 KiB blocks

    async def stream(exchange: Exchange) -> None:
        size = sizes[int(exchange.path[1:])]
        exchange.start(200, [])
        block = bytes(range(256)) * 256  # 64 KiB
        for _ in range(size // len(block) - 1):
            exchange.write(block)
            if exchange.write_paused:
                await exchange.drain()
        exchange.end(block)  # the last part with the end, then (as the relay does) a drain
        if exchange.write_paused:
            await exchange.drain()

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(4)))
        answers = await _answers(reader, 4, timeout=20, pause=0.001)
        await _until(lambda: not server._state.tasks)  # every handler has returned
        return answers
    answers = _serve(stream, client)
    assert [len(a["body"]) for a in answers] == sizes


def test_a_pipelining_client_that_reads_nothing_gets_no_more_answers_begun():
    """Whole answers (written at once, no drain) pipelined by a client that reads nothing:
    the next is begun only once the client takes what was written, so the server holds
    one answer for it, not one a request."""
    began: list = []
    size = 4 << 20  # 20 of them, 80 MiB: far more than the kernel's socket buffers take

    async def whole(exchange: Exchange) -> None:
        began.append(exchange.path)
        exchange.start(200, [(b"content-length", str(size).encode())], True)
        exchange.end(b"x" * size)

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
        await _until(lambda: began)
        await asyncio.sleep(0.5)  # reads nothing a while
        begun_while_full = len(began)
        held = max(c.transport.get_write_buffer_size() for c in server._state.connections)
        answers = await _answers(reader, 20, timeout=20)
        return begun_while_full, held, answers
    begun_while_full, held, answers = _serve(whole, client)
    assert begun_while_full < 20 and held <= size
    assert len(answers) == 20 and all(len(a["body"]) == size for a in answers)


def test_http_1_0_clients_get_no_100_and_keep_alive_only_when_asked():
    reading: list = []

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        await _until(lambda: reading)  # the handler waits for the body: a 100 would be now
        try:
            interim = await asyncio.wait_for(reader.read(64), 0.3)
        except asyncio.TimeoutError:
            interim = b""
        writer.write(b"hi")
        answered, closed = await _read(reader, 1)
        reader, writer = await _connect(server)
        writer.write(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        kept = await _answers(reader, 1)
        writer.write(b"GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        again = await _answers(reader, 1)
        return interim, answered, closed, kept, again
    interim, answered, closed, kept, again = _serve(_echo_noting(reading), client)
    assert interim == b"" and answered[0]["body"] == b"POST /  hi" and closed
    assert kept[0]["headers"]["connection"] == "keep-alive"
    assert again[0]["body"] == b"GET /b  "


def test_a_refusal_behind_a_pipelined_request_lets_its_answer_out_first():
    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET /a?sleep=0.1 HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP\r\n\r\n")
        return await _read(reader, 2)
    answers, closed = _serve(_echo, client)
    assert [a["body"] for a in answers] == [b"GET /a sleep=0.1 "] and closed
    assert answers[0]["headers"]["connection"] == "close"


def test_a_head_trickling_in_is_cut_off_after_the_head_timeout():
    async def client(server):
        reader, writer = await _connect(server)
        started = asyncio.get_running_loop().time()
        writer.write(b"GET / HTTP/1.1\r\n")
        while not reader.at_eof() and asyncio.get_running_loop().time() - started < 5:
            writer.write(b"X-A: b\r\n")  # a byte now and then: never idle
            try:
                await asyncio.wait_for(reader.read(1), 0.1)
            except asyncio.TimeoutError:
                pass
        return asyncio.get_running_loop().time() - started
    took = _serve(_echo, client, head_timeout_s=0.5)
    assert 0.5 <= took < 3.0


def test_every_answer_is_an_access_log_line_without_its_query(caplog):
    caplog.set_level(logging.INFO, logger="ac_observe.gateway.access")

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET /v1/models?key=secret HTTP/1.1\r\nHost: x\r\n\r\n")
        await _answers(reader, 1)
        await _until(lambda: caplog.records)
    _serve(_echo, client)
    line = caplog.records[0].getMessage()
    assert line.startswith('"GET /v1/models" 200 ') and "secret" not in line


def test_an_answer_still_being_taken_is_not_cut_off_as_idle_or_stalled():
    """16 MiB ended in one call, read steadily but slower than the keep-alive and write
    timeouts: every byte arrives, kept-alive or closing; a shutdown meanwhile waits for it."""
    size = 16 << 20

    async def whole(exchange: Exchange) -> None:
        exchange.start(200, [(b"content-length", str(size).encode())], True)
        exchange.end(b"y" * size)

    async def client(server):
        got = []
        for close in (b"", b"Connection: close\r\n"):
            reader, writer = await _connect(server)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n%b\r\n" % close)
            got += await _answers(reader, 1, timeout=20, pause=0.004)  # ~1.3 s for it
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")  # the answer has begun (and ended: one call)
        stopping = asyncio.ensure_future(server.shutdown(10.0))
        body = b""
        while len(body) < size and (part := await asyncio.wait_for(reader.read(65536), 20)):
            body += part
            await asyncio.sleep(0.004)
        await stopping
        return got + [{"body": body}]
    got = _serve(whole, client, keep_alive_s=0.5, write_timeout_s=0.5)
    assert [len(a["body"]) for a in got] == [size] * 3


def test_a_head_cut_off_by_reading_paused_is_not_timed_out():
    """A pipelined head split by the server's own pause (an answer ahead of it took
    longer than the head timeout) gets its whole time again once reading resumes."""
    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET /a?sleep=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /b HTTP/1.1\r\nHost: x\r\n\r\nGET /c HTTP/1.1\r\n")
        first = await _answers(reader, 2, timeout=10)
        writer.write(b"Host: x\r\n\r\n")
        return first + await _answers(reader, 1)
    answers = _serve(_echo, client, head_timeout_s=0.3)
    assert [a["body"] for a in answers] == [b"GET /a sleep=1 ", b"GET /b  ", b"GET /c  "]


def test_a_broken_body_fails_the_handler_reading_it_and_trailers_are_not_headers():
    async def handler(exchange: Exchange) -> None:
        try:
            body = await exchange.body()
        except BodyBroken as exc:
            body = b"broken: %s" % str(exc).encode()
        names = b",".join(n for n, _ in exchange.headers)
        exchange.start(200, [(b"content-length", str(len(body) + len(names) + 1).encode())])
        exchange.end(body + b" " + names)

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\nab\r\n0\r\nX-Trailer: 1\r\n\r\n")
        trailer = await _answers(reader, 1)
        reader, writer = await _connect(server)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(0.05)  # the handler is waiting for the body
        started = asyncio.get_running_loop().time()
        writer.write(b"zz\r\nnot a chunk\r\n")
        broken = await _answers(reader, 1)
        return trailer, broken, asyncio.get_running_loop().time() - started
    trailer, broken, took = _serve(handler, client)
    assert trailer[0]["body"] == b"ab host,transfer-encoding"
    assert broken[0]["body"].startswith(b"broken: 400 ") and took < 1.0


def test_a_handler_failing_after_its_answer_leaves_the_next_one_alone():
    async def handler(exchange: Exchange) -> None:
        await _echo(exchange)
        if exchange.path == "/a":
            raise RuntimeError("after the answer (as the telemetry's finish could)")

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /b?sleep=0.1 HTTP/1.1\r\nHost: x\r\n\r\n")
        return await _answers(reader, 2)
    answers = _serve(handler, client)
    assert [a["body"] for a in answers] == [b"GET /a  ", b"GET /b sleep=0.1 "]


def test_an_answer_past_its_content_length_is_refused_not_sent():
    async def handler(exchange: Exchange) -> None:
        exchange.start(200, [(b"content-length", b"5")])
        exchange.write(b"0123456789")

    async def client(server):
        reader, writer = await _connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        return await asyncio.wait_for(reader.read(), 5)  # to the close
    raw = _serve(handler, client)
    assert raw.endswith(b"content-length: 5\r\n\r\n")  # the head, then the close
