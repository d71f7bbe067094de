"""The gateway's reading of a relayed stream (ac_observe.gateway.sse): content events and
usage found whatever the chunking, hostile streams cost nothing."""
from __future__ import annotations

from ac_observe.gateway.sse import MAX_EVENT_BYTES, EventReader, usage_of_body

OPENAI = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
          b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
          b'data: {"choices":[{"index":0,"text":"lo"}]}\r\n\r\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
          b"data: [DONE]\n\n")
ANTHROPIC = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
             b'{"input_tokens":11,"output_tokens":0}}}\n\n'
             b'event: ping\ndata: {"type":"ping"}\n\n'
             b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"a"}}\n\n'
             b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"b"}}\n\n'
             b'event: message_delta\ndata: {"type":"message_delta","usage":'
             b'{"output_tokens":2}}\n\n')


def _content_per_chunk(stream: bytes, size: int) -> tuple[list[int], EventReader]:
    reader = EventReader()
    counts = [reader.feed(stream[i:i + size]) for i in range(0, len(stream), size)]
    return counts, reader


def test_content_events_and_usage_whatever_the_chunking():
    for stream, prompt, output in ((OPENAI, 7, 2), (ANTHROPIC, 11, 2)):
        for size in (1, 3, 17, len(stream)):
            counts, reader = _content_per_chunk(stream, size)
            # the empty role chunk and the ping are no content; each text event is one
            assert sum(counts) == 2, (size, counts)
            assert (reader.usage.prompt_tokens, reader.usage.output_tokens) == (prompt, output)
            assert reader.malformed == 0


def test_the_first_content_is_counted_in_the_chunk_that_completes_it():
    reader = EventReader()
    first = OPENAI.index(b"Hel")
    assert reader.feed(OPENAI[:first + 5]) == 0  # the event's end not yet here
    end = OPENAI.index(b"\n\n", first) + 2
    assert reader.feed(OPENAI[first + 5:end]) == 1


def test_hostile_streams_are_counted_not_raised():
    reader = EventReader()
    assert reader.feed(b"data: {oops\n\ndata: [1,2]\n\ndata: \xff\xfe\n\n") == 0
    assert reader.malformed == 3
    reader.feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1))  # never terminated: dropped
    assert reader.malformed == 4
    assert reader.feed(b'\n\ndata: {"choices":[{"delta":{"content":"z"}}]}\n\n') == 1
    assert reader.feed(b'data: {"type":"error","error":{"type":"overloaded_error"}}\n\n') == 0
    assert reader.errors == 1
    assert reader.feed(b'data: {"usage":{"prompt_tokens":true,"completion_tokens":-1}}\n\n') \
        == 0
    assert reader.usage.prompt_tokens is None and reader.usage.output_tokens is None


def test_usage_of_a_whole_answer():
    assert usage_of_body(b'{"usage":{"input_tokens":3,"output_tokens":4}}').output_tokens == 4
    assert usage_of_body(b'{"usage":{"prompt_tokens":5,"completion_tokens":6}}') \
        .prompt_tokens == 5
    assert usage_of_body(b"not json").prompt_tokens is None


def test_what_pythons_json_writes_is_read_as_it_would_be():
    """NaN and Infinity (json.dumps writes a -inf logprob so), a lone surrogate escape and
    a BOM: not RFC 8259, yet a server in Python sends them; read, not called malformed."""
    reader = EventReader()
    stream = (b'data: {"choices":[{"delta":{"content":"a"},"logprob":-Infinity}]}\n\n'
              b'data: {"choices":[{"delta":{"content":"\\ud800"}}],"x":NaN}\n\n'
              b'data: \xef\xbb\xbf{"choices":[{"delta":{"content":"c"}}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":NaN}}\n\n')
    assert reader.feed(stream) == 3
    assert reader.malformed == 0 and reader.usage.prompt_tokens == 3
    assert reader.usage.output_tokens is None
    assert usage_of_body(b'{"usage":{"input_tokens":2,"output_tokens":5},"p":NaN}') \
        .output_tokens == 5


def test_the_fast_path_reads_as_the_general_one_for_any_split():
    """A stream of whole LF events takes bytes.split; split anywhere, the same stream goes
    through the regex path: counts, usage and malformed must not differ."""
    stream = OPENAI.replace(b"\r\n\r\n", b"\n\n") + b": keep-alive\n\ndata: {oops\n\n"
    whole = EventReader()
    total = whole.feed(stream)
    for cut in range(1, len(stream)):
        reader = EventReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == total, cut
        assert (reader.usage, reader.malformed, reader.events) == \
            (whole.usage, whole.malformed, whole.events), cut
    assert total == 2 and whole.malformed == 1
