"""The engine's HTTP API driven by the official `anthropic` and `openai` SDKs and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import random
import time

import anthropic
import httpx
import openai
import pytest

PROMPT = "<task>Summarise the incident.</task>\n- ttft up\n- kv hits down"


def _anthropic(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _openai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _wait_all_blocks_free(server, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health", timeout=5).json()
        if health["kv_blocks_free"] == health["kv_blocks"] and not health["requests_running"] \
                and not health["requests_waiting"]:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {health}")
        time.sleep(0.1)


def test_anthropic_sdk_create_stream_and_count_tokens_agree(engine_server):
    client = _anthropic(engine_server)
    # This SDK release no longer types sampling settings; the API still takes them.
    kwargs = dict(model="tiny", max_tokens=40, extra_body={"temperature": 0}, system="Be terse.",
                  messages=[{"role": "user", "content": PROMPT}])
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    raw = client.messages.with_raw_response.create(**kwargs,
                                                   extra_headers={"traceparent": traceparent})
    message = raw.parse()
    assert raw.headers["x-ac-trace-id"] == "0af7651916cd43dd8448eb211c80319c"
    assert raw.headers["request-id"].startswith("req_")
    assert int(raw.headers["x-ac-model-latency-ns"]) > 0
    detail = json.loads(raw.headers["x-ac-trace-detail"])
    assert detail["stream"] == "throughput" and detail["skeleton_depth"] >= 2
    assert message.role == "assistant" and message.type == "message"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text == final.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens
    # The second identical prompt is served from the prefix cache.
    assert final.usage.cache_read_input_tokens > 0
    count = client.messages.count_tokens(model="tiny", system="Be terse.",
                                         messages=[{"role": "user", "content": PROMPT}])
    assert count.input_tokens == message.usage.input_tokens


def test_anthropic_stream_event_sequence_and_final_trace(engine_server):
    events = []
    with httpx.stream("POST", engine_server.url + "/v1/messages", json={
            "model": "tiny", "max_tokens": 12, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-ac-stream": "low_latency"}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert json.loads(response.headers["x-ac-trace-detail"])["stream"] == "low_latency"
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: ") and events[-1] == "message_delta":
                delta = json.loads(line[6:])
    names = [e for e in events if e not in ("ping", "content_block_delta")]
    assert names == ["message_start", "content_block_start", "content_block_stop",
                     "message_delta", "message_stop"]
    trace = delta["metadata"]["ac_trace"]
    assert 0 < trace["queue_time_ns"] <= trace["model_latency_ns"] <= trace["e2e_ns"]
    assert delta["usage"]["output_tokens"] == 12 or delta["delta"]["stop_reason"] == "end_turn"


@pytest.mark.slow
def test_stop_sequence_is_reported_and_cut(engine_server):
    client = _anthropic(engine_server)
    # The random model writes mostly bytes that are not text: take the first prompt whose
    # greedy answer holds a printable pair of characters past its start to stop on.
    for prompt in ("abc", "hello", "<q>1</q>", "<a><b>x</b></a>", "# Title", "{\"k\": 1}"):
        base = client.messages.create(model="tiny", max_tokens=30,
                                      extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": prompt}])
        text = base.content[0].text
        stop = next((text[i:i + 2] for i in range(3, len(text) - 2)
                     if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip()), None)
        if stop is not None:
            break
    assert stop is not None, "no prompt gave a printable answer to stop on"
    cut = client.messages.create(model="tiny", max_tokens=30, extra_body={"temperature": 0},
                                 stop_sequences=[stop],
                                 messages=[{"role": "user", "content": prompt}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_openai_sdk_stream_and_non_stream_agree(engine_server):
    client = _openai(engine_server)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PROMPT}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                                          temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


BAD_REQUESTS = [
    # (body or raw bytes, expected status, words the message must contain)
    (b"{not json", 400, "malformed JSON"),
    ({"model": "tiny", "max_tokens": "8", "messages": [{"role": "user", "content": "x"}]},
     400, "max_tokens"),
    ({"model": "tiny", "max_tokens": 8, "messages": []}, 400, "messages"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ({"model": "tiny", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
     400, "max_tokens"),
    ({"model": "tiny", "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]},
     400, "max_tokens"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 3000}]},
     400, "context"),
    ({"model": "tiny", "max_tokens": 8, "temperature": 3,
      "messages": [{"role": "user", "content": "x"}]}, 400, "temperature"),
    ({"model": "tiny", "max_tokens": 8,
      "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "image"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    (b'{"model": "tiny", "max_tokens": 8, "temperature": NaN, '
     b'"messages": [{"role": "user", "content": "x"}]}', 400, "temperature: Input should be "
     "a finite number"),
]


def test_openai_route_names_the_field_and_the_content_type(engine_server):
    """Each refusal says what is wrong in terms the client can act on: the field (not
    `body`), a missing content, a body that is not sent as JSON."""
    url = engine_server.url + "/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    for extra, param, words in (({"presence_penalty": 1}, "presence_penalty",
                                 "presence_penalty: only 0.0 is supported"),
                                ({"logprobs": True}, "logprobs", "logprobs: only False"),
                                ({"messages": [{"role": "user"}]}, "messages.0",
                                 "messages.0: a user message needs its content")):
        body = {"model": "tiny", "max_tokens": 4, "messages": user, **extra}
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(words), error
    response = httpx.post(url, content=json.dumps({"model": "tiny", "max_tokens": 4,
                                                   "messages": user}).encode(),
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400
    assert "content-type: application/json" in response.json()["error"]["message"]
    # An assistant turn may come without content (OpenAI's rule).
    assert httpx.post(url, timeout=30, json={
        "model": "tiny", "max_tokens": 2, "messages": user + [
            {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]}
    ).status_code == 200


@pytest.mark.slow
def test_both_sdks_retrieve_the_served_model_and_only_it(engine_server, start_engine):
    assert _openai(engine_server).models.retrieve("tiny").id == "tiny"
    assert _anthropic(engine_server).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        _openai(engine_server).models.retrieve("gpt-4o")
    assert "serves 'tiny'" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:  # a slash, as HF names have
        _openai(engine_server).models.retrieve("org/other")
    assert "serves 'tiny'" in str(info.value)
    named = start_engine("--model-name", "Qwen/Qwen2.5-0.5B-Instruct")
    assert _openai(named).models.retrieve("Qwen/Qwen2.5-0.5B-Instruct").id == \
        "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("body,status,words", BAD_REQUESTS)
def test_bad_messages_requests_get_status_and_named_problem(engine_server, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(engine_server.url + "/v1/messages", content=content,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    assert response.headers["request-id"].startswith("req_")
    assert len(response.headers["x-ac-trace-id"]) == 32
    assert response.headers["x-ac-model-latency-ns"] == "0"
    assert response.headers["x-ac-trace-detail"] == "{}"


def test_bad_lane_header_and_openai_errors_use_their_shapes(engine_server):
    response = httpx.post(engine_server.url + "/v1/messages", headers={"x-ac-stream": "fast"},
                          json={"model": "tiny", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400 and "x-ac-stream" in response.json()["error"]["message"]
    response = httpx.post(engine_server.url + "/v1/chat/completions",
                          json={"model": "tiny", "n": 3,
                                "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="messages"):
        _openai(engine_server).chat.completions.create(model="tiny", messages=[])


def test_body_over_the_limit_is_413(engine_server):
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    response = httpx.post(engine_server.url + "/v1/messages", json=body, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert "limit" in response.json()["error"]["message"]


def test_unknown_route_is_404_in_anthropic_shape(engine_server):
    response = httpx.get(engine_server.url + "/v1/nothing")
    assert response.status_code == 404 and response.json()["type"] == "error"


@pytest.mark.slow
def test_request_that_can_never_fit_the_pool_is_a_400_no_sdk_retries(start_engine):
    """The pool's size makes it permanent: a 400 naming max_tokens, which the SDKs do not
    retry (they retry a 529 twice, with backoff, for a request that can never succeed)."""
    server = start_engine("--kv-blocks", "16", "--max-model-len", "2048")
    messages = [{"role": "user", "content": "y" * 200}]
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
            model="tiny", max_tokens=200, messages=messages)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    assert "256" in info.value.body["error"]["message"]  # what the pool holds
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    for sent, param, words in (({"max_tokens": 200}, "max_tokens", "max_tokens:"),
                               ({"max_completion_tokens": 200}, "max_completion_tokens",
                                "max_completion_tokens:"),
                               ({}, "max_tokens", "max_tokens (256 when not given):")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=messages, **sent)
        assert info.value.body["param"] == param, sent  # what the request set
        assert info.value.body["message"].startswith(words), info.value.body
        assert info.value.body["type"] == "invalid_request_error"


@pytest.mark.slow
def test_64_streaming_clients_disconnecting_free_every_block_and_overflow_gets_429(
        start_engine):
    server = start_engine("--max-waiting", "24", "--kv-blocks", "1024",
                          "--throughput-seqs", "8")
    rng = random.Random(7)
    statuses: list[int] = []

    async def client(i: int) -> None:
        # Long generations: only aborting on disconnect frees their blocks in time.
        body = {"model": "tiny", "max_tokens": 2000, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"client {i} " * rng.randint(1, 20)}]}
        stop_after = rng.randint(0, 30)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/messages", json=body) as response:
                statuses.append(response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    assert response.status_code == 429, response.text
                    assert response.headers["retry-after"] == "1"
                    return
                seen = 0
                async for _ in response.aiter_lines():
                    seen += 1
                    if seen >= stop_after:
                        break  # hang up mid-stream

    async def main():
        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(64))), timeout=240)

    asyncio.run(main())
    assert len(statuses) == 64
    assert 429 in statuses and 200 in statuses
    health = _wait_all_blocks_free(server, timeout=15)
    assert health["status"] == "ok"
    from support.telemetry import family_value as _value
    from support.telemetry import read_with_multiprocess_collector as _read_in_other_process
    families = _read_in_other_process(server.telemetry_dir)
    assert _value(families, "ac_requests", "ac_requests_total", status="aborted") == \
        statuses.count(200)
    assert _value(families, "ac_requests", "ac_requests_total", status="rejected") == \
        statuses.count(429)
    # Still serving after all that.
    assert _anthropic(server).messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "ok?"}]).id


@pytest.mark.slow
def test_a_non_streaming_client_that_gives_up_aborts_its_request(start_engine):
    """Both APIs: a client that stops waiting for a long non-streaming answer has its
    request aborted (blocks freed, counted aborted, never ok) while tokens still flow,
    not left to generate to the end for nobody."""
    from support.telemetry import family_value as _value
    from support.telemetry import read_with_multiprocess_collector as _read_in_other_process
    server = start_engine()
    for route in ("/v1/messages", "/v1/chat/completions"):
        body = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"a long answer {route}"}]}
        with pytest.raises(httpx.ReadTimeout):  # ~3 s of decoding at the fastest
            httpx.post(server.url + route, json=body, timeout=1.0)
        # (a request left to run would end as ok, which the counts below refuse)
        _wait_all_blocks_free(server)
    families = _read_in_other_process(server.telemetry_dir)
    assert _value(families, "ac_requests", "ac_requests_total", status="aborted") == 2
    assert _value(families, "ac_requests", "ac_requests_total", status="ok") == 0


@pytest.mark.slow
def test_trace_header_ttft_is_the_one_in_telemetry(start_engine):
    from support.telemetry import family_value as _value
    from support.telemetry import read_with_multiprocess_collector as _read_in_other_process
    server = start_engine()
    raw = _anthropic(server).messages.with_raw_response.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": "trace me"}],
        extra_headers={"x-ac-stream": "low_latency"})
    ttft_seconds = int(raw.headers["x-ac-model-latency-ns"]) / 1e9
    queue_seconds = int(raw.headers["x-ac-queue-time-ns"]) / 1e9
    families = _read_in_other_process(server.telemetry_dir)
    assert _value(families, "ac_inference_latency_seconds", "ac_inference_latency_seconds_count",
                  stream="low_latency") == 1
    assert abs(_value(families, "ac_inference_latency_seconds",
                      "ac_inference_latency_seconds_sum", stream="low_latency")
               - ttft_seconds) < 1e-6
    assert abs(_value(families, "ac_queue_time_seconds", "ac_queue_time_seconds_sum",
                      stream="low_latency") - queue_seconds) < 1e-6


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(engine_server, tmp_path):
    import re
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", engine_server.url + "/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "30", "--phases",
         "coverage,fuzzing", "--workers", "2", "--suppress-health-check", "all",
         "--request-timeout", "60", "--seed", "1", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = out.stdout + out.stderr
    # Judged on the server's answers: schemathesis' own generator can trip on a schema
    # ("Runtime Error"), which says nothing about the API.
    assert "Server error" not in report and "ST101" not in report, report[-4000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 100, report[-2000:]
    assert engine_server.proc.poll() is None


@pytest.mark.slow
def test_health_is_unhealthy_until_the_model_is_ready(tmp_path):
    import threading

    from ac_observe.engine.config import EngineConfig
    from ac_observe.engine.server import EngineService
    from support.servers import serve_in_thread

    gate = threading.Event()

    class GatedService(EngineService):
        async def load(self):
            await asyncio.to_thread(gate.wait)
            await super().load()

    url, stop = serve_in_thread(GatedService(EngineConfig(telemetry_dir=str(tmp_path))))
    try:
        response = httpx.get(url + "/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        early = httpx.post(url + "/v1/messages", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(url + "/health").json()["kv_blocks"] > 0
    finally:
        stop()

    url, stop = serve_in_thread(EngineService(EngineConfig(model=str(tmp_path / "missing"))))
    try:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        failed = httpx.get(url + "/health")
        assert failed.status_code == 503 and "config.json" in failed.json()["error"]
    finally:
        stop()


def _ready_service(tmp_path):
    from ac_observe.engine.config import EngineConfig
    from ac_observe.engine.server import EngineService
    from support.servers import serve_in_thread

    service = EngineService(EngineConfig(telemetry_dir=str(tmp_path)))
    url, stop = serve_in_thread(service)
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return service, url, stop


@pytest.mark.slow
def test_a_failing_model_step_is_a_500_without_internals_and_the_server_lives_on(tmp_path):
    service, url, stop = _ready_service(tmp_path)
    try:
        runner = service.engine.runner
        real_launch = runner.launch

        def broken(batch):
            raise RuntimeError("CUDA error: device-side assert triggered at /secret/path.cu:42")

        runner.launch = broken
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        response = httpx.post(url + "/v1/messages", json=body, timeout=30)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "api_error"
        assert "secret" not in response.text and "Traceback" not in response.text
        with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True},
                          timeout=30) as stream:
            text = "".join(stream.iter_text())
        assert "event: error" in text and "api_error" in text and "secret" not in text
        runner.launch = real_launch
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/messages", json=body, timeout=30).status_code == 200
        assert service.engine.load_summary()["kv_blocks_free"] == \
            service.engine.load_summary()["kv_blocks"]
    finally:
        stop()


@pytest.mark.slow
def test_seed_out_of_range_is_a_400_and_a_failing_sampler_fails_only_its_request(tmp_path):
    import threading

    from ac_observe.engine import sampler

    service, url, stop = _ready_service(tmp_path)
    chat = url + "/v1/chat/completions"
    body = {"model": "tiny", "max_tokens": 6,
            "messages": [{"role": "user", "content": "hello there"}]}
    try:
        for seed in (2 ** 64, 2 ** 63, -(2 ** 63) - 1):
            response = httpx.post(chat, json={**body, "seed": seed})
            assert response.status_code == 400, seed
            assert response.json()["error"]["param"] == "seed"
        assert httpx.post(chat, json={**body, "seed": 2 ** 63 - 1}).status_code == 200

        real_generator = sampler.torch.Generator

        class Refusing:  # the generator of one request breaks inside the step
            def __init__(self, device=None):
                self.inner = real_generator(device=device)

            def manual_seed(self, seed):
                if seed == 13:
                    raise RuntimeError("injected sampling failure")
                return self.inner.manual_seed(seed)

        engine = service.engine
        # Hold the engine inside a step while the burst queues, so that one prefill step
        # admits all nine together.
        real_launch, inside, release = engine.runner.launch, threading.Event(), threading.Event()

        def held(batch):
            inside.set()
            release.wait(30)
            engine.runner.launch = real_launch
            return real_launch(batch)

        engine.runner.launch = held
        sampler.torch.Generator = Refusing
        try:
            async def burst():
                async with httpx.AsyncClient(timeout=60) as client:
                    blocker = asyncio.create_task(client.post(chat, json=body))
                    await asyncio.to_thread(inside.wait, 30)
                    bodies = [{**body, "seed": 13, "temperature": 1.0}] + [
                        {**body, "temperature": t, "messages": [
                            {"role": "user", "content": f"mate {i}"}]}
                        for i, t in enumerate([0.0, 1.0] * 4)]
                    answers = [asyncio.create_task(client.post(chat, json=b)) for b in bodies]
                    while engine.load_summary()["requests_waiting"] < len(bodies):
                        await asyncio.sleep(0.02)
                    release.set()
                    return [await blocker] + [await answer for answer in answers]

            statuses = [r.status_code for r in asyncio.run(burst())]
        finally:
            sampler.torch.Generator = real_generator
            release.set()
        assert statuses == [200, 500] + [200] * 8
        assert engine.load_summary()["kv_blocks_free"] == engine.load_summary()["kv_blocks"]
    finally:
        stop()


@pytest.mark.slow
def test_the_engine_server_moves_its_start_up_heap_out_of_the_collectors_sight():
    """Once loaded, what start-up made (the model, the tokenizer) is frozen out of the
    cyclic collector's sight, as vLLM does: a full collection that walked it all paused
    engine steps for 80-150 ms (row 6 of bench/run.py at 8 clients)."""
    import gc

    from ac_observe.engine.config import EngineConfig
    from ac_observe.engine.server import EngineService
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    service = EngineService(EngineConfig(seed=0))
    try:
        asyncio.run(service.load())
        assert service.engine is not None
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
        service.close()


@pytest.mark.parametrize("header, trace_id", [
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
     "0af7651916cd43dd8448eb211c80319c"),
    ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later-fields",
     "0af7651916cd43dd8448eb211c80319c"),  # a later version may carry more
    ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),  # zero trace id
    ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", None),  # zero parent id
    ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),  # version ff
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", None),  # 00 has 4 fields
    ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", None),  # upper case
    ("00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01", None),  # short
])
def test_traceparent_is_followed_only_when_valid(header, trace_id):
    """W3C Trace Context: an invalid traceparent is ignored (the response gets a trace id
    of its own), never echoed back as if it named a trace."""
    from ac_observe.engine.http_middleware import traceparent_trace_id
    assert traceparent_trace_id(header) == trace_id


def test_legacy_completions_and_continuous_usage_as_benchmark_clients_send_them(
        engine_server):
    """`POST /v1/completions` through the official SDK, whole and streamed; guidellm's
    `continuous_usage_stats` (usage so far on every chunk, counts that only grow) and
    `vllm bench serve`'s neutral extras honoured; another value refused, naming the field
    and the client that sends it."""
    client = _openai(engine_server)
    whole = client.completions.create(model="tiny", prompt="abc", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 5
    assert whole.usage.prompt_tokens == 3  # no chat template: the prompt's own bytes
    chunks = list(client.completions.create(
        model="tiny", prompt=[[97, 98, 99]], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "min_p": 0.0}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and chunks[-1].usage.completion_tokens == 5
    body = {"model": "tiny", "max_completion_tokens": 6, "ignore_eos": True, "stop": None,
            "stream": True, "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [json.loads(line[6:]) for line in httpx.post(
        engine_server.url + "/v1/chat/completions", json=body, timeout=60).text.splitlines()
        if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all("usage" in e for e in events) and counts == sorted(counts) and counts[-1] == 6
    assert events[-1]["usage"]["ac_trace"]["first_sent_ns"] >= \
        events[-1]["usage"]["ac_trace"]["first_text_ns"] > 0
    refused = httpx.post(engine_server.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "x", "repetition_penalty": 1.2})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "repetition_penalty" and "vllm bench serve" in error["message"]
    two = httpx.post(engine_server.url + "/v1/completions", timeout=30,
                     json={"model": "tiny", "prompt": ["a", "b"]})
    assert two.status_code == 400 and "one prompt" in two.json()["error"]["message"]


def test_a_completions_prompt_the_engine_refuses_is_named_as_the_prompt(engine_server):
    """Token ids outside the vocabulary, or a prompt longer than the context: a 400 that
    names `prompt`, the field the client sent (not chat's `messages`)."""
    for prompt in ([10 ** 9], "a" * 100_000):
        refused = httpx.post(engine_server.url + "/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": prompt})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "prompt" and error["message"].startswith("prompt"), error
