"""GPU check: the paths CPU-only CI cannot run. Run on a machine with a CUDA GPU:

    .venv/bin/python scripts/gpu_check.py [--skip-bench]   (ac-observe installed in that venv)

Prints figures and exits non-zero if a check fails:
1. logits of the engine on CUDA vs transformers on the same weights (float32, TF32 off);
2. greedy float64 generations on CUDA identical to transformers, 16 concurrent requests,
   with the decode workspace off (the CUDA default) and on; bfloat16 logits close;
3. each lane on its own CUDA stream, step times from CUDA events, timing invariants;
4. the NVML collector on the real GPU (GPM on Hopper and later);
5. engine throughput vs transformers on CUDA (bench/engine_throughput.py).
Needs torch with CUDA, transformers, safetensors, tokenizers, prometheus_client, nvidia-ml-py.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def logits_and_greedy(folder: Path) -> None:
    import transformers

    from ac_observe.engine.config import EngineConfig
    from ac_observe.engine.llm_engine import Engine, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = random.Random(0)
    prompt = [rng.randrange(3, 384) for _ in range(200)]

    def logits(dtype):
        """(ours, transformers') logits of `prompt` on CUDA in `dtype`, as float32."""
        ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).cuda()
        with Engine(EngineConfig(model=str(folder), device="cuda", dtype=str(dtype)[6:]),
                    start=False) as engine:
            ours = engine.prompt_logits(prompt).float()
        with torch.no_grad():
            return ours, ref(torch.tensor([prompt], device="cuda")).logits[0].float()

    ours, theirs = logits(torch.float32)
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    check(rel < 1e-3, f"float32 logits on CUDA match transformers (max rel err {rel:.2e})")

    # bfloat16 (the CUDA default) rotates q/k with real arithmetic, not complex kernels.
    # Its rounding differs from transformers' own bfloat16 run; both are judged against
    # the float32 logits (RMS error), and ours may not stray further than 1.1x theirs.
    ours16, theirs16 = logits(torch.bfloat16)
    ours_err, their_err = (((t - theirs).pow(2).mean().sqrt()
                            / theirs.pow(2).mean().sqrt()).item() for t in (ours16, theirs16))
    check(ours_err <= 1.1 * their_err, f"bfloat16 logits on CUDA: RMS error vs float32 "
                                       f"{ours_err:.2e} (transformers bfloat16: {their_err:.2e})")

    ref64 = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).cuda()
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(1, 90))] for _ in range(16)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            gen = ref64.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False, pad_token_id=0)
        expected.append(gen[0, len(prompt):].tolist())
    # "off" (the CUDA default) gathers paged blocks each step; "on" keeps a workspace.
    for workspace in ("off", "on"):
        with Engine(EngineConfig(model=str(folder), device="cuda", dtype="float64",
                                 decode_workspace=workspace)) as engine:
            outs = engine.generate_batch(prompts, SamplingParams(max_tokens=24))
        same = sum(want == out.new_token_ids for want, out in zip(expected, outs))
        check(same == 16, f"greedy float64 on CUDA identical to transformers, decode "
                          f"workspace {workspace} ({same}/16)")


def streams_and_timing(tmp: Path) -> None:
    from ac_observe.engine.config import EngineConfig
    from ac_observe.engine.llm_engine import Engine, SamplingParams

    with Engine(EngineConfig(device="cuda", telemetry_dir=str(tmp / "telemetry"))) as engine:
        streams = engine.runner.streams
        check(len(streams) == 2 and streams["low_latency"] != streams["throughput"],
              "one CUDA stream per lane")
        rng = random.Random(1)
        handles = [engine.add_request([rng.randrange(256) for _ in range(rng.randint(8, 300))],
                                      lane="low_latency" if i % 3 == 0 else "throughput",
                                      params=SamplingParams(max_tokens=64, ignore_eos=True))
                   for i in range(48)]
        outs = [h.result() for h in handles]
        lanes = dict(engine.stats.lanes)
    ok = all(0 <= o.trace.queue_ns <= o.trace.ttft_ns <= o.trace.e2e_ns for o in outs)
    check(ok, "queue <= TTFT <= e2e on every request")
    ok = all((o.trace.prefill_ms + o.trace.decode_ms) * 1e6 <= o.trace.e2e_ns for o in outs)
    check(ok, "per-request device time <= e2e")
    for name, totals in lanes.items():
        elapsed = (totals.last_step_end_ns - totals.first_step_start_ns) / 1e9
        check(0 < totals.busy_seconds <= elapsed,
              f"lane {name}: busy {totals.busy_seconds * 1e3:.1f} ms <= elapsed "
              f"{elapsed * 1e3:.1f} ms over {totals.num_steps} steps")
    ttfts = sorted(o.trace.ttft_ns / 1e6 for o in outs)
    print(f"     TTFT ms p50 {ttfts[len(ttfts) // 2]:.2f}  max {ttfts[-1]:.2f}")


def nvml() -> None:
    from ac_observe.collectors.nvml import NvmlCollector

    collector = NvmlCollector()
    try:
        families = {f.name: f for f in collector.collect()}
        time.sleep(1.0)
        families = {f.name: f for f in collector.collect()}
    finally:
        collector.close()
    for name, family in sorted(families.items()):
        for sample in family.samples:
            print(f"     {sample.name}{sample.labels} = {sample.value:g}")
    check("ac_gpu_utilization_ratio" in families, "NVML utilisation read")
    check("ac_gpu_memory_used_bytes" in families, "NVML memory read")
    name = torch.cuda.get_device_name()
    if torch.cuda.get_device_capability()[0] >= 9:
        check("ac_gpu_sm_occupancy_ratio" in families, f"GPM metrics on {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.checkpoints import write_hf_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_hf_checkpoint(Path(tmp) / "ckpt")
        logits_and_greedy(folder)
        streams_and_timing(Path(tmp))
    nvml()
    if not args.skip_bench:
        subprocess.run([sys.executable, "bench/engine_throughput.py", "--device", "cuda"],
                       check=False)
    print(f"{len(FAILURES)} failed" if FAILURES else "all GPU checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
