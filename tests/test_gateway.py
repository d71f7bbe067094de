"""`ac-observe gateway` in front of the bundled engine and of a misbehaving upstream:
the official SDKs get the same answers through it as directly, a hang-up aborts the
upstream's request, failures answer in the API's shape with the outcome counted, and
its telemetry (kind gateway) answers the daemon and the CLI like an engine's."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from functools import partial

import anthropic
import httpx
import openai
import pytest

from support.bad_upstream import CONTENT_EVENT, ERROR_500, MALFORMED_STREAM, BadUpstream
from support.servers import EngineServer, GatewayServer, free_port, run_cli, wait_for
from support.sse_streams import run_streams
from support.telemetry import gateway_failures, read_as_daemon, read_with_multiprocess_collector

VARYING = {"id", "created", "ac_trace"}  # per request: ids, clocks, the engine's timings


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gw") / "telemetry"
    root.mkdir(mode=0o700)
    engine = EngineServer(root / "e1", "--engine-name", "e1", "--max-model-len", "1024",
                          "--kv-blocks", "512").wait_ready()
    gateway = GatewayServer(engine.url, root / "g1", "--name", "g1").wait_ready()
    yield engine, gateway, root
    gateway.stop()
    engine.stop()


def _normal(value):
    """A body with what differs per request (ids, clocks, the engine's timings) left out."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _events(raw: bytes) -> list:
    events = []
    for block in re.split(rb"\n\n", raw.strip()):
        name = re.search(rb"^event: (.*)$", block, re.M)
        data = re.search(rb"^data: (.*)$", block, re.M).group(1)
        events.append((name and name.group(1), data if data == b"[DONE]"
                       else _normal(json.loads(data))))
    return events


CHAT = {"model": "tiny", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "<doc><p>one</p></doc> and more"}]}
# (this anthropic SDK takes no `temperature`: it goes in extra_body, greedy as the others)
MESSAGES = {"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0},
            "system": "be brief",
            "messages": [{"role": "user", "content": "# Title\n- a\n- b"}]}


@pytest.mark.slow
def test_sdks_get_the_same_answers_through_the_gateway(stack):
    engine, gateway, _ = stack
    for url in (engine.url, engine.url):  # warm the prefix cache: both sides then hit it
        openai.OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(**CHAT)
        anthropic.Anthropic(base_url=url, api_key="x").messages.create(**MESSAGES)
    answers = []
    for url in (engine.url, gateway.url):
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        ant = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        chat = oai.chat.completions.create(**CHAT).model_dump()
        chunks = [c.model_dump() for c in oai.chat.completions.create(
            **CHAT, stream=True, stream_options={"include_usage": True})]
        message = ant.messages.create(**MESSAGES).model_dump()
        with ant.messages.stream(**MESSAGES) as stream:
            events = [e.model_dump() for e in stream]
        count = ant.messages.count_tokens(model="tiny", messages=MESSAGES["messages"],
                                          system=MESSAGES["system"])
        models = [m.id for m in oai.models.list()]
        errors = []
        for call in (partial(oai.chat.completions.create, model="tiny", max_tokens=-1,
                             messages=[]),
                     partial(ant.messages.create, model="tiny", max_tokens=0, messages=[])):
            with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as err:
                call()
            errors.append((err.value.status_code, err.value.body))
        raw_body = {**MESSAGES, "stream": True, "temperature": 0}
        del raw_body["extra_body"]
        raw = httpx.post(url + "/v1/messages", json=raw_body).content
        answers.append(_normal([chat, chunks, message, events, count.input_tokens, models,
                                errors, _events(raw)]))
    direct, through = answers
    assert direct[0]["choices"][0]["message"]["content"]  # something was generated
    assert direct[1][-1]["usage"]["completion_tokens"] == 12
    for a, b in zip(direct, through, strict=True):
        assert a == b


def _aborted(root) -> float:
    samples = read_as_daemon(root)
    return sum(v for (name, labels), v in samples.items()
               if name == "ac_requests_total" and ("status", "aborted") in labels
               and ("engine", "e1") in labels)


def _kv_usage(root) -> float:
    return sum(v for (name, labels), v in read_as_daemon(root).items()
               if name == "ac_kv_cache_usage_ratio" and ("engine", "e1") in labels)


