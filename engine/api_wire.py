"""The parts of the wire formats that need no engine: both APIs' error bodies and W3C
trace context. Torch-free: the gateway (ac_observe.gateway) answers with these too."""
from __future__ import annotations

import re

# HTTP status -> Anthropic error type
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         404: "not_found_error", 405: "invalid_request_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "api_error", 529: "overloaded_error"}

# W3C Trace Context: version ff, an all-zero trace id or parent id are invalid (the header
# is then ignored); version 00 has exactly four fields, a later version may add more.
_TRACEPARENT = re.compile(r"^(?!ff)([0-9a-f]{2})-(?!0{32})([0-9a-f]{32})-(?!0{16})[0-9a-f]{16}"
                          r"-[0-9a-f]{2}(-.*)?$")


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error",
            "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def openai_error(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_exceeded",
            529: "server_overloaded"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    """The error body in the shape of the API a path belongs to: OpenAI's under
    /v1/chat/ and /v1/completions, Anthropic's elsewhere (as the bundled engine answers)."""
    if path.startswith(("/v1/chat/", "/v1/completions")):
        return openai_error(status, message, param)
    return anthropic_error(status, message)


def traceparent_trace_id(header: str) -> str | None:
    """The trace id of a valid `traceparent` header, else None."""
    match = _TRACEPARENT.match(header.strip())
    if match is None or (match.group(1) == "00" and match.group(3) is not None):
        return None
    return match.group(2)
