"""Stand-in for vLLM's OpenAI server module (tests/support/engine_standin.py)."""
from support.engine_standin import main

if __name__ == "__main__":
    main("vllm_v1_0.10.prom")