def _post_raw(port: int, body: bytes) -> socket.socket:
    """A chat request sent on a bare socket, left open: the test hangs up when it likes."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    return sock


@pytest.mark.slow  # the engine and gateway it needs take ~10 s to start
def test_a_hang_up_mid_stream_aborts_the_upstream_request_within_a_second(stack):
    engine, gateway, root = stack
    before = _aborted(root)
    body = json.dumps({**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}).encode()
    sock = _post_raw(gateway.port, body)
    received = b""
    while received.count(b'"content"') < 3:  # the stream is under way
        received += sock.recv(65536)
    wait_for(lambda: _kv_usage(root) > 0, 2, "the stream's KV blocks held")
    sock.close()
    closed = time.monotonic()
    wait_for(lambda: _aborted(root) > before, 5, "the engine's aborted count")
    assert time.monotonic() - closed < 1.5  # 1 s, and the reads' own time
    # ... and its KV blocks are free again (nothing else runs on this engine now).
    wait_for(lambda: _kv_usage(root) == 0.0, 2, "the engine's KV blocks freed")
    # The gateway stays up and counts the request as the client's hang-up (aborted).
    families = read_with_multiprocess_collector(gateway.telemetry_dir)
    assert any(lab.get("status") == "aborted" and v >= 1
               for _, lab, v in families["ac_requests"]["samples"])


@pytest.mark.slow
def test_a_hang_up_before_a_whole_answer_aborts_the_upstream_request(stack):
    """A non-streamed answer's head leaves only when it is done: a client that hangs up
    while the gateway waits for it still aborts the engine's request, and the gateway's
    upstream connection is closed, not kept (nor counted against its pool)."""
    engine, gateway, root = stack
    before = _aborted(root)
    body = json.dumps({**CHAT, "max_tokens": 900, "ignore_eos": True}).encode()
    sock = _post_raw(gateway.port, body)
    wait_for(lambda: _kv_usage(root) > 0, 10, "the request's KV blocks held")
    sock.close()
    closed = time.monotonic()
    wait_for(lambda: _aborted(root) > before, 5, "the engine's aborted count")
    assert time.monotonic() - closed < 1.5  # 1 s, and the reads' own time
    wait_for(lambda: _kv_usage(root) == 0.0, 2, "the engine's KV blocks freed")


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    upstream = BadUpstream()
    root = tmp_path_factory.mktemp("bad") / "telemetry"
    root.mkdir(mode=0o700)
    gateway = GatewayServer(upstream.url, root / "gbad", "--read-timeout", "0.5")
    wait_for(lambda: _answers(gateway.url), 60, "the gateway")
    yield upstream, gateway
    gateway.stop()
    upstream.stop()


def _answers(url: str) -> bool:
    try:
        # Never cut short once taken in: a second probe would be a second failure counted.
        httpx.get(url + "/", headers={"x-bad": "5xx"}, timeout=30)
        return True
    except httpx.HTTPError:
        return False


def _requests_by_status(directory) -> dict:
    families = read_with_multiprocess_collector(directory)
    found: dict = {}
    for _, labels, value in families["ac_requests"]["samples"]:
        found[labels["status"]] = found.get(labels["status"], 0) + value
    return found


def _delta(after: dict, before: dict) -> dict:
    return {reason: after[reason] - before[reason] for reason in after
            if after[reason] != before[reason]}


@pytest.mark.slow
def test_upstream_faults_answer_in_the_apis_shape_and_are_counted(bad):
    upstream, gateway = bad
    before = _requests_by_status(gateway.telemetry_dir)
    failures_before = gateway_failures(gateway.telemetry_dir)
    post = lambda path, fault: httpx.post(gateway.url + path, json=CHAT,  # noqa: E731
                                          headers={"x-bad": fault}, timeout=10)
    malformed = post("/v1/chat/completions", "malformed")
    assert malformed.status_code == 200 and malformed.content == b"".join(MALFORMED_STREAM)
    error = post("/v1/chat/completions", "5xx")
    assert (error.status_code, error.content) == (500, ERROR_500)
    slow = post("/v1/messages", "slow")
    assert slow.status_code == 504 and slow.json()["type"] == "error"
    assert slow.json()["error"]["type"] == "api_error"
    garbage = post("/v1/chat/completions", "garbage")
    assert garbage.status_code == 502 and "upstream" in garbage.json()["error"]["message"]
    stalled = post("/v1/chat/completions", "stall")  # ends where the upstream stopped
    assert stalled.status_code == 200 and stalled.content.startswith(b"data: {")
    in_stream = post("/v1/chat/completions", "error_event")
    assert in_stream.status_code == 200 and b'"error"' in in_stream.content
    wait_for(lambda: sum(_requests_by_status(gateway.telemetry_dir).values())
             - sum(before.values()) >= 6, 10, "the six outcomes")
    after = _requests_by_status(gateway.telemetry_dir)
    assert after["ok"] - before["ok"] == 1  # the malformed stream, relayed whole
    assert after["error"] - before["error"] == 5  # 5xx, timeout, garbage, stall, error event
    # Why each failed, one reason a request: the stall's silence is a read timeout too.
    assert _delta(gateway_failures(gateway.telemetry_dir), failures_before) == {
        "malformed_sse": 1, "upstream_5xx": 1, "read_timeout": 2, "bad_response": 1,
        "error_event": 1}
    # The gateway's TTFT of the malformed stream: its one valid content event.
    families = read_with_multiprocess_collector(gateway.telemetry_dir)
    assert families["ac_first_token_sent_seconds"]["samples"]


def test_an_interim_103_is_not_taken_for_the_answer(bad):
    upstream, gateway = bad
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                        headers={"x-bad": "early_hints"}, timeout=10)
    assert answer.status_code == 200 and "link" not in answer.headers
    assert answer.headers["content-type"] == "text/event-stream"
    assert answer.content == CONTENT_EVENT + b"data: [DONE]\n\n"


def test_an_unreachable_upstream_is_a_502_in_each_apis_shape(tmp_path):
    (tmp_path / "t").mkdir(mode=0o700)
    address = f"127.0.0.1:{free_port()}"
    gateway = GatewayServer(f"http://{address}", tmp_path / "t" / "g")
    try:
        wait_for(lambda: _answers(gateway.url), 60, "the gateway")
        chat = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
        assert chat.status_code == 502 and chat.json()["error"]["type"] == "server_error"
        assert chat.headers["x-ac-trace-id"]
        message = httpx.post(gateway.url + "/v1/messages", json=CHAT)
        assert message.status_code == 502 and message.json()["type"] == "error"
        too_big = httpx.post(gateway.url + "/v1/messages", content=b"x" * (9 << 20))
        assert too_big.status_code == 413
        assert too_big.json()["error"]["type"] == "request_too_large"
        assert httpx.get(gateway.url + "/v1/models").status_code == 502  # any path's counts
        # Four requests the upstream failed (the readiness probe's GET / too; the 413 was
        # the client's); the daemon exports the count with the gateway's labels.
        failed = lambda: {  # noqa: E731
            dict(labels)["reason"]: (value, dict(labels)["kind"], dict(labels)["upstream"])
            for (name, labels), value in read_as_daemon(tmp_path / "t").items()
            if name == "ac_gateway_upstream_failures_total" and value}
        wait_for(lambda: failed().get("unreachable", (0,))[0] >= 4, 10, "four failures")
        assert failed() == {"unreachable": (4.0, "gateway", address)}
    finally:
        gateway.stop()


@pytest.mark.slow  # the engine and gateway it needs take ~10 s to start
def test_traceparent_is_passed_or_added(stack):
    engine, gateway, _ = stack
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    given = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                       headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
    assert given.headers["x-ac-trace-id"] == trace
    assert int(given.headers["x-ac-gateway-ttft-ns"]) > 0
    added = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    assert re.fullmatch("[0-9a-f]{32}", added.headers["x-ac-trace-id"])
    assert added.headers.get_list("x-ac-trace-id") == [added.headers["x-ac-trace-id"]]


@pytest.mark.slow
def test_the_daemon_reads_the_gateway_like_an_engine(stack, start_daemon, tmp_path):
    engine, gateway, root = stack
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content":
                          "<task><step>```json\n{\"a\": [1, {\"b\": 2}]}\n```</step></task>"}]}
    (tmp_path / "body.json").write_text(json.dumps(body))
    expected = json.loads(run_cli("skeleton", str(tmp_path / "body.json"), "--json",
                                  check=True).stdout)
    assert expected["depth"] >= 5
    complexity = lambda: read_as_daemon(root).get(  # noqa: E731
        ("ac_skeleton_complexity_sum", frozenset({"engine": "g1", "model": "any",
                                                  "kind": "gateway",
                                                  "upstream": "e1"}.items())), 0.0)
    daemon = start_daemon(root, "--interval", "0.5")  # before the requests: it sees them come
    before = complexity()
    for _ in range(3):  # the third earns the skeleton its own label
        assert httpx.post(gateway.url + "/v1/chat/completions", json=body).status_code == 200
    wait_for(lambda: complexity() - before == 3 * expected["depth"], 5, "three skeletons")
    samples = read_as_daemon(root)
    assert samples[("ac_skeleton_requests_total", frozenset({
        "engine": "g1", "model": "any", "kind": "gateway", "upstream": "e1",
        "skeleton": expected["skeleton_id"]}.items()))] == 1.0
    assert samples[("ac_engine_up", frozenset({"engine": "g1", "model": "any",
                                               "kind": "gateway"}.items()))] == 1.0
    daemon.wait_cycles(2)
    out = run_cli("--daemon", daemon.url, "--metric", "inference_latency_ns", "--window",
                  "60s", "--labels", "kind=gateway", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    series = json.loads(out.stdout)["series"]
    assert [s["labels"]["engine"] for s in series] == ["g1"]
    assert series[0]["labels"]["upstream"] == "e1"


def _histogram(root, family: str) -> tuple[float, float]:
    """(sum, count) of the gateway g1's histogram, as the daemon reads it."""
    samples = read_as_daemon(root)
    pick = lambda sample: sum(v for (name, labels), v in samples.items()  # noqa: E731
                              if name == sample and ("engine", "g1") in labels)
    return pick(f"{family}_sum"), pick(f"{family}_count")


