"""The engine's HTTP API: Anthropic Messages and OpenAI Chat Completions over FastAPI.

The event loop never touches tensors: requests are tokenized in a worker thread, the
engine thread runs every step, and outputs come back through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import ipaddress
import json
import logging
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ac_observe import __version__
from ac_observe.auth import bearer_token
from ac_observe.engine import api_format as fmt
from ac_observe.engine.api_models import (
    FIELD_SENDERS,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
)
from ac_observe.engine.api_wire import error_body
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.http_middleware import BodyLimitAndIdsMiddleware
from ac_observe.engine.kernel_sampler import prime_profiler
from ac_observe.engine.llm_engine import (
    Engine,
    FinishReason,
    NeverFitsError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from ac_observe.engine.streaming import FirstSent, WholeResponse, sample_loop_lag, sse_response
from ac_observe.metrics import DEFAULT_LANE, LANE_HEADER, LANES

log = logging.getLogger("ac_observe.engine.api")
DISCONNECT_POLL_SECONDS = 0.5
OPENAI_DEFAULT_MAX_TOKENS = 256  # a chat completion that sets no output budget
# The engine thread's Python (scheduling, postprocess) holds the GIL for up to the switch
# interval (5 ms by default) while the event loop waits to write a ready first token.
GIL_SWITCH_SECONDS = 0.001


async def _get(queue: asyncio.Queue, seconds: float):
    """queue.get() with a deadline: asyncio.TimeoutError when it passes."""
    if hasattr(asyncio, "timeout"):  # 3.11+: a deadline on this task, no task per wait
        async with asyncio.timeout(seconds):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), seconds)  # pragma: no cover - 3.10


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


class EngineService:
    """Owns the engine for the app: loads it in the background so /health can say 'loading'."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: Engine | None = None
        self.load_error: str | None = None
        if config.kernel_sampling_steps:
            prime_profiler()  # here, on the main thread: the engine loads on a worker

    async def load(self) -> None:
        try:
            self.engine = await asyncio.to_thread(Engine, self.config)
        except Exception as exc:  # reported by /health; the process stays up to say why
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("engine failed to load: %s", self.load_error)
            return
        freeze_heap()

    def ready(self) -> Engine:
        if self.engine is None:
            raise APIError(503, "the engine is still loading" if self.load_error is None
                           else f"the engine failed to load: {self.load_error}")
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def freeze_heap() -> None:
    """What start-up made (the model, tokenizer, app) lives as long as the process: move
    it out of the cyclic collector's sight, as vLLM does after loading. Left in, every
    full collection walked it all: 80-150 ms pauses inside engine steps, a low_latency
    request's TTFT 3-7x its usual p99 (bench/latency_isolation.py at 8 clients)."""
    gc.collect()
    gc.freeze()


def create_app(service: EngineService, max_body_bytes: int = 8 << 20) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        task = asyncio.create_task(service.load())
        lag = asyncio.create_task(sample_loop_lag(
            lambda: service.engine.stats if service.engine is not None else None))
        yield
        task.cancel()
        lag.cancel()
        await asyncio.to_thread(service.close)

    app = FastAPI(title="ac-observe engine", version=__version__, lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimitAndIdsMiddleware, max_body_bytes=max_body_bytes,
                       error_body=_error_body)
    _install_error_handlers(app)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    return app


# ----- endpoints ---------------------------------------------------------------------------

def _service(request: Request) -> EngineService:
    return request.app.state.service


async def health(request: Request):
    service = _service(request)
    engine = service.engine
    if engine is None or not engine.is_alive():
        status = "failed" if service.load_error or engine is not None else "loading"
        body = {"status": status}
        if service.load_error:
            body["error"] = service.load_error
        return JSONResponse(body, status_code=503)
    return {"status": "ok", "model": engine.model_name, "engine": engine.config.engine_name,
            **engine.load_summary()}


def _model_item(name: str) -> dict:
    """The served model as both APIs describe one."""
    return {"type": "model", "id": name, "display_name": name,
            "created_at": "1970-01-01T00:00:00Z", "object": "model", "created": 0,
            "owned_by": "ac-observe"}


async def models(request: Request):
    name = _service(request).ready().model_name
    return {"object": "list", "data": [_model_item(name)], "has_more": False,
            "first_id": name, "last_id": name}


async def model(model_id: str, request: Request):
    """GET /v1/models/{id}: the SDKs' `models.retrieve`."""
    name = _service(request).ready().model_name
    if model_id != name:
        raise APIError(404, f"model {model_id[:100]!r} is not served here; this engine "
                            f"serves {name!r}")
    return _model_item(name)


async def count_tokens(body: CountTokensRequest, request: Request):
    engine = _service(request).ready()
    messages = [m.model_dump() for m in body.messages]
    count = await asyncio.to_thread(engine.count_tokens, messages=messages,
                                    system=_system(body.system))
    return {"input_tokens": count}


