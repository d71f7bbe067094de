"""`ac-observe up`: an engine and a daemon as child processes, stopped together.

Children get SIGTERM when `up` exits by any path, and the kernel kills them if `up`
itself dies (PR_SET_PDEATHSIG), so no orphan outlives it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ac_observe.daemon.cli", *args], env=env,
                            preexec_fn=_die_with_parent)


def run_up(engine_port: int, daemon_port: int, model: str, demo_load: bool,
           telemetry_root: str, engine_args: list[str], daemon_args: list[str]) -> int:
    from ac_observe.telemetry_format import default_telemetry_root
    root = telemetry_root or str(default_telemetry_root())
    env = {**os.environ, "AC_OBSERVE_TELEMETRY_DIR": root}
    # Quiet children by default: the terminal shows where to look, not access logs.
    engine_cmd = ["engine", "--port", str(engine_port), "--model", model, "--log-level",
                  "warning", *engine_args]
    if demo_load:
        engine_cmd.append("--demo-load")
    daemon_cmd = ["daemon", "--port", str(daemon_port), "--telemetry-root", root, "--log-level",
                  "warning", *daemon_args]
    children = [_spawn(daemon_cmd, env), _spawn(engine_cmd, env)]
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"""
ac-observe is up
  engine   http://127.0.0.1:{engine_port}   (Anthropic /v1/messages, OpenAI /v1/chat/completions)
  daemon   http://127.0.0.1:{daemon_port}/metrics
  try      ac-observe --daemon http://127.0.0.1:{daemon_port} --metric cuda_stream_utilization --window 60s
           ac-observe --daemon http://127.0.0.1:{daemon_port} status
  stop     Ctrl-C
""", file=sys.stderr, flush=True)
    code = 0
    try:
        while not stopping:
            for child in children:
                if child.poll() is not None:
                    print(f"ac-observe up: {' '.join(child.args[3:5])} exited with "
                          f"{child.returncode}; stopping", file=sys.stderr)
                    code = child.returncode or 1
                    stopping = True
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 15
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return code
