"""Stand-in for the `vllm` script (`vllm serve MODEL --port N`): a test installs it as an
executable named `vllm` (tests/support/engine_standin.py)."""
import sys

from support.engine_standin import main

if __name__ == "__main__":
    assert sys.argv[1] == "serve", sys.argv
    main("vllm_v1_0.10.prom", sys.argv[2:])