async def messages(body: MessagesRequest, request: Request):
    """Anthropic Messages: one JSON message, or its SSE event sequence."""
    engine = _service(request).ready()
    _check_max_tokens(engine, body.max_tokens, "max_tokens")
    params = _sampling(body, body.max_tokens, tuple(body.stop_sequences or ()))
    request_id = request.state.request_id
    queue = await _submit(engine, request, params, request_id,
                          messages=[m.model_dump() for m in body.messages],
                          system=_system(body.system))
    first = await _next_output(queue, request, engine, request_id)
    message_id = "msg_" + request_id.removeprefix("req_")
    if not body.stream:
        return await _complete(first, queue, request, engine, request_id,
                               lambda out: fmt.anthropic_message(message_id, body.model, out))

    sent = _first_sent(request, engine, first)

    async def events():
        try:
            # The first token's text goes out with the head, in one write on the handler's
            # own task (EventStreamResponse).
            sent.arm(first)
            yield fmt.anthropic_stream_start(message_id, body.model, first) + \
                (fmt.anthropic_text_delta(first.new_text) if first.new_text else "")
            out = first
            async for out in _after(first, queue):
                if out.new_text:
                    sent.arm(out)
                    yield fmt.anthropic_text_delta(out.new_text)
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED):
                yield fmt.anthropic_stream_error(500, _failure_message(out))
            else:
                yield fmt.anthropic_stream_end(out, sent.sent_ns)
        finally:
            engine.abort(request_id)  # a client that went away frees its blocks now

    return sse_response(events(), first, sent)


