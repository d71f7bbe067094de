"""ac-observe's pass-through gateway: a process in front of any OpenAI- or
Anthropic-compatible server that measures what the client sees (time to first token,
inter-token gaps, outcome) and the prompts' skeletons, and writes them as engine telemetry
under its own engine name (kind `gateway`).

- `sse`: the events of a relayed stream, read without changing a byte.
- `measure`: one request's figures, and the writer they go to.
- `http_server`: the HTTP/1.1 server clients talk to (asyncio protocols, httptools).
- `exchange`: one request and its answer, as the handler sees them.
- `proxy`: the request handler (relay, limits, errors, trace context).
- `upstream`: the pooled keep-alive connections to the upstream (httptools' parser).
- `serve`: the process (the event loop, the telemetry directory, signals).

NOTE: never imports torch (tests/test_packaging.py checks it): `pip install ac-observe`
runs it.
"""
