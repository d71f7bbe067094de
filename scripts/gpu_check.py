"""GPU check: what CPU-only CI cannot run, as one command that fits in 8 minutes.

    .venv/bin/python scripts/gpu_check.py [--out gpu_check.json] [--skip-bench]
    .venv/bin/python scripts/gpu_check.py --dry-run     # the same code on CPU (CI runs it)

Prints one line per check and writes every result and figure to a JSON file; exits 1 if
a check fails. Nothing is downloaded: checkpoints are written here, the big model is the
random `random-1b` preset. Checks:
 1. logits vs transformers on the same weights: float32 (TF32 off) and bfloat16;
 2. float64 greedy identical to transformers for 16 concurrent requests whose batch
    shrinks as they finish, decode by CUDA graphs (the CUDA default: padded buckets), eager
    and over the workspace; the graphs were captured and replayed;
 3. two lanes overlapping with cross-lane prefix hits generate what one lane alone does
    and what transformers does (float32 greedy); no request ends in ERROR;
 4. a step's path never synchronises the device but for its own end event
    (torch.cuda.set_sync_debug_mode("error"));
 5. event-timed step time against the kernels' own time (torch.profiler), within 10 %;
    sampled kernel time: each sampled step's seconds per kernel class equal the profiler's
    own per-class sums, and named classes hold >= 95 % of the kernel time;
 6. both lanes' loads at once finish in under 90 % of the time each takes alone (their
    streams really overlap); utilisation summed over the lanes is reported;
 7. NVML through the collector (GPM SM occupancy non-zero under load on Hopper+); the eBPF
    collector on the engine: launches per lane and sync waits moving with load (needs root
    and bcc; the script says when it cannot run);
 8. the ~1B model: tokens/s at batch 1 and 16, decode step time against the memory-bandwidth
    floor (weights + KV read per step / HBM bandwidth measured here), and a decode step's
    wall time without graphs against with them.
With --dry-run the same code runs on the CPU with the tiny preset; the verdicts that only a
GPU can give (4-7) are shown as "skipped" with what was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ac_observe.engine.config import EngineConfig  # noqa: E402
from ac_observe.engine.llm_engine import Engine, FinishReason, SamplingParams  # noqa: E402
from support.checkpoints import write_hf_checkpoint  # noqa: E402  (test helper, not shipped)

RESULTS: dict = {"checks": [], "figures": {}}
DRY_RUN = False  # on CPU: GPU-only verdicts are shown, not judged


def check(name: str, ok: bool, detail: str = "", gpu_only: bool = False) -> bool:
    if gpu_only and DRY_RUN:
        skip(name, f"judged on a GPU only ({detail})")
        return True
    print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail else ""), flush=True)
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    return ok


def skip(name: str, why: str) -> None:
    print(f"SKIP {name}: {why}", flush=True)
    RESULTS["checks"].append({"name": name, "ok": None, "detail": why})


def figure(name: str, value) -> None:
    print(f"     {name} = {value}", flush=True)
    RESULTS["figures"][name] = value


def no_errors(outs, what: str) -> bool:
    bad = [o.finish_reason for o in outs if o.finish_reason is FinishReason.ERROR]
    return check(f"{what}: no request ends in error", not bad, f"{len(bad)} errors")


def _prompts(rng, count, vocab, prefix=()):
    return [list(prefix) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))]
            for _ in range(count)]


def logits_vs_transformers(folder: Path, device: str) -> None:
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompt = [random.Random(0).randrange(3, 384) for _ in range(200)]

    def logits(dtype):
        ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
        with Engine(EngineConfig(model=str(folder), device=device, dtype=str(dtype)[6:]),
                    start=False) as engine:
            ours = engine.prompt_logits(prompt).float()
        with torch.no_grad():
            return ours, ref(torch.tensor([prompt], device=device)).logits[0].float()

    ours, theirs = logits(torch.float32)
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    check("float32 logits match transformers", rel < 1e-3, f"max rel err {rel:.2e}")
    ours16, theirs16 = logits(torch.bfloat16)
    ours_err, their_err = (((t - theirs).pow(2).mean().sqrt()
                            / theirs.pow(2).mean().sqrt()).item() for t in (ours16, theirs16))
    check("bfloat16 logits as close to float32 as transformers' bfloat16",
          ours_err <= 1.1 * their_err, f"RMS err {ours_err:.2e} vs {their_err:.2e}")


def _reference(folder: Path, device: str, dtype, prompts, new_tokens) -> list[list[int]]:
    import transformers
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


DECODE_PATHS = {  # how a decode step runs: CUDA graphs (the CUDA default), eager, workspace
    "graphs": dict(cuda_graphs="on", decode_workspace="off"),
    "eager": dict(cuda_graphs="off", decode_workspace="off"),
    "workspace": dict(cuda_graphs="off", decode_workspace="on"),
}


def greedy_float64(folder: Path, device: str) -> None:
    prompts = _prompts(random.Random(1), 16, 384)
    budgets = [8 + (i * 5) % 17 for i in range(len(prompts))]  # the batch shrinks: padding
    expected = [_reference(folder, device, torch.float64, [p], n)[0]
                for p, n in zip(prompts, budgets, strict=False)]
    for path, options in DECODE_PATHS.items():
        if device == "cpu" and path == "graphs":  # the dry run: fewer buckets to warm up
            options = {**options, "cuda_graph_max_len": 256}
        with Engine(EngineConfig(model=str(folder), device=device, dtype="float64",
                                 **options)) as engine:
            handles = [engine.add_request(p, params=SamplingParams(max_tokens=n))
                       for p, n in zip(prompts, budgets, strict=False)]
            outs = [h.result() for h in handles]
            graphs = list(engine.runner.graphs.values())
        same = sum(want == out.new_token_ids for want, out in zip(expected, outs, strict=False))
        check(f"float64 greedy = transformers, decode {path}", same == 16,
              f"{same}/16 identical")
        no_errors(outs, f"float64 greedy, decode {path}")
        if path == "graphs":
            check("decode graphs captured and replayed",
                  all(g.captured for g in graphs) and sum(g.replays for g in graphs) > 0,
                  f"{sum(len(g.graphs) for g in graphs)} graphs, "
                  f"{sum(g.replays for g in graphs)} replays", gpu_only=True)


def two_lanes(folder: Path, device: str) -> None:
    rng = random.Random(2)
    system = [rng.randrange(3, 384) for _ in range(48)]
    prompts = _prompts(rng, 12, 384, system)
    lanes = ["low_latency" if i % 2 else "throughput" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=20)
    config = dict(model=str(folder), device=device, dtype="float32")
    with Engine(EngineConfig(**config, overlap_lanes="off")) as engine:  # one at a time
        alone = [engine.generate(p, params=params) for p in prompts]
    with Engine(EngineConfig(**config, overlap_lanes="on")) as engine:
        engine.generate(prompts[0], params=params)  # its prefix is cached for both lanes
        handles = [engine.add_request(p, params=params, lane=lane)
                   for p, lane in zip(prompts, lanes, strict=False)]
        mixed = [h.result() for h in handles]
    same = sum(a.new_token_ids == b.new_token_ids for a, b in zip(alone, mixed, strict=False))
    check("two overlapping lanes generate what one request alone does", same == len(prompts),
          f"{same}/{len(prompts)}")
    hits = sum(o.trace.kv_hit_blocks for o, lane in zip(mixed, lanes, strict=False)
               if lane == "low_latency")
    check("prefix hits across lanes", hits > 0, f"{hits} blocks on low_latency")
    expected = _reference(folder, device, torch.float32, prompts, 20)
    same = sum(want == o.new_token_ids for want, o in zip(expected, mixed, strict=False))
    check("two overlapping lanes = transformers (float32 greedy)", same == len(prompts),
          f"{same}/{len(prompts)}")
    no_errors(alone + mixed, "two lanes")


def _load(engine, lanes=("low_latency", "throughput"), count=32, new_tokens=64, seed=3):
    rng = random.Random(seed)
    handles = [engine.add_request([rng.randrange(3, 250) for _ in range(rng.randint(16, 400))],
                                  lane=lanes[i % len(lanes)],
                                  params=SamplingParams(max_tokens=new_tokens, ignore_eos=True))
               for i in range(count)]
    return handles


def no_hidden_syncs(model: str, device: str) -> None:
    if device != "cuda":
        skip("steps synchronise only on their own end event", "sync debug mode needs CUDA")
        return
    with Engine(EngineConfig(model=model, device="cuda", overlap_lanes="on"),
                start=False) as engine:
        handles = _load(engine, count=16, new_tokens=16)
        engine.step()  # warm-up outside the check (allocator, kernels)
        torch.cuda.set_sync_debug_mode("error")
        try:
            while engine.step():
                pass
            ok, detail = True, "no synchronising call on a step's path"
        except RuntimeError as exc:
            ok, detail = False, str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.run_until_idle()
        check("steps synchronise only on their own end event", ok, detail)
        no_errors([h.result() for h in handles], "sync-debug run")


def timing_vs_profiler(model: str, device: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with Engine(EngineConfig(model=model, device=device, overlap_lanes="off"),
                start=False) as engine:
        _load(engine, lanes=("throughput",), count=16, new_tokens=32)
        for _ in range(3):
            engine.step()
        busy_before = engine.stats.lane("throughput").busy_seconds
        with profile(activities=[activity]) as prof:
            for _ in range(20):
                engine.step()
            if device == "cuda":
                torch.cuda.synchronize()
        event_seconds = engine.stats.lane("throughput").busy_seconds - busy_before
        engine.run_until_idle()
    averages = prof.key_averages()  # self times: a parent op never counts its kernels again
    kernel_seconds = (sum(e.self_device_time_total for e in averages) if device == "cuda"
                      else sum(e.self_cpu_time_total for e in averages)) / 1e6
    ratio = event_seconds / kernel_seconds if kernel_seconds else float("inf")
    figure("decode: event time / kernel time", round(ratio, 3))
    check("event step times within 10 % of kernel time", 0.9 <= ratio <= 1.1,
          f"events {event_seconds * 1e3:.1f} ms, kernels {kernel_seconds * 1e3:.1f} ms",
          gpu_only=True)


def kernel_classes(model: str, device: str) -> None:
    """Sampled kernel time on the real device: every step sampled; the classes of each
    sampled step equal the profiler's own figures (its FunctionEvent tree and the kernels
    it links to each op), named classes hold >= 95 % of the kernel time, and the exported
    seconds are those figures."""
    from ac_observe.engine.kernel_sampler import attribute
    from support.kernel_reference import classes_from_function_events
    with Engine(EngineConfig(model=model, device=device, overlap_lanes="off",
                             kernel_sample_steps=1, kernel_sample_budget=1.0),
                start=False) as engine:
        _load(engine, lanes=("throughput",), count=16, new_tokens=12)
        for _ in range(3):
            engine.step()  # warm-up: allocator, kernels, the profiler's first start
        sampler = engine.kernel_sampler
        worst_gap, worst_other, shares = 0.0, 0.0, {}
        for _ in range(4):
            engine.step()
            prof = sampler.last_profile
            ours = attribute(prof.kineto_results.events(), sampler.device_kernels)
            theirs = classes_from_function_events(prof, sampler.device_kernels)
            for key in set(ours) | set(theirs):
                a = {c: ns / 1e3 for c, ns in ours.get(key, {}).items()}
                b = theirs.get(key, {})
                total = sum(b.values()) or 1.0
                worst_gap = max(worst_gap, max(abs(a.get(c, 0.0) - b.get(c, 0.0))
                                               for c in set(a) | set(b)) / total)
                worst_other = max(worst_other, b.get("other", 0.0) / total)
                shares = {c: round(us / total, 4) for c, us in sorted(b.items())}
        engine.run_until_idle()
    figure("kernel classes of the last sampled step (shares)", shares)
    figure("kernel classes: largest gap to the profiler, share of step", round(worst_gap, 6))
    check("kernel classes equal the profiler's own per-class sums", worst_gap <= 1e-4,
          f"largest gap {worst_gap:.2e} of a step's kernel time")
    check("named kernel classes cover >= 95 % of a step's kernel time", worst_other <= 0.05,
          f"other at most {worst_other:.1%}")


def lanes_overlap(model: str, device: str) -> None:
    """Each lane's load alone, then both at once: overlapping streams finish both in less
    than the two alone took (utilisation above 100 % by itself could be two spans that
    merely contain each other's kernels)."""
    def run(lanes) -> tuple[float, dict, list]:
        with Engine(EngineConfig(model=model, device=device, overlap_lanes="on")) as engine:
            for handle in _load(engine, lanes=lanes, count=4, new_tokens=8):  # warm-up
                handle.result()
            started = time.perf_counter()
            per_lane, tokens = (32, 128) if device == "cuda" else (4, 16)  # dry run: short
            outs = [h.result() for h in _load(engine, lanes=lanes, count=per_lane * len(lanes),
                                              new_tokens=tokens)]
            wall = time.perf_counter() - started
            return wall, {n: t.busy_seconds for n, t in engine.stats.lanes.items()}, outs

    low, _, outs_low = run(("low_latency",))
    high, _, outs_high = run(("throughput",))
    both, busy, outs = run(("low_latency", "throughput"))
    total = sum(busy.values()) / both
    figure("stream utilisation, both lanes summed", round(total, 3))
    figure("both lanes together / each alone, summed", round(both / (low + high), 3))
    check("lanes overlap: both together take under 90 % of each alone", both < 0.9 * (low + high),
          f"{both:.2f} s vs {low:.2f} + {high:.2f} s; utilisation summed {total:.0%}",
          gpu_only=True)
    no_errors(outs + outs_low + outs_high, "overlapping lanes")


# Families the NVML and eBPF collectors gave samples for under load (contract names), for
# the dashboards' hardware panels (dashboard_panels).
SEEN: set[str] = set()


def _seen(families) -> None:
    from ac_observe.metrics import BY_FAMILY
    for family in families:
        if family.samples and family.name in BY_FAMILY:
            SEEN.add(BY_FAMILY[family.name].name)


def dashboard_panels(model: str, device: str) -> None:
    """The panels tests/test_dashboards.py leaves to this script (NVML and eBPF ones): every
    family each of their queries names had samples from the collectors under load."""
    from ac_observe.dashboards import generate, grafana
    hardware = [(board.uid, panel.title, expr) for board in generate.boards()
                for _, panels in board.rows for panel in panels
                for expr, _ in panel.targets
                if grafana.needs_hardware(expr) not in (None, grafana.ON_SCRAPED)]
    missing = [(title, sorted(grafana.families_named(expr) - SEEN))
               for _, title, expr in hardware if grafana.families_named(expr) - SEEN]
    figure("hardware panel queries", len(hardware))
    check("every NVML and eBPF panel's families have samples", not missing, str(missing),
          gpu_only=True)


def nvml_under_load(model: str, device: str) -> None:
    import threading

    from ac_observe.collectors.base import CollectorUnavailable
    from ac_observe.collectors.nvml import NvmlCollector
    collector = NvmlCollector()
    if device != "cuda":
        try:
            collector.collect()
            skip("NVML", "no CUDA device, yet NVML answered")
        except CollectorUnavailable as exc:
            skip("NVML", f"down as it should be without a driver: {exc}")
        return
    with Engine(EngineConfig(model=model, device="cuda")) as engine:
        handles = _load(engine, count=64, new_tokens=256)
        time.sleep(1.0)
        try:
            collector.collect()
            time.sleep(1.0)
            families = {f.name: f for f in collector.collect()}
            _seen(families.values())
        finally:
            collector.close()
        threading.Thread(target=lambda: [h.abort() for h in handles]).start()
    for family in families.values():
        for sample in family.samples:
            figure(f"{sample.name}{{gpu={sample.labels.get('gpu')}}}", sample.value)
    check("NVML utilisation and memory read", {"ac_gpu_utilization_ratio",
                                               "ac_gpu_memory_used_bytes"} <= set(families))
    # This process ran the load: a process sample shows SMs busy (by pid as NVML sees it,
    # the host's, which in a container is not os.getpid()).
    per_process = {s.labels.get("pid"): s.value for s in getattr(
        families.get("ac_gpu_process_sm_utilization_ratio"), "samples", [])}
    check("NVML per-process SM use under load", any(v > 0 for v in per_process.values()),
          str(per_process))
    if torch.cuda.get_device_capability()[0] >= 9:
        occupancy = [s.value for s in families.get("ac_gpu_sm_occupancy_ratio",
                                                   type("F", (), {"samples": []})).samples]
        check("GPM SM occupancy non-zero under load", any(v > 0 for v in occupancy),
              str(occupancy))


def ebpf_on_the_engine(model: str, device: str) -> None:
    """The eBPF collector attached to this process's CUDA libraries: launches named by lane
    (engine.json publishes the streams) and sync waits, before and after some load."""
    from types import SimpleNamespace

    from ac_observe.collectors.base import CollectorUnavailable
    from ac_observe.collectors.ebpf import EbpfCollector
    name = "eBPF launches per lane and sync waits move with load"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "telemetry"
        with Engine(EngineConfig(model=model, device=device, overlap_lanes="on",
                                 telemetry_dir=str(root / "e1"))) as engine:
            collector = EbpfCollector(SimpleNamespace(telemetry_root=root, telemetry_owner=None))
            try:
                before = _ebpf_counts(collector)
            except CollectorUnavailable as exc:
                skip(name, f"the collector cannot run here: {exc}")
                collector.close()
                return
            outs = [h.result() for h in _load(engine, count=32, new_tokens=32)]
            after = _ebpf_counts(collector)
            collector.close()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    for key, value in sorted(moved.items()):
        figure(f"eBPF {key}", value)
    lanes = [moved.get(("launches", lane), 0) for lane in ("low_latency", "throughput")]
    check(name, min(lanes) > 0 and sum(v for (kind, _), v in moved.items()
                                       if kind == "waits") > 0, str(moved), gpu_only=True)
    # Decode replays CUDA graphs (one launch a step): the probes must see them.
    check("eBPF counts the decode graphs' launches", moved.get(("graph launches", "all"), 0)
          > 0, str(moved.get(("graph launches", "all"), 0)), gpu_only=True)
    no_errors(outs, "eBPF run")


def _ebpf_counts(collector) -> dict:
    counts = {}
    families = collector.collect()
    _seen(families)
    for family in families:
        for sample in family.samples:
            if sample.labels.get("pid") != str(os.getpid()):
                continue
            if sample.name == "ac_cuda_kernel_launches_total":
                counts[("launches", sample.labels["stream"])] = sample.value
            elif sample.name == "ac_cuda_graph_launches_total":
                counts[("graph launches", "all")] = sample.value
            elif sample.name == "ac_cuda_sync_wait_seconds_count":
                counts[("waits", sample.labels["api"])] = sample.value
    return counts


def big_model(model: str, device: str, skip_bench: bool) -> None:
    with Engine(EngineConfig(model=model, device=device), start=False) as engine:
        mc, runner = engine.runner.model.config, engine.runner
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        figure("model parameters", sum(p.numel() for p in runner.model.parameters()))
        if skip_bench:
            return
        for batch in (1, 16):
            handles = _load(engine, lanes=("throughput",), count=batch, new_tokens=128,
                            seed=batch)
            started = time.perf_counter()
            engine.run_until_idle()
            elapsed = time.perf_counter() - started
            outs = [h.result() for h in handles]
            figure(f"tokens/s at batch {batch}",
                   round(sum(o.num_output_tokens for o in outs) / elapsed, 1))
        # Decode floor: every step reads all weights and the batch's KV once.
        step_seconds, graph_wall, steps = _decode_steps(engine)
        kv_bytes = 16 * 288 * 2 * mc.num_hidden_layers * mc.num_key_value_heads * \
            mc.head_dim * runner.kv_pool.element_size()
        bandwidth = _bandwidth(device)
        floor = (weights + kv_bytes) / bandwidth
        figure("decode step ms (batch 16, ~290 context)", round(step_seconds * 1e3, 3))
        figure("memory-bandwidth floor ms", round(floor * 1e3, 3))
        figure("measured bandwidth GB/s", round(bandwidth / 1e9, 1))
        figure("decode step / floor", round(step_seconds / floor, 2))
        no_errors([h.result() for h in steps], "big model")
    # The same decode without graphs: what replaying one graph a step saves.
    with Engine(EngineConfig(model=model, device=device, cuda_graphs="off"),
                start=False) as engine:
        eager_step, eager_wall, eager = _decode_steps(engine)
        no_errors([h.result() for h in eager], "big model, no graphs")
    figure("decode step ms without graphs (batch 16)", round(eager_step * 1e3, 3))
    figure("decode wall ms a step without graphs / with", round(
        eager_wall / graph_wall, 2))


def _decode_steps(engine) -> tuple[float, float, list]:
    """16 requests of 256 tokens decoding 64 steps on a started=False engine: (device
    seconds a decode step, wall seconds a decode step, the handles)."""
    handles = [engine.add_request([5] * 256, params=SamplingParams(max_tokens=65,
                                                                    ignore_eos=True))
               for _ in range(16)]
    engine.step()  # prefill
    lane = engine.stats.lane("throughput")
    busy, count, started = lane.busy_seconds, lane.num_steps, time.perf_counter()
    engine.run_until_idle()
    steps = lane.num_steps - count
    return (lane.busy_seconds - busy) / steps, (time.perf_counter() - started) / steps, \
        handles


def _bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), best of 5."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * n / best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU, small models")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: nothing to check (use --dry-run to exercise the script on CPU)")
        return 2
    device = "cuda" if cuda else "cpu"
    RESULTS.update(device=torch.cuda.get_device_name() if cuda else "cpu (dry run)",
                   torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"device {RESULTS['device']}  torch {torch.__version__}", flush=True)
    big = "random-1b" if cuda else "tiny"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_hf_checkpoint(Path(tmp) / "ckpt")
        logits_vs_transformers(folder, device)
        greedy_float64(folder, device)
        two_lanes(folder, device)
    for run in (no_hidden_syncs, timing_vs_profiler, kernel_classes, lanes_overlap,
                nvml_under_load, ebpf_on_the_engine, dashboard_panels):
        run(big, device)
    big_model(big, device, args.skip_bench)
    figure("seconds", round(time.perf_counter() - started, 1))
    Path(args.out).write_text(json.dumps(RESULTS, indent=2))
    print(summary(RESULTS["checks"]), f"(results in {args.out})")
    return 1 if any(c["ok"] is False for c in RESULTS["checks"]) else 0


def summary(checks: list[dict]) -> str:
    """One line: how many passed, and by name which were skipped and which failed, so a
    run whose GPU checks never ran cannot read as all passed."""
    passed = sum(c["ok"] is True for c in checks)
    skipped = [c["name"] for c in checks if c["ok"] is None]
    failed = [c["name"] for c in checks if c["ok"] is False]
    parts = [f"{passed} passed"]
    if skipped:
        parts.append(f"{len(skipped)} skipped: " + "; ".join(skipped))
    if failed:
        parts.append(f"{len(failed)} FAILED: " + "; ".join(failed))
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