async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI Chat Completions: one completion object, or its chunk stream."""
    engine = _service(request).ready()
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        _check_max_tokens(engine, max_tokens, "max_completion_tokens"
                          if body.max_completion_tokens else "max_tokens")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = _sampling(body, max_tokens or OPENAI_DEFAULT_MAX_TOKENS, stops, seed=body.seed)
    request_id = request.state.request_id
    messages = [{"role": m.role, "content": m.model_dump()["content"] or ""}
                for m in body.messages]
    field = ("max_completion_tokens" if body.max_completion_tokens else "max_tokens" if
             body.max_tokens else f"max_tokens ({OPENAI_DEFAULT_MAX_TOKENS} when not given)")
    queue = await _submit(engine, request, params, request_id, tokens_field=field,
                          messages=messages)
    first = await _next_output(queue, request, engine, request_id)
    completion_id = "chatcmpl-" + request_id.removeprefix("req_")
    if not body.stream:
        return await _complete(first, queue, request, engine, request_id,
                               lambda out: fmt.openai_completion(completion_id, body.model, out))
    return _openai_stream(engine, request, body, first, queue, completion_id,
                          fmt.openai_chat_chunk)


async def completions(body: CompletionRequest, request: Request):
    """OpenAI's legacy Completions: one prompt (text or token ids) without a chat template;
    one text_completion object, or its chunk stream."""
    engine = _service(request).ready()
    max_tokens = body.max_tokens or 16
    _check_max_tokens(engine, max_tokens, "max_tokens")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = _sampling(body, max_tokens, stops, seed=body.seed)
    request_id = request.state.request_id
    queue = await _submit(engine, request, params, request_id, prompt_field="prompt",
                          prompt=body.prompt)
    first = await _next_output(queue, request, engine, request_id)
    completion_id = "cmpl-" + request_id.removeprefix("req_")
    if not body.stream:
        return await _complete(
            first, queue, request, engine, request_id,
            lambda out: fmt.openai_text_completion(completion_id, body.model, out))
    return _openai_stream(engine, request, body, first, queue, completion_id,
                          fmt.openai_text_chunk)


def _openai_stream(engine: Engine, request: Request, body, first: RequestOutput, queue,
                   completion_id: str, chunk):
    """Either OpenAI route's chunk stream. `chunk(id, model, created, text, finish, usage)`
    renders one event: `text` None opens the stream (chat's role chunk), "" closes it
    with its finish reason. With `stream_options.include_usage` a last chunk carries the
    usage and the trace; with `continuous_usage_stats` as well, every chunk carries the
    usage so far (vLLM's extension, which guidellm asks for)."""
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    running = include_usage and options.continuous_usage_stats
    created, model, request_id = int(time.time()), body.model, request.state.request_id
    sent = _first_sent(request, engine, first)

    def event(out: RequestOutput, text: str | None, finish: str | None = None) -> str:
        return chunk(completion_id, model, created, text, finish,
                     fmt.openai_usage(out, details=False) if running else None)

    async def chunks():
        try:
            sent.arm(first)
            opening = event(first, None)
            yield opening + event(first, first.new_text) if first.new_text else opening
            out = first
            async for out in _after(first, queue):
                if out.new_text:
                    sent.arm(out)
                    yield event(out, out.new_text)
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED):
                yield "data: " + json.dumps(fmt.openai_error(500, _failure_message(out))) \
                    + "\n\n"
                return
            yield event(out, "", fmt.OPENAI_STOP.get(out.finish_reason))
            if include_usage:
                usage = fmt.openai_usage(out)
                usage["ac_trace"] = fmt.trace_metadata(out.trace, sent.sent_ns)
                yield chunk(completion_id, model, created, None, None, usage, last=True)
            yield "data: [DONE]\n\n"
        finally:
            engine.abort(request_id)

    return sse_response(chunks(), first, sent)


def _first_sent(request: Request, engine: Engine, first: RequestOutput) -> FirstSent:
    lane = first.trace.stream if first.trace else _lane(request)
    return FirstSent(request.state.arrival_ns, lane, engine.stats)


# The fault route's knobs: (the most it takes, the engine's attribute, its scale to ms).
FAULTS = {"step_delay_ms": (10_000, "step_delay_seconds", 1e3),
          "prefix_miss_ratio": (1, "forced_miss_ratio", 1.0),
          "prefix_flush_ms": (60_000, "prefix_flush_seconds", 1e3)}


def _fault_owner(engine: Engine, name: str):
    return engine.block_manager if name == "prefix_miss_ratio" else engine


async def faults(request: Request):
    """Fault injection: GET the current faults, POST {"step_delay_ms": 0..10000,
    "prefix_miss_ratio": 0..1, "prefix_flush_ms": 0..60000} to change them (any of them;
    prefix_flush_ms: the prefix cache flushed at least this often, 0 never). Only with
    --fault-injection, only from this host, and only with the fault token (a port
    forwarded over ssh or kubectl arrives from loopback too)."""
    service = _service(request)
    if not service.config.fault_injection:
        raise APIError(404, "fault injection is off (start the engine with --fault-injection)")
    if not _loopback(request.client.host if request.client else ""):
        raise APIError(403, "fault injection is accepted from this host only")
    expected = (service.config.fault_token or "").encode()
    given = bearer_token(request.headers.get("authorization"))
    if not expected or given is None or not hmac.compare_digest(given, expected):
        raise APIError(401, "fault injection needs the engine's fault token as "
                            "`Authorization: Bearer <token>`",
                       headers={"www-authenticate": 'Bearer realm="ac-observe faults"'})
    engine = service.ready()
    if request.method == "POST":
        # JSON only: a web page cannot send that cross-site without a preflight.
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise APIError(415, "send the faults as application/json")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(body, dict) or set(body) - set(FAULTS):
            raise APIError(400, "expected an object with any of " + ", ".join(FAULTS))
        for name, value in body.items():
            most = FAULTS[name][0]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 <= value <= most:
                raise APIError(400, f"{name} must be a number in [0, {most}]")
        for name, value in body.items():
            _, attribute, scale = FAULTS[name]
            setattr(_fault_owner(engine, name), attribute, float(value) / scale)
        log.warning("fault injection: step delay %.1f ms, forced prefix misses %.0f %%, "
                    "prefix cache flushed every %.0f ms (0: never)",
                    1e3 * engine.step_delay_seconds,
                    100 * engine.block_manager.forced_miss_ratio,
                    1e3 * engine.prefix_flush_seconds)
    return {name: getattr(_fault_owner(engine, name), attribute) * scale
            for name, (_, attribute, scale) in FAULTS.items()}


def _loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack bind
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


ROUTES = (
    ("GET", "/health", health),
    ("GET", "/admin/faults", faults),
    ("POST", "/admin/faults", faults),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model_id:path}", model),  # HF names hold a slash
    ("POST", "/v1/messages/count_tokens", count_tokens),
    ("POST", "/v1/messages", messages),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
)


# ----- request plumbing -------------------------------------------------------------------

def _system(system):
    if system is None or isinstance(system, str):
        return system
    return [block.model_dump() for block in system]


