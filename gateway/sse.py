"""Server-sent events read from the bytes a relay passes on, as they pass.

The reader never alters, holds back or re-frames anything: it keeps its own copy of an
unfinished event and reports the content and usage the finished ones carry. Hostile or
broken streams cost it nothing: an event over MAX_EVENT_BYTES is dropped unread (counted as
malformed), data that is not JSON is counted and skipped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import orjson

MAX_EVENT_BYTES = 1 << 20
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\n|\r")


@dataclass(slots=True)
class Usage:
    """Tokens as the response's `usage` says (None: not said)."""
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class EventReader:
    """Feed it every chunk relayed; `feed` answers how many content events (a token's
    text as the APIs send it) the chunk completed."""

    __slots__ = ("_pending", "usage", "malformed", "errors", "events")

    def __init__(self):
        self._pending = bytearray()
        self.usage = Usage()
        self.malformed = 0   # events that could not be read (not JSON, too long)
        self.errors = 0      # error events (Anthropic's `error`, OpenAI's {"error": ...})
        self.events = 0

    def feed(self, chunk: bytes) -> int:
        pending = self._pending
        if not pending and b"\r" not in chunk:
            # The common chunk: whole events, LF line ends; split in C, nothing copied twice.
            *events, rest = chunk.split(b"\n\n")
            content = 0
            for raw in events:
                content += self._event(raw)
            if rest:
                pending += rest
                self._bound()
            return content
        pending += chunk
        content = 0
        start = 0
        for match in _EVENT_END.finditer(pending):
            content += self._event(bytes(pending[start:match.start()]))
            start = match.end()
        if start:
            del pending[:start]
        self._bound()
        return content

    def _bound(self) -> None:
        if len(self._pending) > MAX_EVENT_BYTES:
            self.malformed += 1
            self._pending.clear()

    def _event(self, raw: bytes) -> int:
        if raw.startswith(b"data:") and b"\n" not in raw and b"\r" not in raw:
            text = raw[5:].removeprefix(b" ")  # one data line: most events
        else:
            data = [line[5:].removeprefix(b" ") for line in _LINE_END.split(raw)
                    if line.startswith(b"data:")]
            if not data:
                return 0  # a comment, a keep-alive, an event with no data
            text = b"\n".join(data)
        self.events += 1
        if text == b"[DONE]":
            return 0
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            event = _lenient(text)  # what json takes and orjson does not: NaN, lone surrogates
            if event is None:
                self.malformed += 1
                return 0
        if not isinstance(event, dict):
            self.malformed += 1
            return 0
        return self._read(event)

    def _read(self, event: dict) -> int:
        kind = event.get("type")
        if kind == "content_block_delta":  # Anthropic
            return 1
        if kind == "message_start":
            self._usage(_get(event, "message", "usage"))
            return 0
        if kind == "message_delta":
            self._usage(event.get("usage"))
            return 0
        if kind == "error" or "error" in event:
            self.errors += 1
            return 0
        self._usage(event.get("usage"))  # OpenAI: the last chunk when usage was asked for
        choices = event.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and _has_text(choice):
                    return 1
        return 0

    def _usage(self, usage) -> None:
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        output = usage.get("completion_tokens", usage.get("output_tokens"))
        if _count(prompt):
            self.usage.prompt_tokens = prompt
        if _count(output):
            self.usage.output_tokens = output


def _lenient(text: bytes):
    """Python's json reading of what orjson refused (NaN and Infinity as Python writes
    them, a lone surrogate escape, a BOM), None when that refuses it too."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _get(event: dict, *path):
    found: object = event
    for key in path:
        if not isinstance(found, dict):
            return None
        found = found.get(key)
    return found


def _has_text(choice: dict) -> bool:
    """A chat chunk's `delta.content` or a completion chunk's `text`, non-empty."""
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str) and delta["content"]:
        return True
    return isinstance(choice.get("text"), str) and bool(choice["text"])


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40


def usage_of_body(body: bytes) -> Usage:
    """A whole JSON answer's usage (either API's names); nothing when it is not JSON."""
    reader = EventReader()
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = _lenient(body)
    if isinstance(answer, dict):
        reader._usage(answer.get("usage"))
    return reader.usage
