"""Wire formats: Anthropic message objects and SSE events, OpenAI chat objects and chunks,
both APIs' error bodies, and the ac-observe trace headers."""
from __future__ import annotations

import json
import time
import uuid

from ac_observe.engine.api_wire import (  # noqa: F401 - re-exported
    ANTHROPIC_ERROR_TYPES,
    anthropic_error,
    openai_error,
)
from ac_observe.engine.llm_engine import RequestOutput, TraceDetail
from ac_observe.engine.sequence import FinishReason

ANTHROPIC_STOP = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
                  FinishReason.STOP_SEQUENCE: "stop_sequence"}
OPENAI_STOP = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
               FinishReason.STOP_SEQUENCE: "stop"}


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


def trace_detail_json(trace: TraceDetail | None) -> dict:
    if trace is None:
        return {}
    return {"frontend_ms": round(trace.frontend_ns / 1e6, 3),
            "prefill_ms": round(trace.prefill_ms, 3), "decode_ms": round(trace.decode_ms, 3),
            "kv_hit_blocks": trace.kv_hit_blocks, "kv_query_blocks": trace.kv_query_blocks,
            "kv_miss_blocks": trace.kv_miss_blocks,
            "skeleton_depth": trace.skeleton_depth, "stream": trace.stream}


def trace_headers(trace: TraceDetail | None) -> dict[str, str]:
    """The trace headers of a generation response (zeros when nothing ran).

    x-ac-model-latency-ns: time to first token, from the request's arrival at the server
    (before its body was read, parsed and tokenized) to its first token being ready
    (`ac_inference_latency_seconds`, the seed's `inference_latency_ns`) = front-end
    (`frontend_ms` in the detail) + queue (x-ac-queue-time-ns: the engine's queue to first
    scheduled) + the steps until the first token. A non-streaming answer, sent at the end,
    also carries x-ac-first-text-ns (arrival to the first non-empty text).
    """
    return {
        "x-ac-model-latency-ns": str(trace.ttft_ns if trace else 0),
        "x-ac-queue-time-ns": str(trace.queue_ns if trace else 0),
        "x-ac-trace-detail": json.dumps(trace_detail_json(trace), separators=(",", ":")),
    }


def final_trace_headers(trace: TraceDetail | None) -> dict[str, str]:
    """Trace headers of an answer sent whole, once everything is known."""
    return {**trace_headers(trace),
            "x-ac-first-text-ns": str(trace.first_text_ns if trace else 0)}


def trace_metadata(trace: TraceDetail | None, first_sent_ns: int = 0) -> dict:
    """The same figures for the body of a stream's last event (headers left long before),
    with the delivery stamp: arrival to the first text's bytes handed to the socket."""
    if trace is None:
        return {}
    return {"model_latency_ns": trace.ttft_ns, "queue_time_ns": trace.queue_ns,
            "first_text_ns": trace.first_text_ns, "first_sent_ns": first_sent_ns,
            "e2e_ns": trace.e2e_ns, **trace_detail_json(trace)}


def anthropic_usage(out: RequestOutput) -> dict:
    return {"input_tokens": out.num_prompt_tokens, "output_tokens": out.num_output_tokens,
            "cache_read_input_tokens": out.num_cached_tokens,
            "cache_creation_input_tokens": 0}


def anthropic_message(message_id: str, model: str, out: RequestOutput) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": out.new_text}],
            "stop_reason": ANTHROPIC_STOP.get(out.finish_reason),
            "stop_sequence": out.stop_sequence, "usage": anthropic_usage(out)}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def anthropic_stream_start(message_id: str, model: str, first: RequestOutput) -> str:
    usage = anthropic_usage(first)
    usage["output_tokens"] = 0
    message = {"id": message_id, "type": "message", "role": "assistant", "model": model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    return (sse("message_start", {"type": "message_start", "message": message})
            + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
            + sse("ping", {"type": "ping"}))


def anthropic_text_delta(text: str) -> str:
    return sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}})


def anthropic_stream_end(out: RequestOutput, first_sent_ns: int = 0) -> str:
    usage = anthropic_usage(out)
    return (sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + sse("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": ANTHROPIC_STOP.get(out.finish_reason),
                          "stop_sequence": out.stop_sequence},
                "usage": {"output_tokens": usage["output_tokens"],
                          "input_tokens": usage["input_tokens"],
                          "cache_read_input_tokens": usage["cache_read_input_tokens"]},
                "metadata": {"ac_trace": trace_metadata(out.trace, first_sent_ns)}})
            + sse("message_stop", {"type": "message_stop"}))


def anthropic_stream_error(status: int, message: str) -> str:
    return sse("error", anthropic_error(status, message))


def openai_usage(out: RequestOutput, details: bool = True) -> dict:
    """Usage as OpenAI words it; `details` off for the running counts of
    `continuous_usage_stats` (vLLM's: the three counts so far)."""
    usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
             "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return usage


def openai_completion(completion_id: str, model: str, out: RequestOutput) -> dict:
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.new_text},
                         "finish_reason": OPENAI_STOP.get(out.finish_reason), "logprobs": None}],
            "usage": openai_usage(out)}


def openai_chunk(completion_id: str, model: str, created: int, delta: dict | None,
                 finish_reason: str | None = None, usage: dict | None = None) -> str:
    body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [] if delta is None else [
                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def openai_text_completion(completion_id: str, model: str, out: RequestOutput) -> dict:
    """The legacy Completions API's answer (`POST /v1/completions`)."""
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": out.new_text, "logprobs": None,
                         "finish_reason": OPENAI_STOP.get(out.finish_reason)}],
            "usage": openai_usage(out)}


def openai_text_chunk(completion_id: str, model: str, created: int, text: str | None,
                      finish_reason: str | None = None, usage: dict | None = None,
                      last: bool = False) -> str:
    """One event of a streamed legacy completion (the opening, `text` None, is nothing:
    its first event carries text); `last`: the usage chunk, with no choices as OpenAI's."""
    if text is None and not last:
        return ""
    body = {"id": completion_id, "object": "text_completion", "created": created,
            "model": model,
            "choices": [] if last else [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def openai_chat_chunk(completion_id: str, model: str, created: int, text: str | None,
                      finish_reason: str | None = None, usage: dict | None = None,
                      last: bool = False) -> str:
    """One event of a streamed chat completion: `text` None opens it (the role), a finish
    reason closes it (empty delta), `last` is the usage chunk (no choices)."""
    if last:
        delta = None
    elif text is None:
        delta = {"role": "assistant", "content": ""}
    elif finish_reason is not None:
        delta = {}
    else:
        delta = {"content": text}
    return openai_chunk(completion_id, model, created, delta, finish_reason, usage)