def _sampling(body, max_tokens: int, stops: tuple[str, ...], seed: int | None = None):
    """SamplingParams of either API's body (the same fields mean the same on both)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0, top_k=body.top_k or 0, seed=seed, stop=stops,
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()))
    except ValueError as exc:  # settings that contradict each other
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, f"{field}: {exc}", param=field) from None


def _lane(request: Request) -> str:
    lane = request.headers.get(LANE_HEADER, DEFAULT_LANE).strip().lower()
    if lane not in LANES:
        raise APIError(400, f"header {LANE_HEADER}: must be low_latency or throughput, "
                            f"got {lane[:40]!r}", param=LANE_HEADER)
    return lane


def _check_max_tokens(engine: Engine, max_tokens: int, field: str) -> None:
    if max_tokens > engine.max_model_len:
        raise APIError(400, f"{field}: {max_tokens} exceeds the model's limit of "
                            f"{engine.max_model_len} tokens", param=field)


async def _submit(engine: Engine, request: Request, params: SamplingParams, request_id: str,
                  tokens_field: str = "max_tokens", prompt_field: str = "messages",
                  **prompt) -> asyncio.Queue:
    """Hand the request to the engine; `tokens_field` and `prompt_field`: the request's
    names for its output budget and its prompt, for a refusal to name."""
    lane = _lane(request)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def on_output(out: RequestOutput) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, out)

    try:
        await asyncio.to_thread(engine.add_request, params=params, lane=lane,
                                request_id=request_id, arrival_ns=request.state.arrival_ns,
                                on_output=on_output, **prompt)
    except QueueFullError as exc:
        raise APIError(429, f"{exc}; retry shortly", headers={"retry-after": "1"}) from None
    except NeverFitsError as exc:
        # Permanent for this engine (its pool's size), so a 4xx: the SDKs retry a 529.
        param = tokens_field.split()[0]
        raise APIError(400, f"{tokens_field}: {exc}; lower {param} or shorten the prompt",
                       param=param) from None
    except ValueError as exc:
        raise APIError(400, f"{prompt_field}: {exc}", param=prompt_field) from None
    return queue


async def _abort_if_gone(request: Request, engine: Engine, request_id: str) -> None:
    """Abort the request (its blocks freed, counted aborted) if its client hung up."""
    if await request.is_disconnected():
        engine.abort(request_id)
        raise APIError(499, "client closed the request")


async def _next_output(queue: asyncio.Queue, request: Request, engine: Engine,
                       request_id: str) -> RequestOutput:
    """The next output; aborts the request if the client hangs up while it waits."""
    while True:
        try:
            return await _get(queue, DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            await _abort_if_gone(request, engine, request_id)
        except asyncio.CancelledError:
            engine.abort(request_id)
            raise


async def _after(first: RequestOutput, queue: asyncio.Queue):
    """A stream's outputs after the first one, to the finished one."""
    out = first
    while not out.finished:
        out = await queue.get()
        yield out


async def _collect(first: RequestOutput, queue, request, engine, request_id) -> RequestOutput:
    """A non-streaming request's outputs, merged. Its client is looked at every
    DISCONNECT_POLL_SECONDS while tokens flow too (outputs arrive every few ms, so the
    idle poll of `_next_output` alone would never see a client that gave up)."""
    outputs = [first]
    loop = asyncio.get_running_loop()
    look_at = loop.time() + DISCONNECT_POLL_SECONDS
    while not outputs[-1].finished:
        outputs.append(await _next_output(queue, request, engine, request_id))
        if not outputs[-1].finished and loop.time() >= look_at:
            await _abort_if_gone(request, engine, request_id)
            look_at = loop.time() + DISCONNECT_POLL_SECONDS
    last = outputs[-1]
    last.new_text = "".join(out.new_text for out in outputs)
    last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
    return last


async def _complete(first, queue, request, engine, request_id, render) -> WholeResponse:
    """A non-streaming answer: wait for the finish, then one body with the trace headers."""
    out = await _collect(first, queue, request, engine, request_id)
    _raise_if_failed(out)
    return WholeResponse(render(out), out.trace, request.state.arrival_ns)


def _failure_message(out: RequestOutput) -> str:
    if out.finish_reason is FinishReason.ABORTED:
        return "the request was aborted (the engine is shutting down)"
    return "the engine failed while generating this request"


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason is FinishReason.ERROR:
        raise APIError(500, _failure_message(out))
    if out.finish_reason is FinishReason.ABORTED:
        raise APIError(503, _failure_message(out))


# ----- errors -----------------------------------------------------------------------------

def _error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    return error_body(path, status, message, param)


def _validation_message(exc: RequestValidationError,
                        content_type: str = "application/json") -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid JSON')}", None
    if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type.lower():
        return (f"the body must be a JSON object sent with content-type: application/json "
                f"(got {content_type[:60] or 'none'})"), None
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":  # never accepted and then ignored
            msg = "not supported by this engine"
        sender = FIELD_SENDERS.get(loc[0] if loc else "")
        parts.append(f"{field}: {msg.removeprefix('Value error, ')}"
                     + (f" (sent by {sender})" if sender else ""))
    return "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return JSONResponse(_error_body(request.url.path, 400, message, param), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(_error_body(request.url.path, exc.status, exc.message, exc.param),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return JSONResponse(_error_body(request.url.path, exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled error in %s (request %s)", request.url.path,
                      getattr(request.state, "request_id", "?"))
        return JSONResponse(_error_body(request.url.path, 500, "internal server error"),
                            status_code=500)

