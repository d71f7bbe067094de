"""A stand-in vLLM or SGLang server process: started with the real server's command line
(`python -m vllm.entrypoints.openai.api_server --port N`, `vllm serve MODEL --port N`,
`python -m sglang.launch_server --port N`, the modules and script under
tests/support/standin_engines/), it serves a captured /metrics on every address at that
port until it is stopped, as the real server's process would for discovery to find."""
from __future__ import annotations

import signal
import subprocess
import sys

from support.engine_replay import EngineReplay


def main(capture: str, argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    port = int(argv[argv.index("--port") + 1])
    replay = EngineReplay(capture, host="0.0.0.0", port=port)
    replay.set("vllm:num_requests_running" if capture.startswith("vllm")
               else "sglang:num_running_reqs", 3)
    # A child, as vLLM V1's EngineCore and SGLang's scheduler are: where the model runs.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])

    def stop(*_):
        child.kill()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.pause()
