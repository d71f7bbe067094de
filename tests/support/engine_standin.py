"""A stand-in vLLM or SGLang server process: started with the real server's command line
(`python -m vllm.entrypoints.openai.api_server --port N`, `vllm serve MODEL --port N`,
`python -m sglang.launch_server --port N`, the modules and script under
tests/support/standin_engines/), it serves a captured /metrics on every address at that
port until it is stopped, as the real server's process would for discovery to find."""
from __future__ import annotations

import signal
import sys

from support.engine_replay import EngineReplay


def main(capture: str, argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    port = int(argv[argv.index("--port") + 1])
    replay = EngineReplay(capture, host="0.0.0.0", port=port)
    replay.set("vllm:num_requests_running" if capture.startswith("vllm")
               else "sglang:num_running_reqs", 3)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.pause()