def _counted(root, count: float) -> bool:
    return _histogram(root, "ac_first_token_sent_seconds")[1] == count


@pytest.mark.slow
def test_gateway_ttft_agrees_with_a_bare_socket_clients(stack):
    """Request by request: the client's first content event (from its send to the recv
    that brought it) against the gateway's TTFT (from the request's arrival to that
    event handed to the socket). The aim is a median within 1 ms; the bound here is
    looser (a shared 2-core VM): 18:47 UTC on one, median 0.59 ms, p90 4.2 ms."""
    _, gateway, root = stack
    run_streams(gateway.url, 1, 2, max_tokens=4)  # warm
    gaps, itl = [], 0.0
    for _ in range(12):
        time.sleep(0.06)  # the writer's thread has written the last one
        ttft_before = _histogram(root, "ac_first_token_sent_seconds")
        itl_before = _histogram(root, "ac_inter_token_latency_seconds")[1]
        (result,) = run_streams(gateway.url, 1, 1, max_tokens=8)
        wait_for(partial(_counted, root, ttft_before[1] + 1), 5, "the request's TTFT")
        ttft = _histogram(root, "ac_first_token_sent_seconds")[0] - ttft_before[0]
        assert 0 < ttft < result["client_first_content_s"] + 0.001
        gaps.append(result["client_first_content_s"] - ttft)
        itl += _histogram(root, "ac_inter_token_latency_seconds")[1] - itl_before
    gaps.sort()
    assert gaps[len(gaps) // 2] < 0.005, gaps
    assert itl >= 12  # gaps between each stream's content events

@pytest.mark.slow
def test_a_full_upstream_pool_is_a_clear_503(bad, tmp_path):
    upstream, _ = bad
    (tmp_path / "t").mkdir(mode=0o700)
    gateway = GatewayServer(upstream.url, tmp_path / "t" / "g", "--max-connections", "1",
                            "--pool-timeout", "0.2")
    try:
        wait_for(lambda: _answers(gateway.url), 60, "the gateway")
        with httpx.Client(timeout=10) as first, httpx.Client(timeout=10) as second:
            held = threading.Thread(target=lambda: first.post(
                gateway.url + "/v1/messages", json=CHAT, headers={"x-bad": "slow"}))
            held.start()  # holds the one upstream connection for 3 s
            time.sleep(0.5)
            refused = second.post(gateway.url + "/v1/messages", json=CHAT,
                                  headers={"x-bad": "5xx"})
            held.join()
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "all 1 upstream connections are busy"
        wait_for(lambda: gateway_failures(gateway.telemetry_dir)["pool_full"] == 1, 10,
                 "the refusal counted as pool_full")
    finally:
        gateway.stop()
