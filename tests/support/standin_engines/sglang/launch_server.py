"""Stand-in for SGLang's launch_server module (tests/support/engine_standin.py)."""
from support.engine_standin import main

if __name__ == "__main__":
    main("sglang_0.4.prom")
